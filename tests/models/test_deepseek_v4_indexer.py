"""Training DeepSeek-V4's CSA indexer (``index_stage``, as DeepSeek-V3.2 trains its own)
against a plain reference written here: a loop over the queries of packed rows that takes
each query's sliding keys and the compressed entries it sees (its document's, complete by its
position; in the sparse stage the top-k by index score, the later entry first among ties), the
main attention's softmax of every head over them and the sinks from the layer's own
projections (float64), each head's probabilities of the entries summed over the heads and
renormalised, and the KL to the softmax of the index scores, summed per entry.

* both stages' loss values and their gradients with respect to the indexer's parameters;
* ``warmup`` attends densely (its output equals an ``off`` layer's that keeps every entry), and
  its KL reaches neither x nor any main parameter;
* ``sparse`` is ``off``'s forward, its KL leaves x's and every main parameter's gradient to
  the LM-like loss alone, and that loss gives the indexer no gradient;
* under context parallelism (cp, cp with the heads split over tensor, ep_as_cp; load-balanced
  packed rows) both stages' KL, output
  and every gradient equal the unsharded layer's;
* the model: ``aux["indexer_loss"]`` and the objective in both stages, warmup's zero main
  gradients, sparse's forward equal to ``off``'s; the train step logs ``indexer_loss``, and in
  warmup leaves the main model bit-identical (weight decay and the selection-bias update
  undone) while the indexer's KL on a repeated batch falls; the config field (``--set
  index_stage=...``) and construction errors.
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
                     loss_and_grads, packed_rows, sown_indexer_loss as sown,
                     split_indexer_grads, value_and_grads)
from zoo.layers.compressed_attention import CompressedAttention
from zoo.layers.moe import RouterBias
from zoo.models import deepseek_v4 as v4
from zoo.train import step as step_lib
from zoo.train.fields import apply_overrides

B, L, D, N, H, HR, RQ, W, RATE = 2, 32, 32, 4, 16, 8, 16, 5, 4
NI, HI, TOPK = 8, 16, 2
DOCS = ([14, 15], [6, 21, 2])  # per row; the rest is padding (lengths not multiples of 4)
INDEXER = nnx.All(nnx.Param, nnx.PathContains("indexer"))
MAIN = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))


def packed():
    return packed_rows(DOCS, L)


def layer(stage: str, topk: int = TOPK, partitioner=None) -> CompressedAttention:
    """A CSA layer, every parameter random (norms near 1, sinks and position biases too)."""
    m = CompressedAttention(
        kind="csa", num_heads=N, head_dim=H, rope_head_dim=HR, q_lora_rank=RQ, o_groups=2,
        o_lora_rank=6, sliding_window=W, compress_rate=RATE, index_n_heads=NI,
        index_head_dim=HI, index_topk=topk, inputs_shape=(B, L, D),
        partitioner=partitioner, index_stage=stage, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        name = ".".join(map(str, path))
        x = rng.standard_normal(var.shape).astype(np.float32)
        x = 1.0 + 0.2 * x if "norm" in name else x / np.sqrt(var.shape[0]) if "kernel" in name \
            else 0.5 * x
        var[...] = jax.device_put(x, var[...].sharding)
    return m


def inputs():
    rng = np.random.default_rng(2)
    return (rng.standard_normal((B, L, D)).astype(np.float32),
            rng.standard_normal((B, L, D)).astype(np.float32))


def assert_leaves_close(a, b, rtol):
    """Each leaf within `rtol` of its reference's largest magnitude (`assert_close`)."""
    fa, fb = nnx.to_flat_state(a), nnx.to_flat_state(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, va), (_, vb) in zip(fa, fb):
        assert_close(np.asarray(va[...]), np.asarray(vb[...]), str(path), rtol)


# -- the plain reference ----------------------------------------------------------------------

def index_scores(m, x, pos, seg):
    """The indexer's score of every (query, entry) pair [B, L, E] on the detached input,
    ``sum_j w[t, j] * relu(Hi**-0.5 * q[t, j] . k[e])`` over its own compressed keys."""
    ix = m.compressor.indexer
    x = jax.lax.stop_gradient(x)
    iq, iw = ix.queries(x, jax.lax.stop_gradient(m.q_latent(x)), pos)
    keys, _, _ = ix.keys(x, pos, seg)
    dots = jnp.einsum("btjh,beh->btej", iq, keys) * HI ** -0.5
    return jnp.einsum("btej,btj->bte", jax.nn.relu(dots), iw)


@nnx.jit
def projections(m, x, pos, seg):
    q, kv = m.project(x, m.q_latent(x), pos)  # rotated [B, L, N, H], [B, L, H]
    entries, start, eseg = m.compressor(x, positions=pos, segment_ids=seg)
    return q, kv, entries, start, eseg, index_scores(m, x, pos, seg)


def reference_targets(m, x, pos, seg, stage: str):
    """For each query with a visible entry, by a loop: its entries (its document's, complete
    by its position; in the sparse stage the top-k by index score, the later entry first among
    ties), and the main attention's probabilities of them -- one softmax per head over its
    sliding keys, those entries and the head's sink -- summed over heads and renormalised
    (float64). Also the smallest nonzero gap between a selected and a rejected score."""
    q, kv, entries, start, eseg, scores = (np.asarray(a, np.float64) for a in projections(
        m, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg)))
    sinks = np.asarray(m.sinks[...], np.float64)
    targets, gap = [], np.inf
    for b in range(B):
        for t in range(L):
            if seg[b, t] == 0:
                continue
            window = [s for s in range(L) if seg[b, s] == seg[b, t]
                      and pos[b, t] - W < pos[b, s] <= pos[b, t]]
            seen = [e for e in range(entries.shape[1]) if eseg[b, e] == seg[b, t]
                    and start[b, e] + RATE - 1 <= pos[b, t]]
            if not seen:
                continue
            if stage == "sparse" and len(seen) > TOPK:
                order = sorted(seen, key=lambda e: (-scores[b, t, e], -start[b, e]))
                edge = scores[b, t, order[TOPK - 1]] - scores[b, t, order[TOPK]]
                gap = min(gap, edge) if edge != 0 else gap
                seen = order[:TOPK]
            p = np.zeros(len(seen))
            for n in range(N):
                logits = np.array([q[b, t, n] @ kv[b, s] for s in window]
                                  + [q[b, t, n] @ entries[b, e] for e in seen]) * H ** -0.5
                logits = np.append(logits, sinks[n])
                e_ = np.exp(logits - logits.max())
                p += (e_ / e_.sum())[len(window):len(window) + len(seen)]
            targets.append((b, t, seen, p / p.sum()))
    return targets, gap


def reference_loss(m, x, pos, seg, targets):
    """Mean over the queries of ``sum_e p_e (log p_e - log softmax(I)_e)`` over their
    entries (the targets' entry lists padded to one width, the padding weighing nothing)."""
    width = max(len(seen) for _, _, seen, _ in targets)
    rows = np.array([(b, t) for b, t, _, _ in targets])
    ents = np.array([seen + [0] * (width - len(seen)) for _, _, seen, _ in targets])
    p = np.array([list(q) + [0.0] * (width - len(q)) for _, _, _, q in targets])
    mask = np.arange(width) < np.array([len(seen) for _, _, seen, _ in targets])[:, None]
    scores = index_scores(m, x, pos, seg)[rows[:, 0, None], rows[:, 1, None], ents]  # [T, w]
    log_q = jax.nn.log_softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    log_p = np.log(np.where(mask, p, 1.0))
    return jnp.sum(jnp.where(mask, p * (log_p - log_q), 0.0)) / len(targets)


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_loss_and_indexer_gradients_equal_plain_reference(stage):
    """Packed rows (5 documents, padding, lengths not multiples of 4): the sown KL and its
    gradient with respect to every indexer parameter (its compressor's too) equal the loop's."""
    pos, seg = packed()
    x, _ = inputs()
    m = layer(stage)
    wrt = nnx.DiffState(0, INDEXER)
    loss, got = value_and_grads(lambda m: sown(m, x, pos, seg)[1], wrt)(m)
    targets, gap = reference_targets(m, x, pos, seg, stage)
    if stage == "sparse":
        assert gap > 1e-4, f"top-{TOPK} ambiguous by float noise (gap {gap}); change the seed"
        assert any(len(seen) == TOPK for _, _, seen, _ in targets)
    assert len(targets) > 30  # the queries with an entry in view
    want, ref = value_and_grads(lambda m: reference_loss(m, x, pos, seg, targets), wrt)(m)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    assert float(loss) > 1e-3  # an untrained indexer is far from the attention
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-6)
    names = {".".join(map(str, p)) for p, v in nnx.to_flat_state(got)
             if float(jnp.max(jnp.abs(v[...]))) > 0}
    assert {"compressor.indexer.q_b_proj.kernel", "compressor.indexer.weights_proj.kernel",
            "compressor.indexer.compressor.kv_proj.kernel",
            "compressor.indexer.compressor.position_bias"} <= names


def test_warmup_is_dense_and_its_kl_leaves_the_main_path_alone():
    """warmup: the dense forward (an ``off`` layer keeping every entry); the KL reaches
    neither x nor any main parameter."""
    pos, seg = packed()
    x, _ = inputs()
    valid = (seg != 0)[..., None]
    wrt = (nnx.DiffState(0, MAIN), 1)

    def kl(m, x):
        out, loss = sown(m, x, pos, seg)
        return loss, out

    (_, out_w), (g_main, g_x) = value_and_grads(kl, wrt, has_aux=True)(layer("warmup"), x)
    forward = nnx.jit(lambda m, x: m(x, positions=pos, segment_ids=seg))
    dense, sparse = forward(layer("off", topk=L // RATE), x), forward(layer("off"), x)
    assert_close(np.asarray(out_w) * valid, np.asarray(dense) * valid, "warmup out", 1e-5)
    assert not np.allclose(np.asarray(out_w) * valid, np.asarray(sparse) * valid, atol=1e-3)
    assert float(jnp.max(jnp.abs(g_x))) == 0.0
    assert all(float(jnp.max(jnp.abs(v[...]))) == 0.0 for _, v in nnx.to_flat_state(g_main))


def test_sparse_is_off_and_lm_and_kl_gradients_stay_apart():
    """sparse: off's forward; (LM-like loss + KL) has the LM-like loss's gradients in x and in
    every main parameter, and the LM-like loss alone gives the indexer none."""
    pos, seg = packed()
    x, r = inputs()
    wrt = (nnx.DiffState(0, MAIN), 1)
    both, lm = lm_and_indexer_losses(r, pos, seg)
    (_, out_s), (got_main, got_x) = value_and_grads(both, wrt, True)(layer("sparse"), x)
    (_, out_o), (want_main, want_x) = value_and_grads(lm, wrt, True)(layer("off"), x)
    assert_close(np.asarray(out_s), np.asarray(out_o), "sparse out", 1e-6)
    assert_close(np.asarray(got_x), np.asarray(want_x), "sparse dx", 1e-5)
    assert_leaves_close(got_main, want_main, 1e-5)

    def lm_sparse(m):
        out, _ = sown(m, x, pos, seg)
        return jnp.sum(out * r)

    _, g_index = value_and_grads(lm_sparse, nnx.DiffState(0, INDEXER))(layer("sparse"))
    assert all(float(jnp.max(jnp.abs(v[...]))) == 0.0 for _, v in nnx.to_flat_state(g_index))


# -- under context parallelism -----------------------------------------------------------------

MESHES = {"cp": ("cp", dict(data=2, context=4)), "cp_tp": ("cp", dict(context=4, tensor=2)),
          "ep_as_cp": ("ep_as_cp", dict(fsdp=2, expert=2, context=2))}
CP_GRADS = value_and_grads(
    lambda m, x, pos, seg, r: (lambda out, kl: (jnp.sum(out * r) + kl, (out, kl)))(
        *sown(m, x, pos, seg)), (nnx.DiffState(0, nnx.Param), 1), has_aux=True)


@functools.cache
def unsharded(stage: str):
    """The unsharded layer's (KL, out, parameter gradients, dx) on the natural order."""
    pos, seg = packed()
    x, r = inputs()
    plain = layer(stage)
    if stage == "sparse":
        gap = reference_targets(plain, x, pos, seg, stage)[1]
        assert gap > 1e-4, f"top-{TOPK} ambiguous by float noise (gap {gap}); change the seed"
    (_, (out, kl)), (g_par, g_x) = CP_GRADS(plain, *map(jnp.asarray, (x, pos, seg, r)))
    return float(kl), np.asarray(out), g_par, np.asarray(g_x)


@pytest.mark.slow  # 7-11 s each on a 2-core box under load, 20-28 s under heavy load
@pytest.mark.parametrize("stage,mesh,layout", [
    ("warmup", "cp", "document"), ("sparse", "ep_as_cp", "row"), ("sparse", "cp_tp", "auto")])
def test_stages_under_context_parallelism_equal_unsharded(devices, stage, mesh, layout):
    """The packed rows reordered by `zoo.data.load_balance` for 4 context shards (data 2 x
    context 4; context 4 x tensor 2, the heads split, so the indexer's target gathers them;
    fsdp 2 x expert 2 x context 2 under ep_as_cp, the expert axis a context axis): each
    stage's sown KL, the output and the gradients of ``sum(out * r) + KL`` with respect to
    every parameter (indexer and main) and to x equal the unsharded layer's."""
    kl, out, g_par, g_x = unsharded(stage)
    strategy, sizes = MESHES[mesh]
    p = zoo.Partitioner(zoo.make_mesh(**sizes), strategy)
    assert p.context_size("attention") == 4
    sharded = layer(stage, partitioner=p)
    pos, seg = packed()
    x, r = inputs()
    index = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    bal = zoo.data.load_balance(dict(x=x, r=r, positions=pos, segment_ids=seg, index=index),
                                4, strategy=layout)
    assert not np.array_equal(bal["index"], index)
    (_, (out_s, kl_s)), (g_par_s, g_x_s) = CP_GRADS(sharded, *(jnp.asarray(bal[n]) for n in (
        "x", "positions", "segment_ids", "r")))
    assert kl > 1e-3
    np.testing.assert_allclose(float(kl_s), kl, rtol=1e-5)
    back = np.argsort(bal["index"], axis=1)[..., None]  # the natural order again
    for got, want, what in ((out_s, out, "out"), (g_x_s, g_x, "dx")):
        assert_close(np.take_along_axis(np.asarray(got), back, 1), want, what, 1e-5)
    assert_leaves_close(g_par_s, g_par, 1e-5)
    assert max(float(np.max(np.abs(v[...]))) for path, v in nnx.to_flat_state(g_par)
               if "indexer" in path) > 0


# -- the model ---------------------------------------------------------------------------------

# one CSA layer (routed MoE)
TINY = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=4, head_dim=16, qk_rope_head_dim=8, q_lora_rank=16,
            n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=8,
            index_n_heads=8, index_head_dim=16, index_topk=2, sliding_window=4,
            layer_types=(v4.CSA,), num_hash_layers=0, scan_layers=False)


def tiny(stage: str, **kw) -> v4.DeepSeekV4:
    config = v4.DeepSeekV4Config.mini(**{**TINY, **kw, "index_stage": stage})
    return v4.DeepSeekV4(config, inputs_shape=(B, L), rngs=nnx.Rngs(0))


def batch():
    pos, seg = packed()
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 64, (B, L)), jnp.int32)
    return dict(inputs=tokens, targets=jnp.roll(tokens, -1, 1), positions=jnp.asarray(pos),
                segment_ids=jnp.asarray(seg), loss_weights=jnp.asarray(seg != 0, jnp.float32))


@pytest.mark.slow  # three models compiled, two with their gradients: 20-25 s under load
def test_model_stages_gradients_and_objective():
    data = batch()
    ce_o, _, aux_o = jax.jit(lambda m: step_lib.loss_fn(m, data)[1])(tiny("off"))
    assert "indexer_loss" not in aux_o

    (obj_w, (ce_w, _, aux_w)), g_w = loss_and_grads(tiny("warmup"), data)
    main, index = split_indexer_grads(g_w)
    assert max(main) == 0.0 and max(index) > 0  # main model frozen, the indexer learns
    assert float(aux_w["indexer_loss"]) > 0
    np.testing.assert_allclose(float(obj_w), float(ce_w + aux_w["indexer_loss"]), rtol=1e-6)
    assert abs(float(ce_w) - float(ce_o)) > 1e-6  # warmup runs the dense forward

    # sparse: off's forward, both the main model and the indexer train (that the KL and the
    # LM loss reach only their own side: the layer tests above)
    (obj_s, (ce_s, _, aux_s)), g_s = loss_and_grads(tiny("sparse"), data)
    np.testing.assert_allclose(float(ce_s), float(ce_o), rtol=1e-6)  # the same sparse forward
    np.testing.assert_allclose(float(obj_s), float(ce_s + aux_s["indexer_loss"]), rtol=1e-6)
    main, index = split_indexer_grads(g_s)
    assert float(aux_s["indexer_loss"]) > 0 and max(index) > 0 and max(main) > 0


def test_train_step_warmup_freezes_the_main_model_and_the_kl_falls():
    model = tiny("warmup", index_loss_weight=0.5)
    state = nnx.Any(nnx.Param, RouterBias)
    before = {path: np.array(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, state))}
    assert any("e_score_correction_bias" in ".".join(map(str, p)) for p in before)
    optimizer = nnx.Optimizer(model, step_lib.make_tx(), wrt=nnx.Param)
    train_step = step_lib.make_train_step(aux_loss_weight=0.0, expert_bias_rate=1e-2)
    data, losses = batch(), []
    for _ in range(3):  # the same batch: the indexer's KL falls
        model, optimizer, metrics = train_step(model, optimizer, data, jnp.float32(1e-2))
        losses.append(float(metrics["indexer_loss"]))
        np.testing.assert_allclose(float(metrics["objective"]), float(
            metrics["loss"] + 0.5 * metrics["indexer_loss"]), rtol=1e-6)
    assert losses[0] > losses[1] > losses[2] > 0, losses
    changed = {path: not np.array_equal(np.asarray(v[...]), before[path])
               for path, v in nnx.to_flat_state(nnx.state(model, state))}
    index = [c for path, c in changed.items() if "indexer" in path]
    main = [c for path, c in changed.items() if "indexer" not in path]
    assert index and all(index)  # every indexer parameter moved
    assert main and not any(main)  # the rest bit-identical: weight decay and bias update undone
    assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))


def test_index_stage_config_and_construction_errors():
    config = apply_overrides(v4.DeepSeekV4Config.mini(), ["index_stage=sparse"])
    assert config.index_stage == "sparse" and v4.DeepSeekV4Config.mini().index_stage == "off"
    assert "index_stage" not in config.to_hf_config()
    with pytest.raises(ValueError, match=r"index_stage='dense'.*\('off', 'warmup', 'sparse'\)"):
        v4.DeepSeekV4Config.mini(index_stage="dense")
    with pytest.raises(ValueError, match="index_loss_weight=-1"):
        v4.DeepSeekV4Config.mini(index_loss_weight=-1.0)
    kw = dict(num_heads=N, head_dim=H, rope_head_dim=HR, q_lora_rank=RQ, o_groups=2,
              o_lora_rank=6, sliding_window=W, inputs_shape=(B, L, D), partitioner=None,
              rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="index_stage='warmup' trains CSA's indexer, but "
                                         "kind='hca'"):
        CompressedAttention(kind="hca", index_stage="warmup", **kw)
    with pytest.raises(ValueError, match="index_stage='on' must be one of"):
        CompressedAttention(kind="csa", index_stage="on", **kw)
    # sliding and HCA layers of a training model have no indexer and stay "off"
    model = nnx.eval_shape(lambda: tiny("warmup", num_hidden_layers=2,
                                        layer_types=(v4.CSA, v4.HCA), compress_rate_hca=8))
    stages = [layer.self_attn.index_stage for layer in model.layers]
    assert stages == ["warmup", "off"]
