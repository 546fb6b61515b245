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
            g = jax.lax.all_gather(x, "fsdp", tiled=True)               # [8 * SHARD]
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
    assert stats.unknown_trip_counts == 0 and hlo.decisions(text) == 0
    # the loop: its body runs TRIPS times, and so does each collective in it
    module = hlo.parse(text)
    (loop,) = [ins for _, ins in module.instructions() if ins.opcode == "while"]
    runs = hlo.executions(text)
    assert loop.trip_count == TRIPS and all(runs[c] == TRIPS for c in loop.callees)
    for kind in ("all-gather", "reduce-scatter", "collective-permute"):
        assert stats.collective_counts[kind] == hlo.count_executed(text, kind) == TRIPS
