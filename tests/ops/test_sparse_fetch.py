"""`zoo.ops.sparse_mla_attention` under context parallelism, by how the selected latents reach
each shard (``fetch="hops"``, ``"auto"``, ``"all_gather"``), against a plain reference written
here: the expanded MLA (per-head keys and values built from the latent) under a dense softmax
whose mask is a numpy loop over each query's selection (causal, same document, not padding).
Rows are packed documents with padding, reordered by every `zoo.data.load_balance` layout for
4 context shards; outputs and the gradients of q, latent, k_pe and kv_up are compared in the
natural order. `fetch_plan`'s need matrix and distances are checked against a numpy count."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

import zoo
from support import assert_close, packed_rows, visible_keys, visible_mask
from zoo.data import load_balance
from zoo.ops.sparse_attention import (choose_fetch, fetch_bytes, fetch_plan,
                                      sparse_mla_attention)

B, L, N, R, HN, HR, HV, TOPK, CP = 2, 64, 2, 8, 4, 4, 6, 6, 4
SCALE = 0.4
DOCS = ([9, 5, 14, 7, 11, 6], [3, 20, 8, 4, 10, 6, 5])  # short documents; the rest is padding
LAYOUTS = ("row", "document", "auto", "none")
MESHES = {"cp": dict(data=2, context=4), "ep_as_cp": dict(fsdp=2, expert=2, context=2)}


def packed():
    return packed_rows(DOCS, L)


def selection(far: bool, seed=0):
    """Distinct keys per query (natural order): up to TOPK of its visible keys (as the
    indexer selects them), some slots empty; with ``far``, two slots hold random keys of the
    row (mostly invisible and on other shards), which the mask must drop."""
    rng = np.random.default_rng(seed)
    pos, seg = packed()
    idx = np.full((B, L, TOPK), -1, np.int32)
    for b in range(B):
        for i in range(L):
            seen = visible_keys(pos, seg, b, i)
            mine = list(rng.permutation(seen)[:TOPK - 2 if far else TOPK])
            if far:
                mine += [j for j in rng.permutation(L) if j not in mine][:2]
            row = np.full(TOPK, -1, np.int32)
            row[:len(mine)] = mine
            row[rng.random(TOPK) < 0.1] = -1
            idx[b, i] = rng.permutation(row)
    return idx


def reference(q, latent, k_pe, kv_up, vis):
    """Expanded MLA: k = [latent @ W_uk; k_pe], v = latent @ W_uv per head; zeros where a query
    sees nothing."""
    kv = jnp.einsum("bsr,rnd->bsnd", latent, kv_up)
    k = jnp.concatenate([kv[..., :HN], jnp.broadcast_to(k_pe[:, :, None], (B, L, N, HR))], -1)
    s = jnp.einsum("blnh,bsnh->bnls", q, k) * SCALE
    m = jnp.asarray(vis)[:, None]
    s = jnp.where(m, s, -1e30)
    p = jnp.exp(s - s.max(-1, keepdims=True)) * m
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bnls,bsnv->blnv", p, kv[..., HN:])


@functools.cache
def wanted(far: bool):
    """The reference's (out, dq, dlatent, dk_pe, dkv_up) in the natural order, numpy."""
    q, latent, k_pe, kv_up, r = tensors()
    pos, seg = packed()
    vis = visible_mask(selection(far), pos, seg)
    assert vis.sum() > B * L

    @jax.jit
    def both(q, latent, k_pe, kv_up, r, vis):
        out, vjp = jax.vjp(lambda *a: reference(*a, vis), q, latent, k_pe, kv_up)
        return (out, *vjp(r))

    return [np.asarray(a) for a in both(q, latent, k_pe, kv_up, r, jnp.asarray(vis))]


def tensors(seed=1):
    ks = jax.random.split(jax.random.key(seed), 5)
    return (jax.random.normal(ks[0], (B, L, N, HN + HR)), jax.random.normal(ks[1], (B, L, R)),
            jax.random.normal(ks[2], (B, L, HR)), jax.random.normal(ks[3], (R, N, HN + HV)) * 0.5,
            jax.random.normal(ks[4], (B, L, N, HV)))


def balanced(layout, idx):
    """(order [B, L]: order[b, new] = old, indices remapped to the reordered row)."""
    pos, seg = packed()
    order = np.asarray(load_balance(
        {"o": np.broadcast_to(np.arange(L), (B, L)).copy(), "positions": pos,
         "segment_ids": seg}, CP, strategy=layout)["o"])
    inv = np.argsort(order, axis=1)
    idx_r = np.take_along_axis(idx, order[..., None], axis=1)
    flat = np.take_along_axis(inv, np.maximum(idx_r, 0).reshape(B, -1), axis=1)
    return order, np.where(idx_r >= 0, flat.reshape(idx_r.shape), -1).astype(np.int32)


def take(a, order):
    return np.take_along_axis(np.asarray(a), order.reshape(B, L, *(1,) * (np.ndim(a) - 2)), 1)


def numpy_plan(idx_r):
    """need[r, s] and the needed distances by plain counting."""
    S = L // CP
    need = np.zeros((CP, CP), bool)
    for b in range(B):
        for i in range(L):
            for j in idx_r[b, i]:
                if j >= 0:
                    need[i // S, j // S] = True
    dist = [d == 0 or any(need[r, (r - d) % CP] for r in range(CP)) for d in range(CP)]
    return need, np.array(dist)


@pytest.mark.parametrize("mesh,fetch", [("cp", "hops"), ("cp", "auto"), ("ep_as_cp", "auto")])
def test_fetch_equals_reference_for_every_layout(devices, mesh, fetch):
    """Forward and the gradients of q, latent, k_pe, kv_up equal the plain reference under every
    `load_balance` layout, for a selection among visible keys (short documents: few distances
    needed, "auto" takes the hops where they move fewer bytes) and one with far keys (every
    distance needed, "auto" takes the all-gather); under ep_as_cp the expert axis is a context
    axis (the sequence over two mesh axes, named against the mesh's order)."""
    p = zoo.Partitioner(zoo.make_mesh(**MESHES[mesh]), mesh)
    assert p.context_size("attention") == CP
    pos, seg = packed()
    q, latent, k_pe, kv_up, r = tensors()

    @jax.jit  # compiled once: the layouts and selections are data
    def run(q, latent, k_pe, kv_up, r, idx, pos, seg):
        def loss(q, latent, k_pe, kv_up):
            out = sparse_mla_attention(q, latent, k_pe, kv_up, idx, qk_nope_head_dim=HN,
                                       positions=pos, segment_ids=seg, scale=SCALE,
                                       partitioner=p, fetch=fetch)
            return jnp.sum(out * r), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            q, latent, k_pe, kv_up)

    took_hops = set()
    for far in (False, True):
        idx, want = selection(far), wanted(far)
        for layout in LAYOUTS:
            order, idx_r = balanced(layout, idx)
            took_hops.add(bool(choose_fetch(int(np.sum(numpy_plan(idx_r)[1][1:])), CP)))
            back = np.argsort(order, axis=1)
            args = [jnp.asarray(take(a, order)) for a in (q, latent, k_pe)]
            args += [kv_up, jnp.asarray(take(r, order)), jnp.asarray(idx_r),
                     jnp.asarray(take(pos, order)), jnp.asarray(take(seg, order))]
            (_, out), grads = run(*args)
            got = [take(out, back), *(take(g, back) for g in grads[:3]), grads[3]]
            for name, g, w in zip(("out", "dq", "dlatent", "dk_pe", "dkv_up"), got, want):
                assert_close(g, w, f"{mesh} far={far} {layout} fetch={fetch} {name}", 1e-5)
    assert took_hops == {True, False}  # both regimes of "auto" ran
    if fetch == "hops":  # the latent moves only by the hops' permutes (each under its cond)
        text = run.lower(*args).as_text()
        assert text.count("stablehlo.collective_permute") == 4 * (CP - 1)  # 3 fwd, 1 bwd a hop
        assert text.count("stablehlo.all_gather") == 1  # the [cp] need rows, nothing else
        assert "stablehlo.reduce_scatter" not in text


def test_fetch_plan_counts_needed_distances():
    """`fetch_plan` = a numpy count of which shards each shard's selection names; with short
    documents kept whole on their shards ("auto", "none") fewer than cp - 1 distances are
    needed, so hops move fewer bytes; "document" cuts every document over all shards and needs
    every distance ("row" here too: its chunks of 8 tokens cut most documents)."""
    idx = selection(far=False)
    counts = {}
    for layout in LAYOUTS:
        _, idx_r = balanced(layout, idx)
        need, dist = fetch_plan(jnp.asarray(idx_r), CP)
        want_need, want_dist = numpy_plan(idx_r)
        np.testing.assert_array_equal(np.asarray(need), want_need, layout)
        np.testing.assert_array_equal(np.asarray(dist), want_dist, layout)
        assert np.all(np.diag(want_need))  # every shard selects some of its own keys
        counts[layout] = int(want_dist[1:].sum())
        wire = fetch_bytes(np.asarray(dist), L // CP, (R + HR) * 4 + 8)
        assert wire["all_gather"] == (CP - 1) * (L // CP) * ((R + HR) * 4 + 8)
        assert (wire["hops"] < wire["all_gather"]) == bool(choose_fetch(counts[layout], CP))
    assert counts["document"] == CP - 1
    assert counts["none"] < CP - 1 and counts["auto"] < CP - 1, counts


def test_bad_fetch_raises():
    q, latent, k_pe, kv_up, _ = tensors()
    pos, _ = packed()
    with pytest.raises(ValueError, match=r"fetch='ring'.*'auto', 'all_gather', 'hops'"):
        sparse_mla_attention(q, latent, k_pe, kv_up, jnp.zeros((B, L, 2), jnp.int32),
                             qk_nope_head_dim=HN, positions=jnp.asarray(pos), fetch="ring")
    with pytest.raises(ValueError, match=r"index_fetch='gather'.*'all_gather', 'hops'"):
        zoo.layers.MLA(num_heads=N, q_lora_rank=8, kv_lora_rank=R, qk_nope_head_dim=HN,
                       qk_rope_head_dim=HR, v_head_dim=HV, inputs_shape=(B, L, 16),
                       partitioner=None, index_topk=4, index_fetch="gather", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cp=3"):
        fetch_plan(jnp.zeros((B, L, 2), jnp.int32), 3)
