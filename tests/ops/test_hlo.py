"""`zoo.ops.hlo`'s two views of one parse against a program whose traffic is known by hand.

A loop of known trip count whose body all-gathers, all-reduces seven buffers at once (XLA
combines them into one all-reduce of seven operands, printed with ``/*index=5*/`` among them),
reduce-scatters and permutes: the executions view (`collective_bytes`, `executions`) and the
rehearsal's counter (`hlo_stats`) both find every trip's bytes; they differ only where they
mean to, a reduce-scatter's result against its input.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zoo.ops import hlo
from zoo.partitioning import make_mesh
from zoo.train.rehearse import hlo_stats

TRIPS, SHARD, SIZES = 3, 8, tuple(range(1, 8))  # f32 elements per device


def _program_text():
    mesh = make_mesh(fsdp=8)
    perm = [(i, (i + 1) % 8) for i in range(8)]

    def f(x, ys):
        def body(_, carry):  # every collective reads the carry: none can leave the loop
            x, ys = carry
            with jax.named_scope("gathering"):
                g = jax.lax.all_gather(x, "fsdp", tiled=True)           # [8 * SHARD]
            ys = tuple(jax.lax.psum(y * g.sum(), "fsdp") for y in ys)   # SIZES
            s = jax.lax.psum_scatter(g * ys[0][0], "fsdp", tiled=True)  # [SHARD]
            return jax.lax.ppermute(x + s, "fsdp", perm), ys            # [SHARD]
        return jax.lax.fori_loop(0, TRIPS, body, (x, ys))

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=(P("fsdp"), P()),
                      check_vma=False)
    args = (jax.ShapeDtypeStruct((8 * SHARD,), jnp.float32),
            tuple(jax.ShapeDtypeStruct((n,), jnp.float32) for n in SIZES))
    return jax.jit(g).lower(*args).compile().as_text()


def test_both_views_count_every_trip_of_the_collectives(devices):
    text = _program_text()
    f32 = 4
    by_hand = {"all-gather": TRIPS * 8 * SHARD * f32, "all-reduce": TRIPS * sum(SIZES) * f32,
               "collective-permute": TRIPS * SHARD * f32}
    stats = hlo_stats(text)
    executed = hlo.collective_bytes(text)
    for kind, nbytes in by_hand.items():
        assert stats.collective_bytes[kind] == executed[kind] == nbytes, kind
    # a reduce-scatter: hlo_stats counts its input, collective_bytes its (8x smaller) result
    assert stats.collective_bytes["reduce-scatter"] == TRIPS * 8 * SHARD * f32
    assert executed["reduce-scatter"] == TRIPS * SHARD * f32
    assert stats.collective_bytes["all-to-all"] == 0 and "all-to-all" not in executed
    # one scope's collectives: the all-gather alone
    assert hlo.collective_bytes(text, scope="/gathering/") == {"all-gather": by_hand["all-gather"]}
    assert hlo.collective_bytes(text, scope="/no such scope/") == {}
    assert stats.unknown_trip_counts == 0 and hlo.decisions(text) == 0
    # the loop: its body runs TRIPS times, and so does each collective in it
    module = hlo.parse(text)
    (loop,) = [ins for _, ins in module.instructions() if ins.opcode == "while"]
    runs = hlo.executions(text)
    assert loop.trip_count == TRIPS and all(runs[c] == TRIPS for c in loop.callees)
    for kind in ("all-gather", "reduce-scatter", "collective-permute"):
        assert stats.collective_counts[kind] == hlo.count_executed(text, kind) == TRIPS


def test_device_groups_and_the_bytes_that_cross_hosts():
    """Listed groups, XLA's iota form (with a transpose), its mesh form and permute pairs
    parse to device ids; with a host per device, a collective whose group spans two hosts
    counts as crossing, one within a host does not, and one that names no group spans every
    device."""
    text = """HloModule m

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %a = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
  %b = f32[8]{0} all-reduce(%a), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
  %c = f32[8]{0} collective-permute(%b), source_target_pairs={{0,1},{1,2}}
  %e = f32[8]{0} all-reduce(%c), replica_groups=mesh['x'=2,'y'=2] {'x'}, to_apply=%add
  %f = f32[8]{0} all-reduce(%e), replica_groups=mesh['x'=2,'y'=2] {'y'}, to_apply=%add
  ROOT %d = f32[8]{0} all-reduce(%f), to_apply=%add
}
"""
    instrs = {i.name: i for _, i in hlo.parse(text).instructions()}
    assert instrs["a"].device_groups == [(0, 1), (2, 3)]
    assert instrs["b"].device_groups == [(0, 2), (1, 3)]
    assert instrs["c"].device_groups == [(0, 1), (1, 2)]
    assert instrs["d"].device_groups is None
    assert instrs["e"].device_groups == [(0, 2), (1, 3)]  # over x: y fixed
    assert instrs["f"].device_groups == [(0, 1), (2, 3)]
    stats = hlo_stats(text, hosts=[0, 0, 1, 1])  # two hosts of two devices
    assert stats.collective_bytes["all-reduce"] == 5 * 32
    assert stats.cross_host_bytes["all-reduce"] == 3 * 32  # b, e and d; not a or f
    assert stats.cross_host_bytes["collective-permute"] == 32  # the pair (1, 2)
    assert hlo_stats(text).cross_host_bytes["all-reduce"] == 0  # no hosts given


def test_a_ragged_all_to_all_counts_the_rows_it_sends():
    """XLA:GPU's async ``ragged-all-to-all-start`` (and the plain op) count as all-to-all, by
    the rows sent (operand 0), not the receive buffer or the offsets beside them."""
    ops = "%x, %buf, %o, %o, %o, %o"
    start = "((bf16[4,8]{1,0}, bf16[16,8]{1,0}), bf16[16,8]{1,0}) ragged-all-to-all-start"
    text = f"""HloModule m

ENTRY %main (x: bf16[4,8], buf: bf16[16,8], o: s64[4]) -> bf16[16,8] {{
  %x = bf16[4,8]{{1,0}} parameter(0)
  %buf = bf16[16,8]{{1,0}} parameter(1)
  %o = s64[4]{{0}} parameter(2)
  %s = {start}({ops}), replica_groups={{{{0,1,2,3}}}}
  %d = bf16[16,8]{{1,0}} ragged-all-to-all-done(%s)
  ROOT %r = bf16[16,8]{{1,0}} ragged-all-to-all({ops}), replica_groups={{{{0,1,2,3}}}}
}}
"""
    stats = hlo_stats(text)
    assert stats.collective_bytes["all-to-all"] == 2 * 4 * 8 * 2  # two ops, 64 bytes sent
    assert stats.collective_counts["all-to-all"] == 2


def test_computations_after_a_sparsecore_one_are_read():
    """XLA:TPU closes a computation that runs on the SparseCore with ``}, execution_thread=
    "sparsecore"``; the computations after it (here the async one holding a ragged
    all-to-all) are still read, and counted as often as their callers run."""
    long = ", calls=%async_computation"
    trips = ', backend_config={"known_trip_count":{"n":"3"}}'
    text = """HloModule m

%offload (p: bf16[4,8]) -> bf16[4,8] {
  ROOT %p = bf16[4,8]{1,0} parameter(0)
}, execution_thread="sparsecore"

%async_computation (a: bf16[4,8], b: bf16[16,8], o: s32[4]) -> bf16[16,8] {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = bf16[16,8]{1,0} parameter(1)
  %o = s32[4]{0} parameter(2)
  ROOT %r = bf16[16,8]{1,0} ragged-all-to-all(%a, %b, %o, %o, %o, %o), replica_groups={{0,1,2,3}}
}

%body (t: (s32[], bf16[4,8], bf16[16,8], s32[4])) -> (s32[], bf16[4,8], bf16[16,8], s32[4]) {
  %t = (s32[], bf16[4,8]{1,0}, bf16[16,8]{1,0}, s32[4]{0}) parameter(0)
  %x = bf16[4,8]{1,0} get-tuple-element(%t), index=1
  %buf = bf16[16,8]{1,0} get-tuple-element(%t), index=2
  %o = s32[4]{0} get-tuple-element(%t), index=3
  %s = {async} async-start(%x, %buf, %o){long}
  %d = bf16[16,8]{1,0} async-done(%s)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %n = (s32[], bf16[4,8]{1,0}, bf16[16,8]{1,0}, s32[4]{0}) tuple(%i, %x, %d, %o)
}

%cond (t: (s32[], bf16[4,8], bf16[16,8], s32[4])) -> pred[] {
  %t = (s32[], bf16[4,8]{1,0}, bf16[16,8]{1,0}, s32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (t: (s32[], bf16[4,8], bf16[16,8], s32[4])) -> (s32[], bf16[4,8], bf16[16,8], s32[4]) {
  %t = (s32[], bf16[4,8]{1,0}, bf16[16,8]{1,0}, s32[4]{0}) parameter(0)
  ROOT %w = {tup} while(%t), condition=%cond, body=%body{trips}
}
"""
    for key, value in dict(long=long, trips=trips, tup="(s32[], bf16[4,8]{1,0}, bf16[16,8]{1,0}, "
                           "s32[4]{0})", async_="((bf16[4,8]{1,0}, bf16[16,8]{1,0}, s32[4]{0}), "
                           "bf16[16,8]{1,0})").items():
        text = text.replace("{" + key.rstrip("_") + "}", value)
    stats = hlo_stats(text)
    assert stats.collective_counts["all-to-all"] == 3  # the loop's 3 trips
    assert stats.collective_bytes["all-to-all"] == 3 * 4 * 8 * 2


def test_convolution_flops_count_only_taps_on_real_input():
    """The TPU compiler writes dots as convolutions: a 1-long input padded to a 128 window
    (one real tap of 128), and a ragged dot's weight gradient as a dilated convolution (one
    real tap of 4 per group). Their FLOPs are the dots', not the windows'."""
    pad = "window={size=128 pad=127_127 rhs_reversal=1}, dim_labels=bf0_0oi->b0f"
    dilated = "window={size=4 stride=3 lhs_dilate=4}, dim_labels=0fb_0io->0bf"
    text = f"""HloModule m

ENTRY %main (a: bf16[64,32,1], k: bf16[128,16,32], x: bf16[4,512,32], g: bf16[4,512,8]) -> f {{
  %a = bf16[64,32,1]{{2,1,0}} parameter(0)
  %k = bf16[128,16,32]{{2,1,0}} parameter(1)
  %c = bf16[64,128,16]{{2,1,0}} convolution(%a, %k), {pad}
  %x = bf16[4,512,32]{{2,1,0}} parameter(2)
  %g = bf16[4,512,8]{{2,1,0}} parameter(3)
  ROOT %w = bf16[4,32,8]{{2,1,0}} convolution(%x, %g), {dilated}
}}
"""
    # c: [64 rows] x [128 x 16 out] x 32 in, one tap each; w: 4 groups x [32 x 8] x 512 rows
    assert hlo_stats(text).flops == 2 * 64 * 128 * 16 * 32 + 2 * 4 * 32 * 8 * 512


def test_a_loop_without_known_trip_count_reads_its_condition():
    """The TPU compiler's loops carry no ``known_trip_count``: a condition ``counter < 4``
    gives 4 trips (the body's dot counted 4 times); a data-dependent condition stays
    unknown and counts once."""
    def module(bound: str) -> str:
        return f"""HloModule m

%cond (p: (s32[], f32[8,8])) -> pred[] {{
  %p = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] {bound}
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {{
  %p = (s32[], f32[8,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,8]{{1,0}} get-tuple-element(%p), index=1
  %d = f32[8,8]{{1,0}} dot(%x, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %t = (s32[], f32[8,8]{{1,0}}) tuple(%i, %d)
}}

ENTRY %main (x: f32[8,8]) -> (s32[], f32[8,8]) {{
  %x = f32[8,8]{{1,0}} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8,8]{{1,0}}) tuple(%z, %x)
  ROOT %w = (s32[], f32[8,8]{{1,0}}) while(%t), condition=%cond, body=%body
}}
"""
    known = hlo_stats(module("constant(4)"))
    assert known.flops == 4 * 2 * 8 * 8 * 8 and known.unknown_trip_counts == 0
    unknown = hlo_stats(module("get-tuple-element(%p), index=0"))
    assert unknown.flops == 2 * 8 * 8 * 8 and unknown.unknown_trip_counts == 1
