"""`zoo.layers.CompressedAttention` (DeepSeek-V4: sliding, CSA, HCA) against transformers'
``DeepseekV4Attention`` (torch fp32, random weights copied through the layer's own `hf_keys`) on
one unpacked row, forward and gradients; against a plain per-document loop written here for
packed rows (compression windows restart at each document, padding never enters an entry);
and context parallelism equal to the unsharded layer under `zoo.data.load_balance` orders."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from support import assert_close
from zoo.layers.compressed_attention import CompressedAttention
from zoo.layers.compressor import rotate_trailing
from zoo.layers.rope import RoPE, YaRN
from zoo.ops import compressed_attention as ca

torch = pytest.importorskip("torch")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

B, L, D, N, H, HR, RQ, G, RO, W = 2, 22, 32, 4, 16, 8, 16, 2, 6, 5
NI, HI, TOPK = 8, 16, 3
RATES = {"csa": 4, "hca": 8}
HF_KIND = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
           "hca": "heavily_compressed_attention"}
THETA = {"sliding": 10000.0, "csa": 160000.0, "hca": 160000.0}


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0}


def hf_config(yarn=False):
    cfg = DeepseekV4Config(
        rope_parameters=dict(YARN) if yarn else None,
        hidden_size=D, num_attention_heads=N, head_dim=H, q_lora_rank=RQ, o_groups=G,
        o_lora_rank=RO, sliding_window=W, num_hidden_layers=3,
        layer_types=list(HF_KIND.values()), mlp_layer_types=["moe"] * 3,
        compress_rates={HF_KIND[k]: r for k, r in RATES.items()}, index_n_heads=NI,
        index_head_dim=HI, index_topk=TOPK, partial_rotary_factor=HR / H,
        rope_theta=THETA["sliding"], compress_rope_theta=THETA["csa"],
        max_position_embeddings=64, rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    return cfg


def make(kind, seed=0, inputs_shape=(B, L, D), partitioner=None, yarn=False):
    # transformers' V4 scales only the compressed branches' RoPE, with cos/sin factor 1
    scaling = YaRN(factor=YARN["factor"], original_max_position_embeddings=8,
                   attention_factor=1.0) if yarn and kind != "sliding" else None
    return CompressedAttention(
        kind=kind, num_heads=N, head_dim=H, rope_head_dim=HR, q_lora_rank=RQ, o_groups=G,
        o_lora_rank=RO, sliding_window=W, compress_rate=RATES.get(kind), index_n_heads=NI,
        index_head_dim=HI, index_topk=TOPK, inputs_shape=inputs_shape,
        partitioner=partitioner, rope=RoPE(theta=THETA[kind], interleaved=True,
                                           scaling=scaling), rngs=nnx.Rngs(seed))


def randomise(module, seed):
    """Every parameter of `module` random (norms near 1), in place."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        name = ".".join(map(str, path))
        x = rng.standard_normal(var.shape).astype(np.float32)
        if "norm" in name:
            x = 1.0 + 0.2 * x
        elif "kernel" in name:
            x = x / np.sqrt(var.shape[0])
        var[...] = jnp.asarray(x)


def hf_pair(kind, yarn=False):
    cfg = hf_config(yarn)
    torch.manual_seed(0)
    hf = v4.DeepseekV4Attention(cfg, layer_idx=list(HF_KIND).index(kind)).float().eval()
    ours = make(kind, yarn=yarn)
    randomise(ours, 1)
    state = dict(hf.state_dict())
    rows = ours.hf_keys("")
    assert sorted(k for r in rows for k in r.keys) == sorted(state)
    with torch.no_grad():
        for row in rows:
            var = functools.reduce(getattr, row.path, ours)
            state[row.keys[0]].copy_(torch.tensor(row.to_hf(np.asarray(var[...]))))
    return cfg, hf, ours, rows


def hf_forward(cfg, hf, x, pos):
    pid = torch.tensor(pos)
    rot = v4.DeepseekV4RotaryEmbedding(cfg)
    emb = {t: rot(x, position_ids=pid, layer_type=t) for t in ("main", "compress")}
    i, j = pos[:, :, None], pos[:, None, :]
    ok = (j <= i) & (i - j < W)
    mask = torch.tensor(np.where(ok, 0.0, -np.inf)[:, None], dtype=torch.float32)
    return hf(x, emb, pid, mask)[0]


@pytest.mark.parametrize("kind,yarn", [("sliding", False), ("csa", False), ("hca", False),
                                       ("csa", True)])
def test_matches_transformers(kind, yarn):
    """One unpacked row (length 22: not a multiple of either rate): outputs, the input's
    gradient and every parameter's gradient (the indexer's, which gets none, aside); YaRN on
    the compressed branches as V4-Flash has it."""
    cfg, hf, ours, rows = hf_pair(kind, yarn)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    w = rng.standard_normal((B, L, D)).astype(np.float32)
    pos = np.broadcast_to(np.arange(L), (B, L)).copy()

    xt = torch.tensor(x, requires_grad=True)
    out_t = hf_forward(cfg, hf, xt, pos)
    (out_t * torch.tensor(w)).sum().backward()

    def loss(model, x):
        y = model(x, positions=jnp.asarray(pos))
        return jnp.sum(y * w), y

    (_, y), (g_model, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        ours, jnp.asarray(x))
    assert_close(y, out_t.detach().numpy(), f"{kind} output", rtol=1e-5)
    assert_close(g_x, xt.grad.numpy(), f"{kind} d/dx", rtol=1e-5)
    named = dict(hf.named_parameters())
    checked = 0
    for row in rows:
        key = row.keys[0]
        if ".indexer." in f".{key}":
            continue  # the selection is discrete: no gradient, here or there
        g = np.asarray(functools.reduce(getattr, row.path, g_model)[...])
        assert_close(g, row.to_zoo(named[key].grad.numpy(), g.shape), f"{kind} d/{key}",
                     rtol=2e-5)
        checked += 1
    assert checked >= 8
    if kind == "csa":  # the selection itself: transformers' indexer, as sets per query
        with torch.no_grad():
            xt = torch.tensor(x)
            hf_idx = hf.compressor.indexer(xt, hf.q_a_norm(hf.q_a_proj(xt)),
                                           torch.tensor(pos), None, 0).numpy()
        ix = ours.compressor.indexer
        idx = np.asarray(jax.jit(lambda m, x, p: m.select(x, ours.q_latent(x), TOPK,
                                                          positions=p))(
            ix, jnp.asarray(x), jnp.asarray(pos)))
        assert idx.shape == hf_idx.shape == (B, L, TOPK)
        for b in range(B):
            for i in range(L):
                assert set(idx[b, i]) == set(hf_idx[b, i]), (b, i, idx[b, i], hf_idx[b, i])
        assert (idx[:, -1] >= 0).all() and L // RATES["csa"] > TOPK  # the top-k prunes


# -- packed rows: a plain loop per document ------------------------------------------------------

DOCS = ([9, 11], [6, 13, 2])  # the rest of each row is padding


def packed(lengths=DOCS, length=L):
    pos, seg = np.zeros((B, length), np.int32), np.zeros((B, length), np.int32)
    for b, docs in enumerate(lengths):
        at = 0
        for d, n in enumerate(docs, start=1):
            pos[b, at:at + n], seg[b, at:at + n] = np.arange(n), d
            at += n
    return pos, seg


def loop_reference(model, x, pos, seg):
    """Each document alone, as a single-document row whose windows start at its first token:
    numpy over the layer's own projections, one window and one query at a time."""
    kind, m = model.kind, model.rate
    c = model.compressor
    proj = {k: [np.asarray(a, np.float64) for a in v]
            for k, v in _projections(model, jnp.asarray(x), jnp.asarray(pos)).items()}
    q, kv = proj["attn"]
    sinks = np.asarray(model.sinks[...], np.float64)
    out = np.zeros((B, pos.shape[1], N, H))
    for b in range(B):
        for d in set(seg[b].tolist()) - {0}:
            idx = np.nonzero(seg[b] == d)[0]
            idx = idx[np.argsort(pos[b, idx])]
            ents, ikeys = [], []
            if c is not None:
                ckv, cg = (a[b, idx] for a in proj["c"])
                ents = finish_loop(pool_loop(ckv, cg, _np(c.position_bias), m, c.overlap), c, m)
                if kind == "csa":
                    ic = c.indexer.compressor
                    ikv, ig = (a[b, idx] for a in proj["i"])
                    ikeys = finish_loop(pool_loop(ikv, ig, _np(ic.position_bias), m, True), ic, m)
                    iq, iw = (a[b, idx] for a in proj["q"])
            for t in range(len(idx)):
                keys = [kv[b, idx[j]] for j in range(max(0, t - W + 1), t + 1)]
                seen = [e for e in range(len(ents)) if (e + 1) * m - 1 <= t]
                if kind == "csa" and seen:
                    sc = [np.sum(iw[t] * np.maximum(iq[t] @ ikeys[e], 0) * HI ** -0.5)
                          for e in seen]
                    order = sorted(range(len(seen)), key=lambda i: (-sc[i], -seen[i]))
                    seen = [seen[i] for i in order[:TOPK]]
                kmat = np.stack(keys + [ents[e] for e in seen])  # [S, H]
                s = np.einsum("nh,sh->ns", q[b, idx[t]], kmat) * H ** -0.5
                s = np.concatenate([s, sinks[:, None]], axis=1)
                p = np.exp(s - s.max(1, keepdims=True))
                p = p / p.sum(1, keepdims=True)
                out[b, idx[t]] = p[:, :-1] @ kmat
    return np.asarray(_out(model, jnp.asarray(out, jnp.float32), jnp.asarray(pos)))


def _np(var):
    return np.asarray(var[...], np.float64)


@jax.jit
def _projections(model, x, pos):
    q_lat = model.q_latent(x)
    proj = {"attn": model.project(x, q_lat, pos)}
    if model.compressor is not None:
        proj["c"] = model.compressor.project(x)
        if model.kind == "csa":
            ix = model.compressor.indexer
            proj["i"] = ix.compressor.project(x)
            proj["q"] = ix.queries(x, q_lat, pos)
    return proj


_out = jax.jit(lambda model, o, pos: model.out(o, pos))


def pool_loop(kv, gate, bias, m, overlap):
    Hc = kv.shape[1] // (2 if overlap else 1)
    ents = []
    for w in range(len(kv) // m):
        rows = [(kv[w * m + j, Hc:] if overlap else kv[w * m + j],
                 (gate[w * m + j] + bias[j])[Hc:] if overlap else gate[w * m + j] + bias[j])
                for j in range(m)]
        if overlap and w > 0:
            rows += [(kv[(w - 1) * m + j, :Hc], (gate[(w - 1) * m + j] + bias[j])[:Hc])
                     for j in range(m)]
        v, g = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
        e = np.exp(g - g.max(0))
        ents.append((e * v).sum(0) / e.sum(0))
    return ents


def finish_loop(ents, comp, m):
    """kv_norm, then RoPE written out (interleaved pairs of the trailing HR dims) at each
    entry's first position e * m."""
    out = []
    inv = comp.rope.inv_freq(HR).astype(np.float64)
    for e, y in enumerate(ents):
        y = y / np.sqrt(np.mean(y * y) + 1e-6) * _np(comp.kv_norm.scale)
        a, b_ = y[-HR:][0::2], y[-HR:][1::2]
        ang = e * m * inv
        rot = np.stack([a * np.cos(ang) - b_ * np.sin(ang), b_ * np.cos(ang) + a * np.sin(ang)],
                       -1).reshape(-1)
        out.append(np.concatenate([y[:-HR], rot]))
    return out


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_packed_documents_match_a_loop(kind):
    model = make(kind)
    randomise(model, 3)
    pos, seg = packed()
    x = np.random.default_rng(4).standard_normal((B, L, D)).astype(np.float32)
    got = np.asarray(_forward(model, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg)))
    want = loop_reference(model, x, pos, seg)
    assert_close(got, want, f"{kind} packed", rtol=1e-5)
    assert np.all(got[seg == 0] == 0)  # padding: nothing visible, exact zeros
    # any order of the tokens (a load-balanced row) gives the same outputs, reordered
    perm = np.random.default_rng(5).permutation(L)
    shuffled = np.asarray(_forward(model, jnp.asarray(x[:, perm]), jnp.asarray(pos[:, perm]),
                                   jnp.asarray(seg[:, perm])))
    assert_close(shuffled, got[:, perm], f"{kind} shuffled row", rtol=1e-5)


_forward = jax.jit(lambda m, x, p, s: m(x, positions=p, segment_ids=s))



def test_indexer_selection_in_chunks_and_blocks_equals_dense_topk():
    """`CompressedIndexer.select_entries` (queries in chunks, entries in blocks through
    `Indexer.select_keys`; blocks no query of a chunk sees skipped) picks the same entries in
    the same order as the top-k of the dense entry scores, on packed rows with padding."""
    m = make("csa")
    randomise(m, 3)
    ix = m.compressor.indexer
    pos, seg = (jnp.asarray(a) for a in packed())
    x = jnp.asarray(np.random.default_rng(4).standard_normal((B, L, D)), jnp.float32)
    q, w = ix.queries(x, m.q_latent(x), pos)
    entries, start, eseg = ix.keys(x, pos, seg)
    dense = ix.topk(ix.entry_scores(q, w, entries, start, eseg, positions=pos,
                                    segment_ids=seg), TOPK, start)
    for chunk, block in ((2, 2), (11, 3)):
        got = jax.jit(functools.partial(
            ix.select_entries, k=TOPK, positions=pos, segment_ids=seg, query_chunk=chunk,
            key_block=block))(q, w, entries, start, eseg)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(dense), str((chunk, block)))
    assert (np.asarray(dense) >= 0).any() and (np.asarray(dense) < 0).any()

def test_window_table_any_order():
    """Windows per document, from positions and segment ids only: the same entries for a
    shuffled row; padding and partial windows make none."""
    pos, seg = packed(([9, 11], [6, 13, 2]))
    t = ca.window_table(jnp.asarray(pos), jnp.asarray(seg), 4)
    # row 0: doc 1 (9 tokens) windows 0, 1; doc 2 (11 tokens) windows 0, 1
    assert np.asarray(t.entry_segment_ids)[0].tolist() == [1, 1, 2, 2, 0]
    assert np.asarray(t.entry_start)[0].tolist() == [0, 4, 0, 4, 0]
    # row 1: doc 1 (6): window 0; doc 2 (13): 0, 1, 2; doc 3 (2): none
    assert np.asarray(t.entry_segment_ids)[1].tolist() == [1, 2, 2, 2, 0]
    slots, nxt = (np.asarray(a) for a in ca.window_slots(t, jnp.asarray(pos),
                                                           jnp.asarray(seg), 4))
    assert slots[0].tolist() == [0] * 4 + [1] * 4 + [-1] + [2] * 4 + [3] * 4 + [-1] * 5
    assert nxt[0].tolist() == [1] * 4 + [-1] * 5 + [3] * 4 + [-1] * 9
    perm = np.random.default_rng(0).permutation(L)
    t2 = ca.window_table(jnp.asarray(pos[:, perm]), jnp.asarray(seg[:, perm]), 4)
    for a, b_ in zip(t, t2):
        assert np.array_equal(np.asarray(a), np.asarray(b_))
    s2, n2 = (np.asarray(a) for a in ca.window_slots(t2, jnp.asarray(pos[:, perm]),
                                                       jnp.asarray(seg[:, perm]), 4))
    assert np.array_equal(s2, slots[:, perm]) and np.array_equal(n2, nxt[:, perm])


def test_lexsort_stable_equals_numpy_lexsort():
    """`lexsort_stable` (two stable one-key sorts) orders by (major, minor), ties in index
    order, as numpy's lexsort: heavy ties, -inf and -0.0 among float keys, int keys."""
    r = np.random.default_rng(3)
    for dtype in (np.float32, np.int32):
        major = r.integers(-3, 3, (2, 5, 64)).astype(dtype)
        minor = r.integers(-2, 2, (2, 5, 64)).astype(dtype)
        if dtype == np.float32:
            major[0, 0, :8], minor[0, 1, :8] = -np.inf, -0.0
        got_major, order = (np.asarray(a) for a in ca.lexsort_stable(jnp.asarray(major),
                                                                       jnp.asarray(minor)))
        want = np.stack([np.lexsort((minor[b, i], major[b, i])) for b in range(2)
                         for i in range(5)]).reshape(order.shape)
        assert np.array_equal(order, want)
        assert np.array_equal(got_major, np.take_along_axis(major, want, -1))


def test_conjugate_rotation_undoes_rope():
    rope = RoPE(theta=100.0, interleaved=True)
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    pos = jnp.arange(5)[None] * 3
    back = rotate_trailing(rope, rotate_trailing(rope, x, pos, 4), pos, 4, inverse=True)
    assert_close(back, x, "inverse rotation", rtol=1e-6)


def test_errors():
    kw = dict(num_heads=N, head_dim=H, rope_head_dim=HR, q_lora_rank=RQ, o_groups=G,
              o_lora_rank=RO, sliding_window=W, inputs_shape=(B, L, D), partitioner=None,
              rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kind='dense'"):
        CompressedAttention(kind="dense", **kw)
    with pytest.raises(ValueError, match="o_groups=3"):
        CompressedAttention(kind="sliding", **{**kw, "o_groups": 3})
    with pytest.raises(ValueError, match="rope_head_dim=7"):
        CompressedAttention(kind="hca", **{**kw, "rope_head_dim": 7})
    with pytest.raises(ValueError, match="compress_rate=0"):
        CompressedAttention(kind="hca", compress_rate=0, **kw)


# -- context parallelism -------------------------------------------------------------------------

LCP = 24  # 2 * cp divides it
CP_DOCS = ([9, 11], [6, 13, 2])
CP_MESHES = {  # name -> (strategy, mesh sizes, load_balance strategy)
    "cp4_data2_document": ("cp", dict(data=2, context=4), "document"),
    "cp4_tp2_row": ("cp", dict(context=4, tensor=2), "row"),
    "ep_as_cp_document": ("ep_as_cp", dict(fsdp=2, expert=2, context=2), "document"),
}


def sharded_and_plain(kind, p, length, seed=7):
    """The layer sharded by `p` and unsharded, for [B, length, D] inputs, with the same random
    parameters (norms near 1, kernels scaled by their fan-in)."""
    sharded = make(kind, inputs_shape=(B, length, D), partitioner=p)
    rng = np.random.default_rng(seed)
    flat = nnx.to_flat_state(nnx.state(sharded, nnx.Param))
    for path, var in flat:
        x = rng.standard_normal(var.shape).astype(np.float32)
        name = ".".join(map(str, path))
        x = 1.0 + 0.2 * x if "norm" in name else x / np.sqrt(var.shape[0]) if "kernel" in name \
            else x
        var[...] = jax.device_put(x, var[...].sharding)
    plain = make(kind, inputs_shape=(B, length, D))
    for path, var in nnx.to_flat_state(nnx.state(plain, nnx.Param)):
        var[...] = jnp.asarray(np.asarray(dict(flat)[path][...]))
    return sharded, plain


def value_and_grads(module, x, pos, seg, ct):
    graphdef, params = nnx.split(module, nnx.Param)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x, positions=pos, segment_ids=seg)
        return jnp.sum(y * ct), y

    (_, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return np.asarray(y), jax.tree.map(np.asarray, nnx.to_pure_dict(gp)), np.asarray(gx)


@pytest.mark.parametrize("kind,mesh", [
    pytest.param("csa", "cp4_data2_document", marks=pytest.mark.slow),
    pytest.param("hca", "cp4_tp2_row", marks=pytest.mark.slow),
    ("sliding", "ep_as_cp_document"),
    pytest.param("csa", "ep_as_cp_document", marks=pytest.mark.slow)])
def test_context_parallel_equals_unsharded(kind, mesh):
    import zoo
    from zoo.data import load_balance

    strategy, sizes, lb = CP_MESHES[mesh]
    p = zoo.Partitioner(zoo.make_mesh(**sizes), strategy)
    cp = p.context_size("attention")
    sharded, plain = sharded_and_plain(kind, p, LCP)
    rng = np.random.default_rng(7)
    pos, seg = packed(CP_DOCS, LCP)
    x = rng.standard_normal((B, LCP, D)).astype(np.float32)
    ct = rng.standard_normal((B, LCP, D)).astype(np.float32)
    batch = load_balance({"x": x, "ct": ct, "positions": pos, "segment_ids": seg}, cp,
                         strategy=lb)
    order = load_balance({"o": np.broadcast_to(np.arange(LCP), (B, LCP)).copy(),
                          "positions": pos, "segment_ids": seg}, cp, strategy=lb)["o"]
    assert not np.array_equal(np.asarray(order)[0], np.arange(LCP))
    args = [np.asarray(batch[k]) for k in ("x", "positions", "segment_ids", "ct")]
    y, gp, gx = value_and_grads(sharded, *args)
    y_ref, gp_ref, gx_ref = value_and_grads(plain, *args)
    # (the unsharded layer on a reordered row is the original row reordered:
    # test_packed_documents_match_a_loop)
    assert_close(y, y_ref, f"{kind} {mesh} output", rtol=1e-5)
    assert_close(gx, gx_ref, f"{kind} {mesh} dx", rtol=1e-5)
    ga, ge = dict(jax.tree_util.tree_leaves_with_path(gp)), \
        dict(jax.tree_util.tree_leaves_with_path(gp_ref))
    assert ga.keys() == ge.keys()
    for k, v in ge.items():
        assert_close(ga[k], v, f"{kind} {mesh} d{jax.tree_util.keystr(k)}", rtol=1e-5)


# -- generation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_prefill_then_decode_equals_the_full_forward(kind):
    """A 9-token prompt (a partial window open for both rates, CSA's overlap carried) then one
    token at a time to 22: every output equals the full forward pass's at that position."""
    model = make(kind)
    randomise(model, 8)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((B, L, D)), jnp.float32)
    full = np.asarray(_forward(model, x, jnp.broadcast_to(jnp.arange(L), (B, L)),
                               jnp.ones((B, L), jnp.int32)))
    P = 9
    out, cache = jax.jit(lambda m, x: m.prefill(x, max_length=L))(model, x[:, :P])
    assert set(cache) == set(model.cache_shape(B, L))
    assert {k: v.shape for k, v in cache.items()} == model.cache_shape(B, L)
    assert_close(out, full[:, :P], f"{kind} prefill", rtol=1e-5)
    step = jax.jit(lambda m, x, c, p: m.decode(x, c, positions=p))
    for t in range(P, L):
        y, cache = step(model, x[:, t:t + 1], cache, jnp.full((B, 1), t, jnp.int32))
        assert_close(y[:, 0], full[:, t], f"{kind} decode at {t}", rtol=1e-5)


def test_bfloat16_compute_is_close_to_float32():
    """dtype=bfloat16: bf16 projections and output (float32 pooling and softmax inside)."""
    pos, seg = packed()
    x = jnp.asarray(np.random.default_rng(10).standard_normal((B, L, D)), jnp.float32)
    model = make("csa")
    randomise(model, 11)
    low = CompressedAttention(**{**{k: getattr(model, k) for k in (
        "kind", "num_heads", "head_dim", "rope_head_dim", "q_lora_rank", "sliding_window",
        "index_topk", "rope")}, "compress_rate": model.rate, "o_groups": G, "o_lora_rank": RO,
        "index_n_heads": NI, "index_head_dim": HI}, inputs_shape=(B, L, D), partitioner=None,
        dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(low, nnx.state(model, nnx.Param))
    want = _forward(model, x, jnp.asarray(pos), jnp.asarray(seg))
    got = _forward(low, x, jnp.asarray(pos), jnp.asarray(seg))
    assert got.dtype == jnp.bfloat16
    assert_close(np.asarray(got, np.float32), want, "bf16 CSA", rtol=5e-2)


def test_sliding_band_and_query_chunks_equal_the_dense_op():
    """`sliding_band` on a shuffled packed row (window 5) and `attend` in query chunks of 11
    give the dense op's outputs and gradients (CSA-style selected entries)."""
    pos, seg = packed()
    perm = np.random.default_rng(12).permutation(L)
    pos, seg = jnp.asarray(pos[:, perm]), jnp.asarray(seg[:, perm])
    keys = jax.random.split(jax.random.key(13), 4)
    q = jax.random.normal(keys[0], (B, L, N, H))
    kv = jax.random.normal(keys[1], (B, L, H))
    table = ca.window_table(pos, seg, 4)
    E = L // 4
    entries = jax.random.normal(keys[2], (B, E, H))
    band = ca.sliding_band(jnp.broadcast_to(jnp.arange(L), (B, L)), pos, seg, W)
    assert band.shape == (B, L, W)
    kw = dict(q_positions=pos, q_segment_ids=seg, kv_positions=pos, kv_segment_ids=seg,
              window=W, entry_start=table.entry_start, entry_segment_ids=table.entry_segment_ids,
              rate=4, indices=jax.random.randint(keys[3], (B, L, 1), -1, E),
              sinks=jnp.linspace(-1.0, 1.0, N))

    def f(q, kv, e, **extra):
        return jnp.sum(jnp.sin(ca.attend(q, kv, e, **kw, **extra)))

    want = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, kv, entries)
    got = jax.jit(jax.value_and_grad(functools.partial(f, band=band, query_chunk=11),
                                     argnums=(0, 1, 2)))(q, kv, entries)
    for a, b_, what in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                           ("value", "dq", "dkv", "dentries")):
        assert_close(a, b_, f"band {what}", rtol=1e-5)
