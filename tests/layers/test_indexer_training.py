"""Training the DSA lightning indexer (`zoo.layers.MLA`'s ``index_stage``, DeepSeek-V3.2's
report, section 2.1) against a plain reference written here: a loop over queries that takes
each query's visible keys (causal, same document, no padding), in the sparse stage picks the
top-k by index score itself (ties: the larger position first), computes the main attention's
distribution of every head from the expanded q and k (not MLA's absorbed form), sums it over
heads and renormalises, and the KL to the softmax of the index scores it sums per key.

* both stages' loss values and their gradients with respect to the indexer's parameters;
* ``warmup``: the dense forward (the layer's output equals dense MLA's), the model's
  gradients outside the indexers are exactly zero, and a train step leaves them unchanged;
* ``sparse``: the sparse forward (output equals ``off``'s), the KL gives no gradient to x or
  to any main parameter (main gradients equal the language-model loss's alone);
* ``off``: no loss (the existing tests cover its forward); the train step's ``indexer_loss``;
  construction errors;
* the loss in query chunks equals all queries at once;
* GLM-5's full layer (interleaved indexer RoPE) against the same reference; a GLM-5 model of
  full / shared / full layers: warmup dense everywhere (equal to the sparse forward keeping
  every key), sparse equal to ``off``'s forward, both full layers' indexers trained;
* under context parallelism (cp and ep_as_cp, load-balanced packed rows, layouts row,
  document and auto): both stages' KL, output and every gradient equal the unsharded layer's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from support import (assert_close, assert_trees_close, lm_and_indexer_losses,
                     loss_and_grads, sown_indexer_loss, split_indexer_grads,
                     value_and_grads)
from zoo.layers import MLA
from zoo.layers.attention import AttentionBlock
from zoo.layers.indexer import IndexerLoss
from zoo.layers.moe import RouterBias
from zoo.models.deepseek_v32 import DeepSeekV32, DeepSeekV32Config
from zoo.models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaAttention, GlmMoeDsaConfig
from zoo.train import step as step_lib
from zoo.train.fields import apply_overrides

B, L, D, TOPK = 2, 12, 32, 4
DOCS = ([5, 6], [8])  # per row; the rest is padding
KW = dict(num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
          v_head_dim=8, index_topk=TOPK, index_n_heads=8, index_head_dim=16)
INDEXER = nnx.All(nnx.Param, nnx.PathContains("indexer"))
MAIN = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))


def packed():
    pos, seg = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
    for b, docs in enumerate(DOCS):
        at = 0
        for d, n in enumerate(docs, start=1):
            pos[b, at:at + n], seg[b, at:at + n] = np.arange(n), d
            at += n
    return jnp.asarray(pos), jnp.asarray(seg)


def layer(stage: str, family: str = "deepseek_v32") -> MLA:
    """DeepSeek-V3.2's MLA, or GLM-5's full layer (its indexer rotates interleaved)."""
    if family == "glm_moe_dsa":
        return GlmMoeDsaAttention(**KW, index_stage=stage, index_rope_interleaved=True,
                                  inputs_shape=(B, L, D), partitioner=None, rngs=nnx.Rngs(3))
    return MLA(**KW, index_stage=stage, inputs_shape=(B, L, D), partitioner=None,
               rngs=nnx.Rngs(3))


def inputs():
    rng = np.random.RandomState(0)
    return (jnp.asarray(rng.randn(B, L, D), jnp.float32),
            jnp.asarray(rng.randn(B, L, D), jnp.float32))


sown = nnx.jit(sown_indexer_loss)


def index_scores(m: MLA, x, pos):
    """The indexer's scores of every (query, key) pair [B, L, L] on the detached input,
    ``sum_j w[t, j] * relu(H**-0.5 * q[t, j] . k[s])`` (the report's equation 1)."""
    x = jax.lax.stop_gradient(x)
    iq, iw = m.indexer.queries(x, m.q_latent(x), pos)
    ik = m.indexer.keys(x, pos)
    dots = jnp.einsum("btjh,bsh->btsj", iq, ik) * m.indexer.head_dim ** -0.5
    return jnp.einsum("btsj,btj->bts", jax.nn.relu(dots), iw)


def reference_targets(m: MLA, x, pos, seg, stage: str):
    """For each non-padding query, by a loop: its keys (causal, same document; in the sparse
    stage the top-k of them by index score, the larger position first among ties) and the
    main attention's distribution over them, every head from the expanded q and k, summed over
    heads and L1-renormalised (float64). Also the smallest nonzero gap between a selected and
    a rejected index score."""
    pos_np, seg_np = np.asarray(pos), np.asarray(seg)
    q = m.project_q(x)
    k_pe, latent = m.project_kv(x)
    q, k_pe = m.apply_rope(q, k_pe, pos)
    k, _ = m.expand_kv(k_pe, latent)  # [B, L, N, Hqk]
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    scores = np.asarray(index_scores(m, x, pos))
    targets, gap = [], np.inf
    for b in range(B):
        for t in range(L):
            if seg_np[b, t] == 0:
                continue
            keys = [s for s in range(L) if seg_np[b, s] == seg_np[b, t]
                    and pos_np[b, s] <= pos_np[b, t]]
            if stage == "sparse" and len(keys) > TOPK:
                order = sorted(keys, key=lambda s: (-scores[b, t, s], -pos_np[b, s]))
                edge = scores[b, t, order[TOPK - 1]] - scores[b, t, order[TOPK]]
                gap = min(gap, edge) if edge != 0 else gap
                keys = order[:TOPK]
            p = np.zeros(len(keys))
            for n in range(KW["num_heads"]):
                logits = np.array([q[b, t, n] @ k[b, s, n] for s in keys]) * m.scale
                e = np.exp(logits - logits.max())
                p += e / e.sum()
            targets.append((b, t, keys, p / p.sum()))
    return targets, gap


def reference_loss(m: MLA, x, pos, targets):
    """Mean over the queries of ``sum_s p_s (log p_s - log softmax(I)_s)`` over their keys."""
    scores = index_scores(m, x, pos)
    total = 0.0
    for b, t, keys, p in targets:
        log_q = jax.nn.log_softmax(scores[b, t, jnp.asarray(keys)])
        total = total + jnp.sum(p * (np.log(p) - log_q))
    return total / len(targets)


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_loss_and_indexer_gradients_equal_plain_reference(stage, family):
    pos, seg = packed()
    x, _ = inputs()
    m = layer(stage, family)
    wrt = nnx.DiffState(0, INDEXER)
    loss, got = value_and_grads(lambda m: sown(m, x, pos, seg)[1], wrt)(m)
    targets, gap = reference_targets(m, x, pos, seg, stage)
    assert gap > 1e-4, f"top-{TOPK} ambiguous by float noise (gap {gap}); change the seed"
    assert len(targets) == sum(map(sum, DOCS))
    want, ref = value_and_grads(lambda m: reference_loss(m, x, pos, targets), wrt)(m)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    assert float(loss) > 1e-3  # an untrained indexer is far from the attention
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-6)
    assert any(float(jnp.max(jnp.abs(v[...]))) > 0 for _, v in nnx.to_flat_state(got))


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_loss_in_query_chunks_equals_all_at_once(stage):
    """`MLA.distillation` over chunks of 3 queries (each rematerialised in the backward pass)
    gives the loss and indexer gradients of all queries at once."""
    pos, seg = packed()
    x, _ = inputs()
    m = layer(stage)


    @nnx.jit
    def prepare(m):
        q_latent, q, k_pe, latent = m.project_all(x)
        indices = None if stage == "warmup" else m.indexer.select(
            x, q_latent, TOPK, positions=pos, segment_ids=seg)
        return (q_latent, *m.apply_rope(q, k_pe, pos), latent, indices)

    q_latent, q, k_pe, latent, indices = prepare(m)

    def loss(m, chunk):
        return m.distillation(x, q_latent, q, k_pe, latent, indices, positions=pos,
                              segment_ids=seg, query_chunk=chunk)

    wrt = nnx.DiffState(0, INDEXER)
    whole, g_whole = value_and_grads(lambda m: loss(m, None), wrt)(m)
    chunked, g_chunked = value_and_grads(lambda m: loss(m, 3), wrt)(m)
    assert float(whole) > 1e-3
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-6)
    assert_trees_close(g_chunked, g_whole, rtol=1e-5, atol=1e-7)


def test_warmup_is_dense_sparse_is_topk_and_the_kl_leaves_the_main_path_alone():
    pos, seg = packed()
    x, r = inputs()
    layers = {s: layer(s) for s in ("off", "warmup", "sparse")}
    valid = np.asarray(seg)[..., None] != 0
    wrt = (nnx.DiffState(0, MAIN), 1)

    # warmup: the dense forward; the KL reaches neither x nor any main parameter
    def kl(m, x):
        out, loss = sown(m, x, pos, seg)
        return loss, out

    (_, out_w), (g_main, g_x) = value_and_grads(kl, wrt, has_aux=True)(layers["warmup"], x)
    dense = nnx.jit(lambda m, x: AttentionBlock.__call__(m, x, positions=pos,
                                                         segment_ids=seg))(layers["off"], x)
    np.testing.assert_allclose(np.asarray(out_w) * valid, np.asarray(dense) * valid,
                               rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(g_x))) == 0.0
    assert all(float(jnp.max(jnp.abs(v[...]))) == 0.0 for _, v in nnx.to_flat_state(g_main))

    # sparse: off's forward, and (LM-like loss + KL) has the LM-like loss's gradients in x and
    # every main parameter
    both, lm = lm_and_indexer_losses(r, pos, seg, sown)
    (_, out_s), (got_main, got_x) = value_and_grads(both, wrt, True)(layers["sparse"], x)
    (_, out_o), (want_main, want_x) = value_and_grads(lm, wrt, True)(layers["off"], x)
    np.testing.assert_allclose(np.asarray(out_s) * valid, np.asarray(out_o) * valid,
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(out_w) * valid, np.asarray(out_o) * valid, atol=1e-3)
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-5, atol=1e-5)
    assert_trees_close(got_main, want_main, rtol=1e-5, atol=1e-5)


# two dense layers, scanned as one stack (the sown losses come out of the scan)
TINY = dict(hidden_size=32, num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4,
            num_key_value_heads=4, index_topk=4, index_n_heads=8, index_head_dim=16,
            intermediate_size=64, vocab_size=128)


def tiny(stage: str, **kw) -> DeepSeekV32:
    config = DeepSeekV32Config.mini(**{**TINY, **kw, "index_stage": stage})
    return DeepSeekV32(config, inputs_shape=(B, L), rngs=nnx.Rngs(0))


def batch():
    pos, seg = packed()
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 128, (B, L)), jnp.int32)
    return dict(inputs=tokens, targets=jnp.roll(tokens, -1, 1), positions=pos,
                segment_ids=seg, loss_weights=(seg != 0).astype(jnp.float32))


@pytest.mark.slow  # three models compiled with their gradients: ~15 s of CPU
def test_model_stages_gradients_and_objective():
    data = batch()
    models = {s: tiny(s) for s in ("off", "warmup", "sparse")}
    out = {s: loss_and_grads(m, data) for s, m in models.items()}
    (_, (ce_o, _, aux_o)), g_off = out["off"]
    assert "indexer_loss" not in aux_o
    main, index = split_indexer_grads(g_off)
    assert max(index) == 0.0 and max(main) > 0  # off: the indexer does not train

    (obj_w, (ce_w, _, aux_w)), g_w = out["warmup"]
    main, index = split_indexer_grads(g_w)
    assert max(main) == 0.0 and min(index) >= 0 and max(index) > 0  # main model frozen
    assert float(aux_w["indexer_loss"]) > 0 and not models["warmup"].mtp
    # loss_fn's aux_loss_weight is 0 by default; index_loss_weight is 1 by default
    np.testing.assert_allclose(float(obj_w), float(ce_w + aux_w["indexer_loss"]), rtol=1e-6)

    (_, (ce_s, _, _)), g_s = out["sparse"]
    np.testing.assert_allclose(float(ce_s), float(ce_o), rtol=1e-6)  # same sparse forward
    assert abs(float(ce_w) - float(ce_o)) > 1e-6  # warmup runs the dense forward
    main_s = nnx.state(g_s, MAIN)
    assert_trees_close(main_s, nnx.state(g_off, MAIN), rtol=1e-5, atol=1e-7)
    assert max(split_indexer_grads(g_s)[1]) > 0
    # the sown losses were popped: the model keeps no intermediates
    assert not jax.tree.leaves(nnx.state(models["sparse"], nnx.Intermediate))


# GLM-5: three dense layers, full / shared / full (the shared one has no indexer)
GLM_TINY = dict(TINY, num_hidden_layers=3, first_k_dense_replace=3)


@pytest.mark.slow  # four models compiled, two with their gradients: ~15 s of CPU
def test_glm_stages_train_full_layers_indexers_and_shared_layers_follow():
    data = batch()

    def glm(**kw):
        return GlmMoeDsa(GlmMoeDsaConfig.mini(**{**GLM_TINY, **kw}), inputs_shape=(B, L),
                         rngs=nnx.Rngs(0))

    # every key selected (k = L): the sparse forward of every layer is the dense one
    off, every = glm(), glm(index_topk=L)
    assert off.config.indexer_types == ("full", "shared", "full")
    assert_trees_close(nnx.state(every, nnx.Param), nnx.state(off, nnx.Param), 0, 0)
    ce = jax.jit(lambda m: step_lib.loss_fn(m, data)[1][0])
    ce_o, dense_ce = float(ce(off)), float(ce(every))
    assert abs(dense_ce - ce_o) > 1e-6

    def indexer_grads(grads):  # per layer: the largest indexer gradient (None: no indexer)
        flat = nnx.to_flat_state(grads)
        return [max((float(jnp.max(jnp.abs(v[...]))) for p, v in flat
                     if "indexer" in p and f"layers_{i}" in "_".join(map(str, p))), default=None)
                for i in range(3)]

    # warmup: the dense forward in every layer (the shared one too), the main model frozen,
    # both full layers' indexers trained
    (obj_w, (ce_w, _, aux_w)), g_w = loss_and_grads(glm(index_stage="warmup"), data)
    np.testing.assert_allclose(float(ce_w), dense_ce, rtol=1e-6)
    assert max(split_indexer_grads(g_w)[0]) == 0.0 and float(aux_w["indexer_loss"]) > 0
    g = indexer_grads(g_w)
    assert g[1] is None and g[0] > 0 and g[2] > 0
    np.testing.assert_allclose(float(obj_w), float(ce_w + aux_w["indexer_loss"]), rtol=1e-6)
    # sparse: off's forward (the shared layer reads the carried selection), both indexers
    # trained, and the main model trains too
    (_, (ce_s, _, aux_s)), g_s = loss_and_grads(glm(index_stage="sparse"), data)
    np.testing.assert_allclose(float(ce_s), ce_o, rtol=1e-6)
    g = indexer_grads(g_s)
    assert g[1] is None and g[0] > 0 and g[2] > 0 and float(aux_s["indexer_loss"]) > 0
    assert max(split_indexer_grads(g_s)[0]) > 0


def test_train_step_logs_indexer_loss_and_warmup_freezes_the_main_model():
    # one dense and one MoE layer, unrolled (scanned: the test above); the MoE's selection
    # bias is state DeepSeek's after-step hook moves
    model = tiny("warmup", index_loss_weight=0.5, scan_layers=False, first_k_dense_replace=1)
    state = nnx.Any(nnx.Param, RouterBias)
    before = {path: np.array(v[...]) for path, v in
              nnx.to_flat_state(nnx.state(model, state))}
    assert any("e_score_correction_bias" in path for path in before)
    optimizer = nnx.Optimizer(model, step_lib.make_tx(), wrt=nnx.Param)
    train_step = step_lib.make_train_step(aux_loss_weight=0.0, expert_bias_rate=1e-2)
    model, optimizer, metrics = train_step(model, optimizer, batch(), jnp.float32(1e-2))
    assert "indexer_loss" in metrics and float(metrics["indexer_loss"]) > 0
    np.testing.assert_allclose(float(metrics["objective"]), float(
        metrics["loss"] + 0.5 * metrics["indexer_loss"]), rtol=1e-6)
    changed = {path: not np.array_equal(np.asarray(v[...]), before[path])
               for path, v in nnx.to_flat_state(nnx.state(model, state))}
    index = [c for path, c in changed.items() if "indexer" in path]
    main = [c for path, c in changed.items() if "indexer" not in path]
    assert index and all(index)  # every indexer parameter moved
    # the main model is bit-identical: weight decay and the bias update undone too
    assert main and not any(main)
    assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))


def test_bad_index_stage_is_refused_at_construction(devices):
    with pytest.raises(ValueError, match=r"index_stage='dense'.*\('off', 'warmup', 'sparse'\)"):
        DeepSeekV32Config.mini(index_stage="dense")
    with pytest.raises(ValueError, match="index_loss_weight=-1"):
        DeepSeekV32Config.mini(index_loss_weight=-1.0)
    config = apply_overrides(DeepSeekV32Config.mini(), ["index_stage=warmup"])
    assert config.index_stage == "warmup" and DeepSeekV32Config.mini().index_stage == "off"
    assert "index_stage" not in config.to_hf_config()
    with pytest.raises(ValueError, match="index_stage='sparse' trains an indexer"):
        MLA(**{**KW, "index_topk": None}, index_stage="sparse", inputs_shape=(B, L, D),
            partitioner=None, rngs=nnx.Rngs(0))


# -- under context parallelism: the unsharded computation's loss, output and gradients -------

LC = 16  # divisible by 2 * cp for cp = 4
DOCS_CP = ([7, 6], [5, 4, 4])  # per row; the rest (3 tokens each) is padding
MESHES = {"cp": dict(data=2, context=4), "ep_as_cp": dict(fsdp=2, expert=2, context=2)}


def packed_cp():
    pos, seg = np.zeros((B, LC), np.int32), np.zeros((B, LC), np.int32)
    for b, docs in enumerate(DOCS_CP):
        at = 0
        for d, n in enumerate(docs, start=1):
            pos[b, at:at + n], seg[b, at:at + n] = np.arange(n), d
            at += n
    return pos, seg


def layer_on(stage: str, partitioner, **kw) -> MLA:
    return MLA(**KW, index_stage=stage, inputs_shape=(B, LC, D), partitioner=partitioner,
               rngs=nnx.Rngs(3), **kw)


def stage_objective(m: MLA, x, pos, seg, r):
    """(an LM-like loss ``sum(out * r)`` plus the sown KL, (out, KL))."""
    out = m(x, positions=pos, segment_ids=seg)
    (loss,) = jax.tree.leaves(nnx.pop(m, IndexerLoss))
    return jnp.sum(out * r) + loss, (out, loss)


def selection_gap(m: MLA, x, pos, seg) -> float:
    """The smallest gap between a query's k-th and (k+1)-th visible index score."""
    s = np.asarray(index_scores(m, x, pos))
    p, g = np.asarray(pos), np.asarray(seg)
    visible = (g[:, :, None] == g[:, None, :]) & (p[:, None, :] <= p[:, :, None]) & (
        g[:, None, :] != 0)
    top = -np.sort(-np.where(visible, s, -np.inf), axis=-1)
    ok = np.isfinite(top[..., TOPK])  # queries with more visible keys than k
    return float(np.min(top[..., TOPK - 1][ok] - top[..., TOPK][ok]))


def cp_inputs():
    pos, seg = packed_cp()
    rng = np.random.RandomState(0)
    x = rng.randn(B, LC, D).astype(np.float32)
    r = (rng.randn(B, LC, D) * (seg != 0)[..., None]).astype(np.float32)
    return x, pos, seg, r


STAGE_GRADS = value_and_grads(stage_objective, (nnx.DiffState(0, nnx.Param), 1), has_aux=True)


@functools.cache
def unsharded(stage: str):
    """The unsharded layer's (KL, out, parameter gradients, dx) on the natural order, numpy,
    computed once per stage for every mesh and layout below; its attention is the dense
    reference (the sparse stage's under the `TopK` mask, not `sparse_mla_attention`)."""
    plain = layer_on(stage, None, implementation="reference")
    x, pos, seg, r = cp_inputs()
    if stage == "sparse":
        gap = selection_gap(plain, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg))
        assert gap > 1e-4, f"top-{TOPK} ambiguous by float noise (gap {gap}); change the seed"
    (_, (out, kl)), (g_par, g_x) = STAGE_GRADS(plain, *(jnp.asarray(a) for a in (x, pos, seg,
                                                                                 r)))
    return plain, float(kl), np.asarray(out), g_par, np.asarray(g_x)


@pytest.mark.parametrize("stage,strategy,layout", [
    ("warmup", "cp", "document"), ("warmup", "ep_as_cp", "row"),
    ("sparse", "cp", "auto"), ("sparse", "ep_as_cp", "document")])
def test_stages_under_context_parallelism_equal_unsharded(devices, stage, strategy, layout):
    """On packed rows with padding reordered by `zoo.data.load_balance` for 4 context shards
    (data 2 x context 4, or fsdp 2 x expert 2 x context 2 under ep_as_cp, where the expert
    axis is a context axis), each stage's sown KL, its output and the gradients of
    ``sum(out * r) + KL`` with respect to every parameter (the indexer's and the main ones)
    and to x equal the unsharded layer's on the natural order."""
    plain, kl, out, g_par, g_x = unsharded(stage)
    p = zoo.Partitioner(zoo.make_mesh(**MESHES[strategy]), strategy)
    assert p.context_size("attention") == 4
    sharded = layer_on(stage, p)
    for (_, mine), (_, theirs) in zip(nnx.iter_graph(sharded), nnx.iter_graph(plain)):
        if isinstance(mine, nnx.Param):  # the same weights, kept in the sharded layout
            mine[...] = jax.device_put(theirs[...], mine[...].sharding)
    x, pos, seg, r = cp_inputs()
    index = np.broadcast_to(np.arange(LC, dtype=np.int32), (B, LC))
    bal = zoo.data.load_balance(dict(x=x, r=r, positions=pos, segment_ids=seg, index=index),
                                4, strategy=layout)
    assert not np.array_equal(bal["index"], index)
    (_, (out_s, kl_s)), (g_par_s, g_x_s) = STAGE_GRADS(sharded, *(jnp.asarray(bal[n]) for n in (
        "x", "positions", "segment_ids", "r")))
    assert kl > 1e-3
    np.testing.assert_allclose(float(kl_s), kl, rtol=1e-5, atol=1e-6)
    back = np.argsort(bal["index"], axis=1)[..., None]  # the natural order again
    valid = (seg != 0)[..., None]
    for got, want, what in ((out_s, out, "out"), (g_x_s, g_x, "dx")):
        assert_close(np.take_along_axis(np.asarray(got), back, 1) * valid, want * valid, what,
                     1e-5)
    flat, flat_s = nnx.to_flat_state(g_par), nnx.to_flat_state(g_par_s)
    assert [path for path, _ in flat] == [path for path, _ in flat_s]
    for (path, want), (_, got) in zip(flat, flat_s):
        assert_close(np.asarray(got[...]), np.asarray(want[...]), str(path), 1e-5)
    assert max(float(np.max(np.abs(v[...]))) for path, v in flat if "indexer" in path) > 0
