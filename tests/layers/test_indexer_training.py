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
  construction errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from zoo.layers import MLA
from zoo.layers.attention import AttentionBlock
from zoo.layers.indexer import IndexerLoss
from zoo.layers.moe import RouterBias
from zoo.models.deepseek_v32 import DeepSeekV32, DeepSeekV32Config
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


def layer(stage: str) -> MLA:
    return MLA(**KW, index_stage=stage, inputs_shape=(B, L, D), partitioner=None,
               rngs=nnx.Rngs(3))


def inputs():
    rng = np.random.RandomState(0)
    return (jnp.asarray(rng.randn(B, L, D), jnp.float32),
            jnp.asarray(rng.randn(B, L, D), jnp.float32))


@nnx.jit
def sown(m: MLA, x, pos, seg):
    """(out, the layer's sown indexer loss) -- popped, so the layer keeps no intermediates."""
    out = m(x, positions=pos, segment_ids=seg)
    (loss,) = jax.tree.leaves(nnx.pop(m, IndexerLoss))
    return out, loss


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


def assert_trees_close(a, b, rtol, atol):
    fa, fb = nnx.to_flat_state(a), nnx.to_flat_state(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, va), (_, vb) in zip(fa, fb):
        np.testing.assert_allclose(np.asarray(va[...]), np.asarray(vb[...]), rtol=rtol,
                                   atol=atol, err_msg=str(path))


def value_and_grads(fn, wrt, has_aux=False):
    """A jitted ``value_and_grad`` of ``fn(layer, x)`` with respect to ``wrt``."""
    return nnx.jit(nnx.value_and_grad(fn, argnums=wrt, has_aux=has_aux))


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_loss_and_indexer_gradients_equal_plain_reference(stage):
    pos, seg = packed()
    x, _ = inputs()
    m = layer(stage)
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
    def both(m, x):
        out, loss = sown(m, x, pos, seg)
        return jnp.sum(out * r) + loss, out

    def lm(m, x):
        out = m(x, positions=pos, segment_ids=seg)
        return jnp.sum(out * r), out

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


@jax.jit
def loss_and_grads(model, data):
    return nnx.value_and_grad(lambda m: step_lib.loss_fn(m, data), has_aux=True,
                              argnums=nnx.DiffState(0, nnx.Param))(model)


def split(grads):
    flat = nnx.to_flat_state(grads)
    main = [float(jnp.max(jnp.abs(v[...]))) for p, v in flat if "indexer" not in p]
    index = [float(jnp.max(jnp.abs(v[...]))) for p, v in flat if "indexer" in p]
    return main, index


@pytest.mark.slow  # three models compiled with their gradients: ~15 s of CPU
def test_model_stages_gradients_and_objective():
    data = batch()
    models = {s: tiny(s) for s in ("off", "warmup", "sparse")}
    out = {s: loss_and_grads(m, data) for s, m in models.items()}
    (_, (ce_o, _, aux_o)), g_off = out["off"]
    assert "indexer_loss" not in aux_o
    main, index = split(g_off)
    assert max(index) == 0.0 and max(main) > 0  # off: the indexer does not train

    (obj_w, (ce_w, _, aux_w)), g_w = out["warmup"]
    main, index = split(g_w)
    assert max(main) == 0.0 and min(index) >= 0 and max(index) > 0  # main model frozen
    assert float(aux_w["indexer_loss"]) > 0 and not models["warmup"].mtp
    # loss_fn's aux_loss_weight is 0 by default; index_loss_weight is 1 by default
    np.testing.assert_allclose(float(obj_w), float(ce_w + aux_w["indexer_loss"]), rtol=1e-6)

    (_, (ce_s, _, _)), g_s = out["sparse"]
    np.testing.assert_allclose(float(ce_s), float(ce_o), rtol=1e-6)  # same sparse forward
    assert abs(float(ce_w) - float(ce_o)) > 1e-6  # warmup runs the dense forward
    main_s = nnx.state(g_s, MAIN)
    assert_trees_close(main_s, nnx.state(g_off, MAIN), rtol=1e-5, atol=1e-7)
    assert max(split(g_s)[1]) > 0
    # the sown losses were popped: the model keeps no intermediates
    assert not jax.tree.leaves(nnx.state(models["sparse"], nnx.Intermediate))


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
    p = zoo.Partitioner(zoo.make_mesh(data=2, context=4), "cp")
    with pytest.raises(ValueError, match="context parallelism"):
        MLA(**KW, index_stage="warmup", inputs_shape=(B, 16, D), partitioner=p,
            rngs=nnx.Rngs(0))
