"""zoo.ops attention: reference vs a numpy loop, and every mask under every strategy.

The cross product (`test_every_mask_strategy_and_cp`): every mask kind (`MASKS`) x {reference,
all_gather, ring} x {cp = 2, 4, 8, EP-as-CP}, forward and dq/dk/dv against a dense reference
built from the same mask function (`_dense`: the mask evaluated into a boolean matrix, softmax,
autodiff). Inputs are packed documents of uneven lengths that cross chunk boundaries, with
prefix-marked segment ids (for `PrefixLM`), trailing padding and one all-padding row, in the
*load-balanced* order (the strategies see permuted tokens; masks that leaned on array indices
would fail). One compiled program per (strategy, mesh) runs all masks, so the compile cost is
shared; head shapes (GQA, MQA, MHA, MLA-like wider q/k than v), a tensor axis and the ring's
rounds vary across the programs. The flash kernel uses 8x8 tiles so short test sequences
still take several tiles per block (its tile budgets are tested on their own in
tests/layers/test_attention_open.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from support import attention_fwd_bwd as _fwd_bwd
from zoo.ops import attention, attention_mask, dot_product_attention
from zoo.ops.flash import FlashKernel
from zoo.ops.kernels import ScoreMod, Scores
from zoo.ops.pallas_tpu import PallasTpuKernel
from zoo.ops.masks import (Causal, Chunked, Document, MaskFn, PrefixLM, SlidingWindow,
                           prefix_segment_ids)

B, L = 2, 64
SHAPES = {  # name: (N, K, H, Hv)
    "gqa": (4, 2, 16, 16),
    "mqa": (4, 1, 16, 16),
    "mha": (4, 4, 16, 16),
    "mla": (4, 4, 24, 16),
}
MESHES = {  # name: (strategy, mesh sizes)
    "cp2": ("cp", dict(fsdp=4, context=2)),
    "cp4": ("cp", dict(context=4, tensor=2)),
    "cp8": ("cp", dict(context=8)),
    "ep_as_cp": ("ep_as_cp", dict(fsdp=2, expert=2, context=2)),
    "cp4_data2": ("cp", dict(data=2, context=4)),
}


def _sentence(q_pos, kv_pos, q_seg, kv_seg):
    """A user's rule: same 5-token "sentence", or one of the document's first 4 tokens."""
    return (q_pos // 5 == kv_pos // 5) | (kv_pos < 4)


MASKS = {  # name: the mask value (None: the causal default, the shorthand path)
    "causal": None,
    "window": Causal() & SlidingWindow(7) & Document(),
    "chunked": Chunked(16) & Causal() & Document(),
    "prefix": PrefixLM() & Document(),  # the data carries prefix-marked segment ids
    "document": Document(),  # bidirectional within documents
    "user": MaskFn(_sentence) & Causal() & Document(),
}
# (strategy, mesh): head shape. With a tensor axis, MQA's one kv head is repeated per tensor
# shard (ring) and GQA's kv heads are split over it (all_gather); on cp2 MQA's K/V are
# gathered in one piece.
PROGRAMS = {
    ("ring", "cp2"): "gqa", ("all_gather", "cp2"): "mqa",
    ("ring", "cp4"): "mqa", ("all_gather", "cp4"): "gqa", ("ring", "cp8"): "mla",
    ("all_gather", "cp8"): "mha", ("ring", "ep_as_cp"): "mla", ("all_gather", "ep_as_cp"): "gqa",
}
KERNEL = FlashKernel(q_tile=8, kv_tile=8)


# -- helpers -----------------------------------------------------------------------------------

def balanced_order(length: int, cp: int) -> np.ndarray:
    """Token order of the load-balanced layout: shard r holds chunks r and 2*cp-1-r of 2*cp."""
    chunks = np.arange(length).reshape(2 * cp, length // (2 * cp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]])
                           for r in range(cp)])


def packed(doc_lengths, length):
    """Segment ids 1..n and per-document positions for documents packed into one row."""
    seg, pos = np.zeros(length, np.int32), np.arange(length, dtype=np.int32)
    start = 0
    for i, n in enumerate(doc_lengths):
        seg[start:start + n] = i + 1
        pos[start:start + n] = np.arange(n)
        start += n
    return seg, pos


@functools.cache
def partitioner(name):
    if name is None:
        return None
    strategy, sizes = MESHES[name]
    return zoo.Partitioner(zoo.make_mesh(**sizes), strategy)


@functools.cache
def data(shape, dtype="float32", full_pad_row=False, prefix=False):
    """(q, k, v, positions, segment ids, output weights) in the original token order."""
    N, K, H, Hv = SHAPES[shape]
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(B, L, N, H)), rng.normal(size=(B, L, K, H))
    v, w = rng.normal(size=(B, L, K, Hv)), rng.normal(size=(B, L, N, Hv))
    # documents of 13/30/9 and 5/37/15 tokens: they straddle every chunk size used (4..32)
    rows = [packed([13, 30, 9], L), packed([5, 37, 15], L)]
    if full_pad_row:
        rows[1] = (np.zeros(L, np.int32), np.arange(L, dtype=np.int32))
    seg = np.stack([r[0] for r in rows])
    pos = np.stack([r[1] for r in rows])
    if prefix:  # PrefixLM: the first tokens of each document are its prefix
        seg = prefix_segment_ids(seg, [[4, 10, 3], [2, 12, 5]])
    dt = jnp.dtype(dtype)
    return (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(pos),
            jnp.asarray(seg), jnp.asarray(w, jnp.float32))


def _mask_kw(mask):
    return {} if MASKS[mask] is None else dict(mask=MASKS[mask])


@functools.cache
def _reference(mask):
    fn = functools.partial(dot_product_attention, **_mask_kw(mask))
    return jax.jit(functools.partial(_fwd_bwd, fn))


def _permute(arrays, order):
    return tuple(a[:, order] for a in arrays)


# -- the reference against a loop ---------------------------------------------------------------

def numpy_attention(q, k, v, qpos, kpos, qseg, kseg, causal, window):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    Bq, Lq, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros((Bq, Lq, N, v.shape[-1]))
    for b in range(Bq):
        for i in range(Lq):
            for n in range(N):
                keys = [j for j in range(k.shape[1])
                        if qseg[b, i] != 0 and qseg[b, i] == kseg[b, j]
                        and (not causal or kpos[b, j] <= qpos[b, i])
                        and (window is None or qpos[b, i] - kpos[b, j] < window)]
                if not keys:
                    continue
                s = np.array([q[b, i, n] @ k[b, j, n // G] for j in keys]) / np.sqrt(H)
                p = np.exp(s - s.max())
                out[b, i, n] = (p / p.sum()) @ v[b, keys, n // G]
    return out


@pytest.mark.parametrize("causal,window", [(True, None), (True, 4), (False, None), (False, 3)])
def test_reference_matches_numpy_loop(causal, window):
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 12, 4, 8)), rng.normal(size=(2, 12, 2, 8)), rng.normal(
        size=(2, 12, 2, 6))
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [3] * 12])
    pos = np.array([list(range(5)) + list(range(4)) + [0] * 3, list(range(12))])
    kw = dict(q_positions=jnp.asarray(pos), kv_positions=jnp.asarray(pos),
              q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), causal=causal,
              sliding_window=window)
    got = dot_product_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), **kw)
    want = numpy_attention(q, k, v, pos, pos, seg, seg, causal, window)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[seg == 0] == 0)
    # gradients: against a naive masked softmax differentiated independently
    mask = np.asarray(attention_mask(kw["q_positions"], kw["kv_positions"], kw["q_segment_ids"],
                                     kw["kv_segment_ids"], causal=causal,
                                     sliding_window=window))

    def naive(q, k, v):
        kk, vv = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        s = jnp.einsum("blnh,bsnh->bnls", q, kk) / np.sqrt(8) - 1e9 * (~mask[:, None])
        p = jax.nn.softmax(s, axis=-1) * mask.any(-1)[:, None, :, None]
        return jnp.einsum("bnls,bsnh->blnh", p, vv)

    w = jnp.asarray(rng.normal(size=(2, 12, 4, 6)), jnp.float32)
    args = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
    g_ref = jax.grad(lambda *a: jnp.sum(dot_product_attention(*a, **kw) * w), (0, 1, 2))(*args)
    g_naive = jax.grad(lambda *a: jnp.sum(naive(*a) * w), (0, 1, 2))(*args)
    for a, b in zip(g_ref, g_naive):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, 3)])
def test_block_skip_is_sound(causal, window):
    """block_may_attend is False only when the dense mask is empty; it does skip some blocks."""
    rng = np.random.default_rng(2)
    n = 2000
    qp, kp = rng.integers(0, 24, (n, 1, 6)), rng.integers(0, 24, (n, 1, 5))
    qs, ks = rng.integers(0, 3, (n, 1, 6)), rng.integers(0, 3, (n, 1, 5))
    args = tuple(jnp.asarray(x, jnp.int32) for x in (qp, kp, qs, ks))
    may = jax.vmap(lambda *a: zoo.ops.block_may_attend(*a, causal=causal,
                                                       sliding_window=window))(*args)
    any_visible = jax.vmap(lambda *a: attention_mask(*a, causal=causal,
                                                     sliding_window=window).any())(*args)
    may, any_visible = np.asarray(may), np.asarray(any_visible)
    assert np.all(may[any_visible])
    assert 0.05 < np.mean(~may) and np.mean(may[~any_visible]) < 0.9


# -- every strategy against the reference --------------------------------------------------------

def _compare(got, want, dtype="float32", err=""):
    tol = dict(float32=(2e-4, 2e-5), bfloat16=(0, 4e-2))[dtype]
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        atol = tol[1] * max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(g, r, rtol=tol[0], atol=atol, err_msg=f"{err} {name}")


@functools.cache
def cross_data(shape):
    """Four rows: the two packed rows of `data`, one all padding, one document without padding
    (with 4 rows per device or fewer, some shards see fully visible sub-blocks); prefix-marked
    segment ids, for `PrefixLM` (the other masks compare |segment id|)."""
    q, k, v, pos, seg, w = data(shape)
    rows = lambda x, y: jnp.concatenate([x, y], axis=0)
    q, k, v, w = (rows(x, x[::-1] * 0.5) for x in (q, k, v, w))
    seg = np.concatenate([np.asarray(seg), np.zeros((1, L), np.int32), np.ones((1, L), np.int32)])
    seg = prefix_segment_ids(seg, [[4, 10, 3], [2, 12, 5], [], [6]])
    pos = rows(pos, jnp.stack([jnp.arange(L), jnp.arange(L)]).astype(pos.dtype))
    return q, k, v, pos, jnp.asarray(seg), w


def _all_masks(fn):
    """fn(q, k, v, **kw) -> attention; (out, dq, dk, dv) for every mask, in one program."""
    return lambda *a: {m: _fwd_bwd(functools.partial(fn, **_mask_kw(m)), *a) for m in MASKS}


def _dense_attention(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                     mask=None):
    """Softmax over a dense boolean mask evaluated from the same mask value, then autodiff."""
    allowed = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                             mask=mask)[:, None]  # [B, 1, L, S]
    G = q.shape[2] // k.shape[2]
    kk, vv = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("blnh,bsnh->bnls", q, kk) / np.sqrt(q.shape[-1])
    s = jnp.where(allowed, s, -1e30)
    p = jax.nn.softmax(s, axis=-1) * allowed.any(-1, keepdims=True)
    return jnp.einsum("bnls,bsnh->blnh", p, vv)


@functools.cache
def _dense(shape):
    """Every mask's (out, dq, dk, dv) from the dense reference, original token order."""
    return jax.jit(_all_masks(_dense_attention))(*cross_data(shape))


# the full ring in several rounds (`zoo.ops.ring.ring_rounds`; these short shards pick one)
ROUNDS = {("ring", "cp2"): 2, ("ring", "cp4"): 4, ("ring", "cp8"): 2}


@functools.cache
def _program(impl, mesh, shape):
    """AOT-compiled forward+backward of `attention` under every mask (HLO text checked too)."""
    fn = functools.partial(attention, partitioner=partitioner(mesh), implementation=impl,
                           kernel=KERNEL, rounds=ROUNDS.get((impl, mesh)))
    return jax.jit(_all_masks(fn)).lower(*cross_data(shape)).compile()


@pytest.mark.parametrize("impl,mesh", list(PROGRAMS), ids=[f"{i}-{m}" for i, m in PROGRAMS])
def test_every_mask_strategy_and_cp(impl, mesh):
    shape = PROGRAMS[impl, mesh]
    cp = 1 if mesh is None else partitioner(mesh).context_size()
    perm = balanced_order(L, cp)
    inputs = cross_data(shape)
    got = _program(impl, mesh, shape)(*_permute(inputs, perm))
    pad = np.asarray(inputs[4])[:, perm] == 0
    for m in MASKS:
        _compare(got[m], _permute(_dense(shape)[m], perm), err=m)
        for x in got[m]:  # padding (and the all-padding row): exact zeros, never NaN
            x = np.asarray(x)
            assert np.all(np.isfinite(x)) and np.all(x[pad] == 0), m


# zoo's Mosaic TPU kernel, run by Pallas' TPU interpreter on the CPU mesh: every mask under
# both strategies (and unsharded), against the same dense reference. 128-token tiles: the
# shards' short sub-blocks are padded to a whole tile (padding tokens the kernel adds).
PALLAS = PallasTpuKernel(block_q=128, block_kv=128)
PALLAS_PROGRAMS = {("ring", "cp2"): "mla", ("all_gather", "cp4"): "gqa", ("auto", None): "mqa"}


@pytest.mark.parametrize("impl,mesh", list(PALLAS_PROGRAMS),
                         ids=[f"{i}-{m}" for i, m in PALLAS_PROGRAMS])
def test_pallas_tpu_kernel_every_mask(impl, mesh):
    shape = PALLAS_PROGRAMS[impl, mesh]
    cp = 1 if mesh is None else partitioner(mesh).context_size()
    perm = balanced_order(L, cp)
    inputs = cross_data(shape)
    fn = functools.partial(attention, partitioner=partitioner(mesh), implementation=impl,
                           kernel=PALLAS)
    got = jax.jit(_all_masks(fn))(*_permute(inputs, perm))
    pad = np.asarray(inputs[4])[:, perm] == 0
    for m in MASKS:
        _compare(got[m], _permute(_dense(shape)[m], perm), err=m)
        for x in got[m]:
            x = np.asarray(x)
            assert np.all(np.isfinite(x)) and np.all(x[pad] == 0), m


def test_pallas_tpu_kernel_tiles_and_soft_cap():
    """One block of 300 tokens in 128-token tiles (empty, full and partial tiles, a padded
    last tile), bf16 and a soft cap: the kernel's (out, lse) and its backward from the global
    lse and delta against the flash kernel's, which walks the same block in JAX."""
    rng = np.random.default_rng(1)
    Bq, n, N, K, H, V = 2, 300, 4, 2, 32, 16
    q, k = rng.normal(size=(Bq, n, N, H)), rng.normal(size=(Bq, n, K, H))
    v, do = rng.normal(size=(Bq, n, K, V)), rng.normal(size=(Bq, n, N, V))
    q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
    seg, pos = (np.stack(x) for x in zip(packed([140, 100, 40], n), packed([300], n)))
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    toks = (pos, pos, seg, seg)
    for scores in (Scores(Causal() & Document(), H ** -0.5),
                   Scores(Causal() & Document(), H ** -0.5, soft_cap=2.0)):
        ref = FlashKernel(q_tile=32, kv_tile=32)
        want = ref.forward(q, k, v, *toks, scores=scores, masked=True)
        got = PallasTpuKernel(block_q=128, block_kv=128).for_platform("cpu").forward(
            q, k, v, *toks, scores=scores, masked=True)
        np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(want[1]))
        np.testing.assert_allclose(got[0], want[0], atol=2e-2)
        fin = np.isfinite(np.asarray(want[1]))
        np.testing.assert_allclose(np.asarray(got[1])[fin], np.asarray(want[1])[fin], atol=2e-2)
        delta = jnp.einsum("blnv,blnv->bnl", do.astype(jnp.float32), want[0])
        kw = dict(scores=scores, masked=True, delta=delta)
        g_want = ref.backward(q, k, v, *toks, None, want[1], do, **kw)
        g_got = PallasTpuKernel(block_q=128, block_kv=128).for_platform("cpu").backward(
            q, k, v, *toks, None, want[1], do, **kw)
        for name, a, b in zip("qkv", g_got, g_want):
            scale = float(np.abs(np.asarray(b)).max())
            np.testing.assert_allclose(a, b, atol=3e-2 * scale, err_msg=f"d{name}")


def test_pallas_tpu_kernel_compiles_for_a_tpu_target_with_every_mask():
    """Every mask (integer division in the chunked and the user's) through the Mosaic
    lowering for TPU v5p chips on this CPU host, under context parallelism: one kernel per
    pass (forward, dK/dV, dQ) and mask in the compiled program, named in the op's scope."""
    pytest.importorskip("libtpu", reason="the TPU compiler: pip install -e '.[test]'")
    from zoo.targets import compile_with_text
    from zoo.train import target_devices
    p = zoo.Partitioner(zoo.make_mesh(fsdp=2, context=4, devices=target_devices("tpu-v5p-8")),
                        "cp")
    spec = jax.sharding.NamedSharding(p.mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec) for x in cross_data("gqa")]
    fn = functools.partial(attention, partitioner=p, implementation="ring")
    with jax.default_device(p.target_device):  # as `zoo.train.rehearse` lowers
        lowered = jax.jit(_all_masks(fn)).lower(*args)
    text = compile_with_text(lowered, "tpu")[1]
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    for name in ("zoo_attention_fwd", "zoo_attention_dkv", "zoo_attention_dq"):
        assert sum(name in c and "attention_ring" in c for c in calls) == len(MASKS), name


def test_pallas_tpu_kernel_errors():
    with pytest.raises(ValueError, match=r"block_q=100\): tiles must be positive multiples"):
        PallasTpuKernel(block_q=100)  # at construction
    big = jax.ShapeDtypeStruct((1, 2 ** 18, 1, 128), jnp.bfloat16)  # 2**22 tile pairs
    toks = jax.ShapeDtypeStruct((1, 2 ** 18), jnp.int32)
    with pytest.raises(ValueError, match="tile table of 4,194,304 entries"):
        jax.eval_shape(lambda q, p: PallasTpuKernel(block_q=128, block_kv=128).forward(
            q, q, q, p, p, p, p, scores=Scores(Causal(), 1.0), masked=True), big, toks)
    mod = Scores(Causal(), 1.0, score_mod=ScoreMod(lambda s, *a: s))
    with pytest.raises(ValueError, match="does not take a ScoreMod"):
        PallasTpuKernel().forward(*data("gqa")[:3], *(data("gqa")[3:5] * 2), scores=mod,
                                  masked=True)


@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_reference_every_mask(shape):
    """implementation="reference" (the dense fp32 op the others are usually checked against)
    against the independent dense softmax, every mask, forward and gradients."""
    got = jax.jit(_all_masks(functools.partial(attention, implementation="reference")))(
        *cross_data(shape))
    for m in MASKS:
        _compare(got[m], _dense(shape)[m], err=m)


@pytest.mark.parametrize("impl", ["ring", "all_gather"])
def test_kv_shorter_than_queries(impl):
    """S != L (keys at every other position, both padded at the end), sharded 4 ways."""
    q, k, v, _, _, w = data("gqa")
    k, v = k[:, : L // 2], v[:, : L // 2]
    kw = dict(q_positions=jnp.tile(jnp.arange(L), (B, 1)),
              kv_positions=jnp.tile(2 * jnp.arange(L // 2), (B, 1)),
              q_segment_ids=jnp.asarray(np.repeat([[1] * 56 + [0] * 8], B, 0)),
              kv_segment_ids=jnp.asarray(np.repeat([[1] * 28 + [0] * 4], B, 0)))

    def run(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
        return (out, *vjp(w))

    got = jax.jit(lambda: run(functools.partial(
        attention, partitioner=partitioner("cp4_data2"), implementation=impl, kernel=KERNEL)))()
    _compare(got, jax.jit(lambda: run(dot_product_attention))())


def test_reference_implementation_and_no_segments():
    q, k, v, pos, _, _ = data("gqa")
    kw = dict(q_positions=pos, kv_positions=pos)
    want = dot_product_attention(q, k, v, **kw)
    np.testing.assert_array_equal(attention(q, k, v, implementation="reference", **kw), want)
    got = attention(q, k, v, partitioner=partitioner("cp8"), implementation="ring", **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)


def test_bf16_ring_within_bf16_tolerance():
    q, k, v, pos, seg, w = data("gqa", "bfloat16")
    perm = balanced_order(L, 4)
    fn = functools.partial(attention, partitioner=partitioner("cp4_data2"),
                           implementation="ring", kernel=KERNEL)
    got = jax.jit(functools.partial(_fwd_bwd, fn))(*_permute((q, k, v, pos, seg, w), perm))
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
    f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
    want = _reference("causal")(*f32, pos, seg, w)
    _compare(got, _permute(want, perm), "bfloat16")


def test_compiled_collectives():
    ring = _program("ring", "cp8", PROGRAMS["ring", "cp8"]).as_text()
    gather = _program("all_gather", "cp8", PROGRAMS["all_gather", "cp8"]).as_text()
    assert "collective-permute" in ring and "all-gather" not in ring
    assert "all-gather" in gather and "reduce-scatter" in gather
    assert "collective-permute" not in gather


# -- validation ---------------------------------------------------------------------------------

def test_errors_are_clear():
    q, k, v, pos, seg, _ = data("gqa")
    kw = dict(q_positions=pos, kv_positions=pos)
    with pytest.raises(ValueError, match="implementation='flash'"):
        attention(q, k, v, implementation="flash", **kw)
    short = dict(q_positions=pos[:, :60], kv_positions=pos[:, :60])
    with pytest.raises(ValueError, match="query length=60 is not divisible by its 8 shards"):
        attention(q[:, :60], k[:, :60], v[:, :60], partitioner=partitioner("cp8"), **short)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attention(q[:, :, :3], k, v, **kw)
    p = zoo.Partitioner(zoo.make_mesh(context=2, tensor=4), "cp")
    k3 = jnp.concatenate([k, k[:, :, :1]], axis=2)
    q6 = jnp.concatenate([q, q[:, :, :2]], axis=2)
    with pytest.raises(ValueError, match="not divisible by the tensor axis size 4"):
        attention(q6, k3, jnp.concatenate([v, v[:, :, :1]], axis=2), partitioner=p, **kw)
    with pytest.raises(ValueError, match="must divide one another"):
        p.check_heads(12, 3)
    with pytest.raises(ValueError, match="segment_ids"):
        attention(q, k, v, q_segment_ids=seg, **kw)
    with pytest.raises(ValueError, match="q_positions has shape"):
        attention(q, k, v, q_positions=pos[:, :5], kv_positions=pos)
    with pytest.raises(ValueError, match="is the whole mask"):
        attention(q, k, v, mask=Causal(), causal=True, **kw)
    with pytest.raises(ValueError, match="is the whole mask"):
        attention(q, k, v, mask=Document(), sliding_window=4, **kw)
    with pytest.raises(ValueError, match="kernel='fast' is not registered"):
        attention(q, k, v, kernel="fast", **kw)
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\)"):
        attention(q, k, v, sinks=jnp.zeros(3), **kw)
    with pytest.raises(ValueError, match="logits_soft_cap=0"):
        attention(q, k, v, logits_soft_cap=0, **kw)
    with pytest.raises(TypeError, match="MaskFn"):
        Causal() & (lambda *a: True)
    with pytest.raises(ValueError, match="layout='zigzag'; valid values"):
        attention(q, k, v, layout="zigzag", **kw)
    with pytest.raises(ValueError, match=r"length=56 is not divisible by 2.context = 16"):
        attention(q[:, :56], k[:, :56], v[:, :56], partitioner=partitioner("cp8"),
                  layout="balanced", q_positions=pos[:, :56], kv_positions=pos[:, :56])


def test_auto_rule():
    choose = zoo.ops.choose_implementation
    cp8 = partitioner("cp8")
    kw = dict(q_length=8192, kv_length=8192, head_dim=128)
    assert choose(partitioner=None, num_heads=32, num_kv_heads=8, **kw) == "all_gather"
    assert choose(partitioner=cp8, num_heads=64, num_kv_heads=4, **kw) == "all_gather"
    assert choose(partitioner=cp8, num_heads=32, num_kv_heads=8, **kw) == "ring"
    assert choose(partitioner=partitioner("cp2"), num_heads=32, num_kv_heads=8,
                  **kw) == "all_gather"
    # MLA: per-head K/V with a wider q/k head than v head
    assert choose(partitioner=cp8, num_heads=16, num_kv_heads=16, q_length=8192,
                  kv_length=8192, head_dim=192, v_head_dim=128) == "ring"
    # DeepSeek-V3's MLA: its latent crosses the wire either way, but each shard attends to the
    # expanded K/V, which no single gather holds at ~1/cp memory -> the ring
    assert choose(partitioner=cp8, num_heads=128, num_kv_heads=128, q_length=8192,
                  kv_length=8192, head_dim=192, v_head_dim=128) == "ring"
    # the rule is gather_slices' "one piece"
    from zoo.ops.ring import gather_slices
    for heads, kv_heads in ((32, 8), (64, 4), (16, 16)):
        one = gather_slices(8, (1, 1024, heads, 128), (1, 1024, kv_heads, 128),
                            (1, 1024, kv_heads, 128))[0] == 1
        assert choose(partitioner=cp8, num_heads=heads, num_kv_heads=kv_heads,
                      **kw) == ("all_gather" if one else "ring")


def test_gather_slices():
    """One gather when K/V fit in the local query size, else slices of at most a quarter of
    it that divide the block."""
    from zoo.ops.ring import gather_slices
    # 8 heads over 2 kv heads, cp=2: K/V (2*64*2*128) == local q (64*8*64) -> one gather
    assert gather_slices(2, (1, 64, 8, 64), (1, 64, 2, 64), (1, 64, 2, 64)) == (1, 64)
    # cp=8: four times too big -> slices of a quarter of the query size: 16 of 4 keys a shard
    assert gather_slices(8, (1, 64, 8, 64), (1, 64, 2, 64), (1, 64, 2, 64),
                         min_piece=1) == (16, 4)
    # MHA, cp=8, local length 24: 32 slices wanted, at most 24 -> 1 key each
    assert gather_slices(8, (1, 24, 4, 64), (1, 24, 4, 64), (1, 24, 4, 64),
                         min_piece=1) == (24, 1)
    # a gathered slice keeps the ring's floor of keys: 256 on CPU (8 x 32), 1,024 on TPU/GPU
    assert gather_slices(8, (1, 64, 8, 64), (1, 64, 2, 64), (1, 64, 2, 64)) == (2, 32)
    assert gather_slices(8, (1, 1024, 128, 192), (1, 1024, 128, 192), (1, 1024, 128, 128),
                         platform="tpu") == (8, 128)
    assert gather_slices(8, (1, 24, 4, 64), (1, 24, 4, 64), (1, 24, 4, 64)) == (1, 24)
    assert gather_slices(1, (1, 64, 4, 64), (1, 64, 4, 64), (1, 64, 4, 64)) == (1, 64)


def test_ring_rounds():
    """The full ring's rounds: the smallest power of two bringing one key piece's K and V
    within 1/16 of the local queries, pieces of at least 256 keys that divide the block."""
    from zoo.ops.ring import ring_rounds
    q, kv = (1, 2048, 8, 64), (1, 2048, 2, 64)  # the benchmark's 16k, cp=8 shard: K+V = q/2
    assert ring_rounds(8, q, kv, kv) == 8
    assert ring_rounds(8, q, kv, kv, min_piece=512) == 4  # pieces of 512 keys at least
    assert ring_rounds(1, q, kv, kv) == 1
    assert ring_rounds(8, (1, 64, 8, 64), (1, 64, 2, 64), (1, 64, 2, 64)) == 1  # too short
    assert ring_rounds(8, (1, 768, 8, 64), (1, 768, 2, 64), (1, 768, 2, 64)) == 2  # 384 keys


def test_ring_rounds_cut_the_ring_buffers():
    """In four rounds the ring's own buffers -- the K/V piece computed on and the one
    arriving, the dK/dV accumulator arriving, the piece's fresh dK/dV and the one leaving --
    are a quarter of a block each: at 512 local tokens of MHA K/V (512 KiB a block, fp32) the
    temporaries fall by more than 1.5 blocks (measured 1.9). And no all-reduce over one device
    copies the gradients (the mesh's size-1 axes are named in the specs)."""
    cp, L, N, K, H = 4, 2048, 4, 4, 32
    p = zoo.Partitioner(zoo.make_mesh(context=cp, devices=jax.devices()[:cp]), "cp")
    act = p.sharding(("batch", "length", "act_heads", "act_head_dim"), "attention")
    sds = jax.ShapeDtypeStruct
    q, kv = sds((1, L, N, H), jnp.float32, sharding=act), sds((1, L, K, H), jnp.float32,
                                                                sharding=act)
    pos = sds((1, L), jnp.int32, sharding=p.sharding(("batch", "length"), "attention"))

    def compiled(rounds):
        def fb(q, k, v, pos, dout):
            _, vjp = jax.vjp(lambda q, k, v: attention(
                q, k, v, q_positions=pos, kv_positions=pos, partitioner=p,
                implementation="ring", rounds=rounds), q, k, v)
            return vjp(dout)
        return jax.jit(fb).lower(q, kv, kv, pos, q).compile()

    one, four = compiled(1), compiled(4)
    block = (L // cp) * K * 2 * H * 4  # K and V of one shard, fp32 bytes
    saved = (one.memory_analysis().temp_size_in_bytes
             - four.memory_analysis().temp_size_in_bytes)
    assert saved > 1.5 * block, (saved, block)
    assert "all-reduce" not in four.as_text()
