"""`zoo.ops.sparse_attention` ("gather" and "dense") and the `TopK` mask against a plain
reference written here: a numpy loop builds each query's visible set (causal, same document,
not padding, selected), then a dense softmax in jnp (autodiff of it gives the reference
gradients). Rows are packed documents with padding; the same checks run on rows reordered by
`zoo.data.load_balance`, where the selection is remapped and the position-based masks must
stay exact."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.extend
import jax.numpy as jnp

from support import assert_close, packed_rows, visible_keys, visible_mask
from zoo.data import load_balance
from zoo.ops import Causal, Document, SlidingWindow, TopK, dot_product_attention
from zoo.ops.sparse_attention import choose_sparse_implementation, sparse_attention

B, L, N, TOPK = 2, 32, 4, 5
DOCS = ([7, 13, 9], [20, 6])  # the rest of each row is padding


def packed():
    return packed_rows(DOCS, L)


def selection(seed=0):
    """Distinct keys per query: up to 3 of its visible keys, the rest random (visible or not),
    in shuffled slot order, with some slots empty (-1)."""
    rng = np.random.default_rng(seed)
    pos, seg = packed()
    idx = np.full((B, L, TOPK), -1, np.int32)
    for b in range(B):
        for i in range(L):
            mine = list(rng.permutation(visible_keys(pos, seg, b, i))[:3])
            rest = [j for j in rng.permutation(L) if j not in mine][:TOPK - len(mine)]
            row = np.array(mine + rest, np.int32)
            row[rng.random(TOPK) < 0.15] = -1
            idx[b, i] = rng.permutation(row)
    return idx


def reference(q, k, v, vis, scale):
    """Dense attention of q [B, L, N, H] over shared k [B, S, H], v [B, S, Hv] (or GQA
    [B, S, K, *]) under the boolean [B, L, S] mask; rows with nothing visible are zeros."""
    if k.ndim == 3:
        k, v = k[:, :, None], v[:, :, None]
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("blnh,bsnh->bnls", q, k) * scale
    m = jnp.asarray(vis)[:, None]
    s = jnp.where(m, s, -1e30)
    p = jnp.exp(s - s.max(-1, keepdims=True)) * m
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bnls,bsnv->blnv", p, v)


def inputs(form, seed=1):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, L, N, 12), jnp.float32)
    if form == "mla":  # one shared latent+rope key, values = its leading 8 dims
        return q, jax.random.normal(ks[1], (B, L, 12), jnp.float32), None
    return (q, jax.random.normal(ks[1], (B, L, 2, 12), jnp.float32),
            jax.random.normal(ks[2], (B, L, 2, 6), jnp.float32))


def run(fn, q, k, v):
    """(out, grads of q, k[, v]) of a weighted sum of the output."""
    args = (q, k) if v is None else (q, k, v)

    @jax.jit
    def both(*args):
        out, vjp = jax.vjp(fn, *args)
        return (out, *vjp(jax.random.normal(jax.random.key(9), out.shape, out.dtype)))

    return both(*args)


def check_all(got, want, what):
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(g, r, f"{what} {name}", rtol=2e-5)


@pytest.mark.parametrize("form", ["mla", "gqa"])
def test_gather_equals_dense_equals_reference(form):
    pos, seg = packed()
    idx = selection()
    q, k, v = inputs(form)
    scale = 0.3
    vis = visible_mask(idx, pos, seg)
    assert vis.sum() > B * L  # the selection is not mostly empty
    ref_v = (lambda k: k[..., :8]) if v is None else None
    want = run(lambda q, k, *vv: reference(q, k, vv[0] if vv else ref_v(k), vis, scale),
               q, k, v)
    kw = dict(q_positions=jnp.asarray(pos), kv_positions=jnp.asarray(pos),
              q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), scale=scale,
              v_head_dim=8 if v is None else None)
    for impl, chunk in (("dense", None), ("gather", None), ("gather", 8)):
        got = run(lambda q, k, *vv, impl=impl, chunk=chunk: sparse_attention(
            q, k, vv[0] if vv else None, jnp.asarray(idx), implementation=impl,
            query_chunk=chunk, **kw), q, k, v)
        check_all(got, want, f"{form} {impl} chunk={chunk}")
        # padding rows and rows with nothing visible are exact zeros
        empty = ~vis.any(-1)
        assert empty.any() and np.all(np.asarray(got[0])[empty] == 0)


def test_topk_mask_in_dense_reference():
    """`Causal() & Document() & TopK(...)` in `dot_product_attention` equals the loop mask."""
    pos, seg = packed()
    idx = selection(seed=3)
    q, k, _ = inputs("gqa", seed=4)
    v = k
    topk = TopK.from_indices(jnp.asarray(idx), jnp.asarray(pos), jnp.asarray(seg))
    got = dot_product_attention(q, k, v, q_positions=jnp.asarray(pos),
                                kv_positions=jnp.asarray(pos), q_segment_ids=jnp.asarray(seg),
                                kv_segment_ids=jnp.asarray(seg),
                                mask=Causal() & Document() & topk, scale=0.3)
    assert_close(got, reference(q, k, v, visible_mask(idx, pos, seg), 0.3), "TopK mask")
    # any elementwise mask composes: a sliding window in both implementations
    vis = visible_mask(idx, pos, seg, window=4)
    for impl in ("dense", "gather"):
        got = sparse_attention(q, k, v, jnp.asarray(idx), q_positions=jnp.asarray(pos),
                               kv_positions=jnp.asarray(pos), q_segment_ids=jnp.asarray(seg),
                               kv_segment_ids=jnp.asarray(seg), scale=0.3,
                               mask=Causal() & Document() & SlidingWindow(4),
                               implementation=impl)
        assert_close(got, reference(q, k, v, vis, 0.3), f"window {impl}")


@pytest.mark.parametrize("strategy", ["row", "document"])
def test_load_balanced_rows(strategy):
    """Reordered rows: remapped indices give the reordered output; `TopK` built in the
    original order (keys named by segment and position) needs no remapping of its keys."""
    cp = 2
    pos, seg = packed()
    idx = selection(seed=5)
    q, k, _ = inputs("mla", seed=6)
    order = np.asarray(load_balance(
        {"o": np.broadcast_to(np.arange(L), (B, L)).copy(), "positions": pos,
         "segment_ids": seg}, cp, strategy=strategy)["o"])  # order[b, new] = old
    assert not np.array_equal(order[0], np.arange(L))
    inv = np.argsort(order, axis=1)
    take = lambda a: np.take_along_axis(np.asarray(a), order.reshape(B, L, *(1,) * (
        np.ndim(a) - 2)), axis=1)
    idx_r = take(idx)
    idx_r = np.where(idx_r >= 0, np.take_along_axis(inv, np.maximum(idx_r, 0).reshape(B, -1),
                                                    axis=1).reshape(idx_r.shape), -1)
    pos_r, seg_r = take(pos), take(seg)
    q_r, k_r = jnp.asarray(take(q)), jnp.asarray(take(k))
    kw = dict(q_positions=jnp.asarray(pos_r), kv_positions=jnp.asarray(pos_r),
              q_segment_ids=jnp.asarray(seg_r), kv_segment_ids=jnp.asarray(seg_r), scale=0.3,
              v_head_dim=8)
    want = take(reference(q, k, k[..., :8], visible_mask(idx, pos, seg), 0.3))
    for impl in ("dense", "gather"):
        got = sparse_attention(q_r, k_r, None, jnp.asarray(idx_r), implementation=impl, **kw)
        assert_close(got, want, f"{strategy} {impl}")
    topk = TopK.from_indices(jnp.asarray(idx), jnp.asarray(pos), jnp.asarray(seg))
    topk_r = TopK(jnp.asarray(take(topk.positions)), jnp.asarray(take(topk.segment_ids)))
    got = dot_product_attention(q_r, k_r[:, :, None], k_r[:, :, None, :8], mask=Causal() &
                                Document() & topk_r, q_positions=kw["q_positions"],
                                kv_positions=kw["kv_positions"],
                                q_segment_ids=kw["q_segment_ids"],
                                kv_segment_ids=kw["kv_segment_ids"], scale=0.3)
    assert_close(got, want, f"{strategy} TopK by position")


def test_gather_gradient_is_a_scatter():
    """The gather's backward pass never builds a [queries x keys] array (cross-attention
    shapes: 16 queries, 48 keys, so such an array would carry both sizes)."""
    Lq, S = 16, 48
    q = jnp.ones((1, Lq, 2, 8))
    k = jnp.ones((1, S, 8))
    idx = jnp.tile(jnp.arange(4, dtype=jnp.int32), (1, Lq, 1))
    kw = dict(q_positions=jnp.arange(Lq)[None] + S, kv_positions=jnp.arange(S)[None],
              v_head_dim=4, implementation="gather")

    def loss(q, k):
        return sparse_attention(q, k, None, idx, **kw).sum()

    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            shapes.extend(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, k).jaxpr)
    assert shapes and not [s for s in shapes if Lq in s and S in s], shapes
    dense = jax.make_jaxpr(lambda q, k: sparse_attention(
        q, k, None, idx, **{**kw, "implementation": "dense"}).sum())(q, k).jaxpr
    shapes.clear()
    walk(dense)
    assert [s for s in shapes if Lq in s and S in s]  # the check can see a dense array


def test_auto_rule_and_errors():
    assert choose_sparse_implementation(64, 128, Causal() & Document()) == "dense"
    assert choose_sparse_implementation(63, 128, Causal() & Document()) == "gather"
    assert choose_sparse_implementation(64, 128, Document()) == "gather"
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match="v_head_dim"):
        sparse_attention(q, jnp.ones((1, 4, 8)), None, jnp.zeros((1, 4, 2), jnp.int32),
                         q_positions=jnp.arange(4)[None], kv_positions=jnp.arange(4)[None])
    with pytest.raises(ValueError, match="query_chunk"):
        sparse_attention(q, jnp.ones((1, 4, 8)), None, jnp.zeros((1, 4, 2), jnp.int32),
                         q_positions=jnp.arange(4)[None], kv_positions=jnp.arange(4)[None],
                         v_head_dim=4, implementation="gather", query_chunk=3)
    topk = TopK(jnp.zeros((1, 4, 2), jnp.int32), jnp.ones((1, 4, 2), jnp.int32))
    with pytest.raises(ValueError, match="whole query rows"):  # a tile of 2 queries
        topk(jnp.zeros((1, 2, 1)), jnp.zeros((1, 1, 4)), jnp.ones((1, 2, 1)),
             jnp.ones((1, 1, 4)))


def test_gather_flops_scale_with_k_and_topk_is_a_pytree():
    """Compiled FLOPs at 256 keys, k=8: "gather" costs well under 1/8 of "dense"; and `TopK`
    passes through `jax.jit` as an argument."""
    n = 256
    q, k = jnp.ones((1, n, 2, 16)), jnp.ones((1, n, 16))
    idx = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (1, n, 8))
    pos = jnp.arange(n)[None]

    def flops(impl):
        fn = jax.jit(lambda q, k: sparse_attention(q, k, None, idx, q_positions=pos,
                                                   kv_positions=pos, v_head_dim=8,
                                                   implementation=impl))
        return fn.lower(q, k).compile().cost_analysis()["flops"]

    dense, gather = flops("dense"), flops("gather")
    print(f"compiled flops: gather {gather:.3g}, dense {dense:.3g}")
    assert 0 < gather < dense / 8, (gather, dense)
    topk = TopK.from_indices(jnp.asarray([[[0, 2]] * 4], jnp.int32), pos[:, :4])
    ones = jnp.ones((1, 4), jnp.int32)
    out = jax.jit(lambda t, p: t(p[:, :, None], p[:, None, :], ones[:, :, None],
                                 ones[:, None, :]))(topk, pos[:, :4])
    assert np.asarray(out)[0].tolist() == [[True, False, True, False]] * 4


def test_chunked_gradient_keeps_one_chunk_of_gathered_keys():
    """Differentiated, a query-chunked gather holds one chunk's gathered keys at a time
    (`map_query_chunks` rematerialises each chunk), not every chunk's stacked for the
    backward: its temporaries are a fraction of the unchunked program's (gathered keys
    [1024 queries, 64 keys, 64] float32: 16 MiB whole, 2 MiB a chunk of 128)."""
    Lq, S, kk = 1024, 1024, 64
    sds = jax.ShapeDtypeStruct
    args = (sds((1, Lq, 4, 64), jnp.float32), sds((1, S, 64), jnp.float32))
    idx = jnp.asarray(np.random.default_rng(0).integers(0, S, (1, Lq, kk)), jnp.int32)
    pos = jnp.arange(S)[None]

    def temp(chunk):
        def loss(q, k):
            return sparse_attention(q, k, None, idx, q_positions=pos + S, kv_positions=pos,
                                    v_head_dim=32, implementation="gather",
                                    query_chunk=chunk).sum()
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full, chunked = temp(None), temp(Lq // 8)
    assert full >= Lq * kk * 64 * 4, full  # the whole gathered keys are live at once
    assert chunked < full / 3, (chunked, full)
