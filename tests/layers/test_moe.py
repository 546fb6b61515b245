"""MoE: routing against hand-built cases and Hugging Face's routers; the layer (forward and
gradients, input and parameters) against a dense reference written here (every expert on every
token) unsharded and under the four strategy meshes; capacity drops; bias balancing; errors."""

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zoo.layers.moe import MoE, RouterBias, moe_modules, update_expert_bias
from zoo.ops import grouped
from zoo.ops import moe as ops
from zoo.ops.moe_execution import a2a_capacity
from zoo.partitioning import Partitioner, make_mesh

B, L, D, F, E = 8, 8, 16, 8, 8
MESHES = {
    "fsdp8": ("fsdp", dict(fsdp=8)),
    "cp_c4e2": ("cp", dict(context=4, expert=2)),
    "epcp_f2e4": ("ep_as_cp", dict(fsdp=2, expert=4)),
    "epcp_f2e2c2": ("ep_as_cp", dict(fsdp=2, expert=2, context=2)),
    "fsdp_f2e2t2": ("fsdp", dict(fsdp=2, expert=2, tensor=2)),  # tensor-sharded expert width
    "ep8": ("fsdp", dict(expert=8)),
}
CONFIGS = {
    "mixtral": dict(num_experts=E, num_experts_per_tok=2, mlp_dim=F, scoring="softmax"),
    "deepseek": dict(num_experts=E, num_experts_per_tok=3, mlp_dim=F, scoring="sigmoid",
                     n_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=1),
    "top1": dict(num_experts=E, num_experts_per_tok=1, mlp_dim=F, scoring="softmax"),
    "top8": dict(num_experts=E, num_experts_per_tok=8, mlp_dim=F, scoring="softmax"),
}


def logit(s):
    s = np.asarray(s, np.float64)
    return np.log(s / (1 - s)).astype(np.float32)


# -- routing by hand -----------------------------------------------------------------------
# 16 experts in 4 groups. Group top-2 sums: g0 1.05, g1 1.35, g2 1.10, g3 0.95.
SCORES = np.array([0.95, 0.05, 0.10, 0.02, 0.70, 0.65, 0.60, 0.10,
                   0.80, 0.30, 0.20, 0.10, 0.50, 0.45, 0.40, 0.35], np.float32)


def _sorted(weights, indices):
    order = np.argsort(np.asarray(indices)[0])
    return np.asarray(indices)[0][order], np.asarray(weights)[0][order]


def test_route_group_limited_by_hand():
    kw = dict(k=4, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    w, i, s = ops.route(jnp.asarray(logit(SCORES))[None], **kw)
    idx, wts = _sorted(w, i)
    # groups 1 and 2 win; expert 0 (the best single score) is excluded with its group
    np.testing.assert_array_equal(idx, [4, 5, 6, 8])
    np.testing.assert_allclose(wts, np.array([.70, .65, .60, .80]) / 2.75 * 2.5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s)[0], SCORES, rtol=1e-6)
    # without groups the global top-4
    w, i, _ = ops.route(jnp.asarray(logit(SCORES))[None], k=4, scoring="sigmoid")
    idx, wts = _sorted(w, i)
    np.testing.assert_array_equal(idx, [0, 4, 5, 8])
    np.testing.assert_allclose(wts, np.array([.95, .70, .65, .80]) / 3.10, rtol=1e-6)
    # unnormalised: raw scores times the scale
    w, i, _ = ops.route(jnp.asarray(logit(SCORES))[None], norm_topk_prob=False, **kw)
    np.testing.assert_allclose(_sorted(w, i)[1], np.array([.70, .65, .60, .80]) * 2.5,
                               rtol=1e-6)


def test_route_bias_changes_selection_not_weights():
    bias = np.zeros(16, np.float32)
    bias[15] = 0.6  # group 3 becomes [.5, .45, .4, .95]: top-2 1.45, best group
    w, i, _ = ops.route(jnp.asarray(logit(SCORES))[None], bias=jnp.asarray(bias), k=4,
                        scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    idx, wts = _sorted(w, i)
    np.testing.assert_array_equal(idx, [4, 5, 6, 15])  # groups 3 and 1; expert 8 is out
    # expert 15 weighs in with its unbiased score 0.35
    np.testing.assert_allclose(wts, np.array([.70, .65, .60, .35]) / 2.30 * 2.5, rtol=1e-6)


def test_route_softmax_by_hand():
    logits = np.array([[2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, 0.2]], np.float32)
    w, i, s = ops.route(jnp.asarray(logits), k=2)
    idx, wts = _sorted(w, i)
    np.testing.assert_array_equal(idx, [0, 3])
    np.testing.assert_allclose(wts, [1 / (1 + math.e), math.e / (1 + math.e)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s).sum(), 1.0, rtol=1e-6)


def test_route_matches_hugging_face():
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config, MixtralConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import (MixtralTopKRouter,
                                                              load_balancing_loss_func)
    rng = np.random.default_rng(0)
    h = rng.normal(size=(64, 16)).astype(np.float32)
    cases = [
        (MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8,
                                         num_experts_per_tok=2)), dict(k=2)),
        (DeepseekV3TopkRouter(DeepseekV3Config(
            hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
         dict(k=4, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    ]
    for router, kw in cases:
        w = rng.normal(size=tuple(router.weight.shape)).astype(np.float32)
        with torch.no_grad():
            router.weight.copy_(torch.from_numpy(w))
            bias = None
            if hasattr(router, "e_score_correction_bias"):
                bias = (rng.normal(size=w.shape[0]) * 0.3).astype(np.float32)
                router.e_score_correction_bias.copy_(torch.from_numpy(bias))
            hf_logits, hf_w, hf_i = router(torch.from_numpy(h))
        ours_w, ours_i, _ = ops.route(jnp.asarray(h @ w.T), bias=bias, **kw)
        np.testing.assert_allclose(h @ w.T, hf_logits.numpy(), rtol=1e-5, atol=1e-5)
        hf_o, ours_o = np.argsort(hf_i.numpy(), -1), np.argsort(np.asarray(ours_i), -1)
        np.testing.assert_array_equal(np.take_along_axis(hf_i.numpy(), hf_o, -1),
                                      np.take_along_axis(np.asarray(ours_i), ours_o, -1))
        np.testing.assert_allclose(np.take_along_axis(np.asarray(ours_w), ours_o, -1),
                                   np.take_along_axis(hf_w.numpy(), hf_o, -1), atol=1e-6)
    # documented relation to HF's Mixtral aux loss: theirs = k * ours
    logits = rng.normal(size=(64, 8)).astype(np.float32)
    w, i, s = ops.route(jnp.asarray(logits), k=2)
    ours = ops.load_balance_loss(s, ops.expert_counts(i, 8), k=2)
    theirs = load_balancing_loss_func((torch.from_numpy(logits),), 8, 2)
    np.testing.assert_allclose(2 * float(ours), float(theirs), rtol=1e-5)


# -- dispatch on one device's experts -----------------------------------------------------
def _numpy_experts(x, indices, weights, wg, wu, wo, lo, hi, keep=None):
    """Loop over token copies: sum of w * SwiGLU_e(x) for experts lo <= e < hi."""
    silu = lambda v: v / (1 + np.exp(-v))
    y = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = indices[t, j]
            if lo <= e < hi and (keep is None or keep[t, e]):
                h = silu(x[t] @ wg[e]) * (x[t] @ wu[e])
                y[t] += weights[t, j] * (h @ wo[e])
    return y


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked", "tokamax"])
def test_dropless_experts_on_expert_shards(impl):
    rng = np.random.default_rng(3)
    T, k, n_exp = 40, 3, 8
    x = rng.normal(size=(T, D)).astype(np.float32)
    # skewed: expert 2 is popular, experts 5 and 7 never chosen (empty groups)
    indices = np.stack([rng.choice([0, 1, 2, 2, 2, 3, 4, 6], 3, replace=False)
                        for _ in range(T)]).astype(np.int32)
    weights = rng.uniform(size=(T, k)).astype(np.float32)
    wg, wu = (rng.normal(size=(n_exp, D, F)).astype(np.float32) * 0.3 for _ in range(2))
    wo = rng.normal(size=(n_exp, F, D)).astype(np.float32) * 0.3
    total = 0
    for lo in (0, 4):  # two shards of 4 local experts each
        y, dropped = ops.dropless_experts(x, indices, weights, wg[lo:lo + 4], wu[lo:lo + 4],
                                          wo[lo:lo + 4], expert_offset=lo, impl=impl)
        expect = _numpy_experts(x, indices, weights, wg, wu, wo, lo, lo + 4)
        np.testing.assert_allclose(np.asarray(y), expect, rtol=1e-5, atol=1e-5)
        assert int(dropped) == 0
        total = total + np.asarray(y)
    np.testing.assert_allclose(total, _numpy_experts(x, indices, weights, wg, wu, wo, 0, 8),
                               rtol=1e-5, atol=1e-5)


# -- the dense reference ----------------------------------------------------------------------
def reference(params, x, cfg, bias=None, keep=None):
    """Every expert on every token, combined with a router written from the definitions.

    `keep` ([T, E] 0/1, numpy) masks dropped copies for capacity checks."""
    k, scoring = cfg["num_experts_per_tok"], cfg.get("scoring", "softmax")
    n_group, topk_group = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    t = x.reshape(-1, D)
    logits = t.astype(jnp.float32) @ params["router"]
    s = jax.nn.softmax(logits) if scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = jax.lax.stop_gradient(s) + (0 if bias is None else bias)
    if n_group > 1:
        g = choice.reshape(-1, n_group, E // n_group)
        gscore = jnp.sort(g, -1)[..., -2:].sum(-1)
        rank = jnp.argsort(jnp.argsort(-gscore, -1), -1)  # 0 = best group
        choice = jnp.where(jnp.repeat(rank < topk_group, E // n_group, -1), choice, -1e9)
    sel = jnp.argsort(-choice, -1)[:, :k]
    mask = jax.nn.one_hot(sel, E).sum(1)  # [T, E]
    comb = mask * s
    if cfg.get("norm_topk_prob", True):
        comb = comb / comb.sum(-1, keepdims=True)
    comb = comb * cfg.get("routed_scaling_factor", 1.0)
    if keep is not None:
        comb = comb * keep
    h = jax.nn.silu(jnp.einsum("td,edf->tef", t, params["wi_gate"]))
    h = h * jnp.einsum("td,edf->tef", t, params["wi_up"])
    y = jnp.einsum("te,tef,efd->td", comb, h, params["wo"])
    if "shared_gate" in params:
        hs = jax.nn.silu(t @ params["shared_gate"]) * (t @ params["shared_up"])
        y = y + hs @ params["shared_down"]
    p_mean = (s if scoring == "softmax" else s / s.sum(-1, keepdims=True)).mean(0)
    lb = E * jnp.sum(mask.mean(0) / k * p_mean)
    return y.reshape(x.shape), lb, mask.sum(0)


PATHS = {"router": ("router",), "wi_gate": ("wi_gate",), "wi_up": ("wi_up",), "wo": ("wo",),
         "shared_gate": ("shared_experts", "gate", "kernel"),
         "shared_up": ("shared_experts", "up", "kernel"),
         "shared_down": ("shared_experts", "down", "kernel")}


def _leaf(state, path):
    for p in path:
        state = getattr(state, p) if isinstance(state, nnx.Module) else state[p]
    return state


def build(cfg, partitioner=None, values=None, bias=None, **extra):
    """A MoE with the given parameter values (placed on each parameter's own sharding)."""
    moe = MoE(inputs_shape=(B, L, D), partitioner=partitioner, rngs=nnx.Rngs(0), **cfg,
              **extra)
    for name, path in PATHS.items():
        if values is not None and name in values:
            var = _leaf(moe, path)
            var[...] = jax.device_put(values[name], var[...].sharding)
    if bias is not None:
        moe.e_score_correction_bias[...] = jax.device_put(
            bias, moe.e_score_correction_bias[...].sharding)
    return moe


def _loss_fn(graphdef, rest, ct):
    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y * ct) + 0.3 * aux["load_balance_loss"], (y, aux)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.fixture(scope="module")
def setups():
    """Per config: parameter values, input, cotangent, bias and the reference results."""
    out = {}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    ct = rng.normal(size=(B, L, D)).astype(np.float32)
    for name, cfg in CONFIGS.items():
        moe = build(cfg)
        values = {n: np.asarray(_leaf(moe, p)[...]) for n, p in PATHS.items()
                  if not n.startswith("shared") or moe.shared_experts is not None}
        values["router"] = values["router"] * 3  # sharper routing: fewer near-ties
        bias = ((rng.normal(size=E) * 0.2).astype(np.float32)
                if cfg["scoring"] == "sigmoid" else None)

        def ref_loss(params, x, cfg=cfg, bias=bias):
            y, lb, counts = reference(params, x, cfg, bias)
            return jnp.sum(y * ct) + 0.3 * lb, (y, counts)
        (_, (y, counts)), grads = jax.jit(jax.value_and_grad(ref_loss, (0, 1), has_aux=True))(
            {n: jnp.asarray(v) for n, v in values.items()}, jnp.asarray(x))
        out[name] = dict(cfg=cfg, values=values, bias=bias, x=x, ct=ct, y=np.asarray(y),
                         counts=np.asarray(counts), grads=grads)
    return out


# DeepSeek (groups, bias, shared experts) on every mesh and both dispatches; Mixtral routing
# (top-2), top-1 and top-8 on the EP ones
# (overflow "auto" runs the rounds where they save: mixtral and top1 below; "drop" keeps those
# on the one round of worst-case buffers)
CASES = ([("deepseek", m, "all_gather", "auto") for m in (None, *MESHES)]
         + [("deepseek", m, "all_to_all", "auto") for m in MESHES if m != "fsdp8"]
         + [("mixtral", m, "all_gather", "auto") for m in ("epcp_f2e4", "epcp_f2e2c2")]
         + [("mixtral", "epcp_f2e4", "all_to_all", o) for o in ("auto", "drop")]
         + [("top1", "ep8", "all_to_all", o) for o in ("auto", "drop")]
         + [("top8", "epcp_f2e4", "all_to_all", "auto"), ("top8", "ep8", "all_gather", "auto")])


def _mesh(mesh):
    return None if mesh is None else Partitioner(make_mesh(**MESHES[mesh][1]), MESHES[mesh][0])


@pytest.mark.parametrize("config, mesh, dispatch, overflow", CASES)
def test_forward_and_grads_match_dense_reference(setups, config, mesh, dispatch, overflow):
    s = setups[config]
    part = _mesh(mesh)
    moe = build(s["cfg"], part, s["values"], s["bias"], dispatch=dispatch, overflow=overflow)
    assert moe.dispatch == dispatch
    rounds = overflow == "auto" and config in ("mixtral", "top1") and dispatch == "all_to_all"
    assert (moe.overflow, moe.exchange_buffer_factor) == (
        ("exact", 1.25) if rounds else ("drop" if overflow == "auto" else overflow, None))
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    (_, (y, aux)), (g_params, g_x) = _loss_fn(graphdef, rest, s["ct"])(params, s["x"])
    np.testing.assert_allclose(np.asarray(y), s["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), s["counts"])
    assert float(aux["dropped_fraction"]) == 0.0 and int(aux["dropped_tokens"]) == 0
    g_ref_params, g_ref_x = s["grads"]
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_ref_x), rtol=1e-4, atol=1e-5)
    for name in s["values"]:
        np.testing.assert_allclose(np.asarray(_leaf(g_params, PATHS[name])[...]),
                                   np.asarray(g_ref_params[name]), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    if mesh is not None:  # the output comes back in the layout the tokens arrived in
        assert y.sharding.is_equivalent_to(part.sharding(("batch", "length", "act_embed")), 3)


@pytest.mark.parametrize("mesh, impl", [(None, "ragged_dot"), ("epcp_f2e2c2", "ragged_dot"),
                                        ("epcp_f2e4", "tokamax")])
def test_other_grouped_matmuls_match_reference(setups, mesh, impl):
    """On CPU the layer runs the blocked grouped matmul; ragged_dot and tokamax's XLA fallback
    (what tokamax runs off GPU/TPU) must give the same layer."""
    s = setups["deepseek"]
    moe = build(s["cfg"], _mesh(mesh), s["values"], s["bias"], grouped_matmul=impl,
                dispatch="all_to_all" if mesh else "auto")
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    (_, (y, _)), (g_params, g_x) = _loss_fn(graphdef, rest, s["ct"])(params, s["x"])
    np.testing.assert_allclose(np.asarray(y), s["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(s["grads"][1]), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(_leaf(g_params, PATHS["wi_up"])[...]),
                               np.asarray(s["grads"][0]["wi_up"]), rtol=1e-4, atol=1e-5)


def test_bfloat16_close_to_float32_reference(setups):
    s = setups["deepseek"]
    moe = build(s["cfg"], None, s["values"], s["bias"], dtype=jnp.bfloat16)
    y, _ = jax.jit(lambda m, x: m(x))(moe, jnp.asarray(s["x"], jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    scale = np.abs(s["y"]).max()
    np.testing.assert_allclose(np.asarray(y, np.float32), s["y"], atol=3e-2 * scale)


# -- capacity ----------------------------------------------------------------------------------
def _capacity_keep(indices, capacity):
    """[T, E] 0/1: first choices (token order) first, then second choices, ... up to capacity."""
    T, k = indices.shape
    keep, used = np.zeros((T, E), np.float32), np.zeros(E, int)
    for j in range(k):
        for t in range(T):
            e = indices[t, j]
            if used[e] < capacity:
                keep[t, e], used[e] = 1, used[e] + 1
    return keep


def _check_kept_copies_exact(s, keep, y, g_params, g_x):
    """Output and gradients equal the dense reference with the dropped copies masked out."""
    def ref_loss(params, x):
        y, lb, _ = reference(params, x, s["cfg"], keep=keep)
        return jnp.sum(y * s["ct"]) + 0.3 * lb, y
    (_, y_ref), (g_ref_params, g_ref_x) = jax.jit(
        jax.value_and_grad(ref_loss, (0, 1), has_aux=True))(
        {n: jnp.asarray(v) for n, v in s["values"].items()}, jnp.asarray(s["x"]))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_ref_x), rtol=1e-4, atol=1e-5)
    for name in ("router", "wi_gate", "wo"):
        np.testing.assert_allclose(np.asarray(_leaf(g_params, PATHS[name])[...]),
                                   np.asarray(g_ref_params[name]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh", [None, "ep8"])
def test_capacity_drops_overflow(setups, mesh):
    s = setups["mixtral"]
    cfg, factor = s["cfg"], 0.5
    part = None if mesh is None else Partitioner(make_mesh(expert=8), "fsdp")  # one group
    moe = build(cfg, part, s["values"], capacity_factor=factor)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    (_, (y, aux)), (g_params, g_x) = _loss_fn(graphdef, rest, s["ct"])(params, s["x"])
    _, indices, _ = moe.route(jnp.asarray(s["x"]))
    indices = np.asarray(indices).reshape(-1, cfg["num_experts_per_tok"])
    capacity = math.ceil(factor * B * L * cfg["num_experts_per_tok"] / E)
    keep = _capacity_keep(indices, capacity)
    expected_drop = 1 - keep.sum() / indices.size
    assert expected_drop > 0.1  # the case really drops
    np.testing.assert_allclose(float(aux["dropped_fraction"]), expected_drop, rtol=1e-6)

    _check_kept_copies_exact(s, keep, y, g_params, g_x)


def test_capacity_large_enough_is_dropless(setups):
    s = setups["deepseek"]
    part = Partitioner(make_mesh(fsdp=2, expert=4), "ep_as_cp")
    moe = build(s["cfg"], part, s["values"], s["bias"], capacity_factor=E / 3)  # C >= tokens
    y, aux = jax.jit(lambda m, x: m(x))(moe, s["x"])
    assert float(aux["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(np.asarray(y), s["y"], rtol=1e-5, atol=1e-5)


# -- all-to-all buffers -------------------------------------------------------------------------
def _a2a_keep(indices, num_local, capacity):
    """[T, E] 0/1 for one device's tokens: per destination device the first `capacity` copies
    in priority order (all first choices in token order, then all second choices, ...)."""
    T, k = indices.shape
    keep, used = np.zeros((T, E), np.float32), {}
    for j in range(k):
        for t in range(T):
            d = indices[t, j] // num_local
            if used.get(d, 0) < capacity:
                keep[t, indices[t, j]], used[d] = 1, used.get(d, 0) + 1
    return keep


@pytest.mark.parametrize("mesh, factor", [("ep8", 1.0)])
def test_all_to_all_buffer_overflow_is_counted_and_kept_copies_exact(setups, mesh, factor):
    s = setups["mixtral"]
    cfg, k = s["cfg"], s["cfg"]["num_experts_per_tok"]
    part = _mesh(mesh)
    moe = build(cfg, part, s["values"], dispatch="all_to_all", buffer_factor=factor)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    (_, (y, aux)), (g_params, g_x) = _loss_fn(graphdef, rest, s["ct"])(params, s["x"])
    _, indices, _ = moe.route(jnp.asarray(s["x"]))
    indices = np.asarray(indices)  # [B, L, k]
    # which tokens each device holds: ep8 -> batch row i on expert shard i; epcp_f2e4 ->
    # (batch half, sequence quarter) -- every device's tokens are one [b, l] block
    ep = part.size("experts", "moe")
    nb, nl = (8, 1) if mesh == "ep8" else (2, 4)
    bs, ls = B // nb, L // nl
    keep = np.zeros((B, L, E), np.float32)
    for bi in range(nb):
        for li in range(nl):
            blk = indices[bi * bs:(bi + 1) * bs, li * ls:(li + 1) * ls].reshape(-1, k)
            cap = a2a_capacity(bs * ls, k, E // ep, ep, factor)
            keep[bi * bs:(bi + 1) * bs, li * ls:(li + 1) * ls] = _a2a_keep(
                blk, E // ep, cap).reshape(bs, ls, E)
    dropped = indices.size - int(keep.sum())
    assert dropped > 0.05 * indices.size  # the case really drops
    assert int(aux["dropped_tokens"]) == dropped
    np.testing.assert_allclose(float(aux["dropped_fraction"]), dropped / indices.size)

    _check_kept_copies_exact(s, keep.reshape(-1, E), y, g_params, g_x)


@pytest.mark.parametrize("overflow", ["drop", "exact"])
def test_cuda_lowering_holds_ragged_all_to_all(setups, overflow):
    """`platform_dependent` picks the transport when lowering: ragged for cuda, a dense
    all-to-all for CPU -- so the program lowered here for cuda is the accelerator one (the
    exact rounds' loops included)."""
    s = setups["mixtral"]
    moe = build(s["cfg"], _mesh("epcp_f2e4"), s["values"], dispatch="all_to_all",
                buffer_factor=2.0 if overflow == "exact" else None, overflow=overflow)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    traced = _loss_fn(graphdef, rest, s["ct"]).trace(params, s["x"])
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("ragged_all_to_all") >= 4  # rows out and back, and their transposes
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "ragged_all_to_all" not in cpu and "all_to_all" in cpu


def _moe_temp_bytes(ep, dispatch, buffer_factor=None, overflow="drop"):
    """Per-device temporaries of a MoE forward+backward with 256 tokens per device."""
    part = Partitioner(make_mesh(expert=ep, fsdp=8 // ep), "fsdp")
    moe = MoE(num_experts=16, num_experts_per_tok=2, mlp_dim=128, inputs_shape=(8, 256, 64),
              partitioner=part, dispatch=dispatch, buffer_factor=buffer_factor,
              overflow=overflow, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x)[0] ** 2)
    x = jax.ShapeDtypeStruct((8, 256, 64), jnp.float32,
                             sharding=part.sharding(("batch", "length", "act_embed")))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temporaries_follow_local_work():
    base = _moe_temp_bytes(1, "auto")
    a2a = _moe_temp_bytes(8, "all_to_all", buffer_factor=2.0)
    gather = _moe_temp_bytes(8, "all_gather")
    assert a2a <= 1.8 * base, (a2a / base, gather / base)
    assert gather > 1.8 * base  # the bound separates the schemes: all_gather grows with EP


def test_exact_overflow_temporaries_stay_near_the_buffer_factors():
    """Rounds reuse the buffer-factor program's buffers: exact at factor 2 needs at most 1.5x
    the temporaries of drop at factor 2 (the [M, D] per-copy accumulators), well under the
    dropless buffers'."""
    drop = _moe_temp_bytes(8, "all_to_all", buffer_factor=2.0)
    exact = _moe_temp_bytes(8, "all_to_all", buffer_factor=2.0, overflow="exact")
    dropless = _moe_temp_bytes(8, "all_to_all")
    assert exact <= 1.5 * drop, (exact / drop, dropless / drop)
    assert exact < dropless, (exact / drop, dropless / drop)


# -- grouped matmul FLOPs ------------------------------------------------------------------------
def _dims(text):
    return [int(v) for v in text.split(",") if v]


def hlo_dot_flops(text: str) -> int:
    """Matmul FLOPs of a compiled HLO module, counting each `while` body times its
    ``known_trip_count`` (XLA's cost analysis counts it once) and a `conditional`'s costlier
    branch."""
    comps, shapes, entry, cur = {}, {}, None, None
    for line in text.splitlines():
        head = re.match(r"(ENTRY )?%(\S+) \((.*)\) -> .*\{$", line)
        if head:
            cur = head.group(2)
            comps[cur], shapes[cur] = [], {}
            entry = cur if head.group(1) else entry
            for name, dims in re.findall(r"([\w.\-]+): \w+\[([\d,]*)\]", head.group(3)):
                shapes[cur][name] = _dims(dims)
        elif cur is not None:
            inst = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]", line)
            if inst:
                shapes[cur][inst.group(1)] = _dims(inst.group(2))
            comps[cur].append(line)

    def flops(name):
        total = 0
        for line in comps.get(name, []):
            dot = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), ", line)
            loop = re.search(r" while\(.*body=%([\w.\-]+)", line)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if dot:
                lhs = shapes[name][dot.group(2)]
                contracting = _dims(re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)[1])
                total += 2 * math.prod(_dims(dot.group(1))) * math.prod(lhs[i] for i in contracting)
            elif loop:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                assert trip, f"while loop without a known trip count: {line[:200]}"
                total += int(trip[1]) * flops(loop.group(1))
            elif branches:
                total += max(flops(b.strip().lstrip("%")) for b in branches[1].split(","))
            else:
                total += sum(flops(c) for c in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line))
        return total
    return flops(entry)


def test_blocked_grouped_matmul_flops_near_useful():
    """E=64, k=4, T=2048, D=256, F=512: HLO matmul FLOPs (loops times trip counts) within 1.3x
    of the useful 3 matmuls per copy, forward and forward+backward; ragged_dot on XLA:CPU
    would be E times."""
    num_e, k, tokens, d, f = 64, 4, 2048, 256, 512
    rows = tokens * k
    sizes = np.bincount(np.random.default_rng(0).integers(0, num_e, rows), minlength=num_e)
    args = (jax.ShapeDtypeStruct((rows, d), jnp.float32),
            *(jax.ShapeDtypeStruct((num_e, d, f), jnp.float32) for _ in range(2)),
            jax.ShapeDtypeStruct((num_e, f, d), jnp.float32))
    fwd = lambda x, wg, wu, wo: grouped.grouped_swiglu(x, wg, wu, wo, jnp.asarray(sizes, jnp.int32),
                                                       "blocked")
    useful = 3 * 2 * rows * d * f
    forward = hlo_dot_flops(jax.jit(fwd).lower(*args).compile().as_text())
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fwd(*a) ** 2), argnums=(0, 1, 2, 3)))
    both = hlo_dot_flops(grad.lower(*args).compile().as_text())
    assert useful <= forward <= 1.3 * useful, forward / useful
    assert 3 * useful <= both <= 1.3 * 3 * useful, both / useful


# -- aux-loss-free balancing -----------------------------------------------------------------
def test_bias_update_balances_skewed_routing():
    cfg = dict(num_experts=E, num_experts_per_tok=2, mlp_dim=F, scoring="sigmoid")
    moe = MoE(inputs_shape=(B, L, D), partitioner=None, rngs=nnx.Rngs(1), **cfg)
    rng = np.random.default_rng(1)
    u = rng.normal(size=D).astype(np.float32)
    router = np.array(moe.router[...])
    router[:, :2] += 2 * u[:, None] / (u @ u)  # experts 0 and 1 love the shared direction
    moe.router[...] = router
    x = rng.normal(size=(B, L, D)).astype(np.float32) * 0.3 + u
    counts_fn = jax.jit(lambda m, x: m(x)[1]["expert_counts"])
    spread = []
    for _ in range(60):
        counts = counts_fn(moe, x)
        spread.append(int(counts.max() - counts.min()))
        update_expert_bias(moe, counts, rate=0.02)
    assert spread[0] >= 60, spread[0]  # skewed to begin with
    assert np.mean(spread[-10:]) < 0.3 * spread[0], spread
    assert isinstance(moe.e_score_correction_bias, RouterBias)
    assert not isinstance(moe.e_score_correction_bias, nnx.Param)
    assert np.asarray(moe.e_score_correction_bias[...])[:2].max() < 0  # the loved ones pay


def test_bias_update_walks_a_model():
    class Model(nnx.Module):
        def __init__(self):
            kw = dict(num_experts=4, num_experts_per_tok=2, mlp_dim=4, inputs_shape=(2, 2, 8),
                      partitioner=None, rngs=nnx.Rngs(0))
            self.layers = nnx.List([MoE(scoring="sigmoid", **kw), MoE(scoring="softmax", **kw),
                                    MoE(scoring="sigmoid", **kw)])

    model = Model()
    layers = moe_modules(model)
    assert layers == [model.layers[0], model.layers[2]]  # softmax routers have no bias
    assert len(moe_modules(model, with_bias=False)) == 3
    counts = np.array([[4, 0, 2, 2], [1, 1, 5, 1]])
    update_expert_bias(model, [{"expert_counts": counts[0]}, {"expert_counts": counts[1]}], 0.1)
    update_expert_bias(model, counts, rate=0.1)  # stacked rows work the same
    # one row per MoE layer (the trainer's [num_moe_layers, E]): the softmax row is skipped
    all_rows = np.stack([counts[0], np.array([9, 0, 0, 0]), counts[1]])
    def step(m, c):  # as in a jitted train step that returns the model
        update_expert_bias(m, c, 0.1)
        return m
    model = jax.jit(step)(model, jnp.asarray(all_rows))
    layers = moe_modules(model)
    np.testing.assert_allclose(np.asarray(layers[0].e_score_correction_bias[...]),
                               [-0.3, 0.3, 0, 0], atol=1e-7)
    np.testing.assert_allclose(np.asarray(layers[1].e_score_correction_bias[...]),
                               [0.3, 0.3, -0.3, 0.3], atol=1e-7)
    with pytest.raises(ValueError, match="counts for 1 layer"):
        update_expert_bias(model, counts[0])
    with pytest.raises(ValueError, match="no MoE layer with scoring='sigmoid'"):
        update_expert_bias(model.layers[1], counts[0])


# -- construction errors -----------------------------------------------------------------------
def test_buffer_factor_ignored_by_auto_warns():
    """"auto" resolving to all_gather (expert shards 2 <= k) keeps no receive buffers, so a
    buffer_factor does nothing: a warning names it and the fix; all_to_all takes it quietly."""
    args = dict(num_experts=E, num_experts_per_tok=2, mlp_dim=F, inputs_shape=(B, L, D),
                buffer_factor=2.0, rngs=nnx.Rngs(0))
    part = Partitioner(make_mesh(fsdp=4, expert=2), "fsdp")
    with pytest.warns(UserWarning, match=r"buffer_factor=2.0 has no effect, dispatch='auto' "
                                         r"resolved to 'all_gather'.*dispatch='all_to_all'"):
        assert MoE(partitioner=part, **args).dispatch == "all_gather"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MoE(partitioner=part, dispatch="all_to_all", **args).dispatch == "all_to_all"
        # exact overflow (the full-size presets' setting): all_gather drops nothing either
        assert MoE(partitioner=part, overflow="exact", **args).dispatch == "all_gather"


def test_auto_overflow_rule():
    """overflow="auto": drop with a buffer_factor; dropless, rounds of 1.25x the balanced share
    where those buffers are under half the worst case's (EP 4, k 2, E_local 2: 5 rows per peer
    against 16) and the experts allow rounds, else the one round of worst-case buffers."""
    args = dict(num_experts=E, num_experts_per_tok=2, mlp_dim=F, inputs_shape=(B, L, D),
                rngs=nnx.Rngs(0))
    ep4 = Partitioner(make_mesh(fsdp=2, expert=4), "ep_as_cp")
    args["overflow"] = "auto"  # the default, stated
    m = MoE(partitioner=ep4, **args)
    assert (m.dispatch, m.overflow, m.exchange_buffer_factor) == ("all_to_all", "exact", 1.25)
    assert a2a_capacity(8, 2, 2, 4, 1.25) == 5 and a2a_capacity(8, 2, 2, 4, None) == 16
    # a buffer factor: drop (as before "auto" existed)
    m = MoE(partitioner=ep4, buffer_factor=2.0, **args)
    assert (m.overflow, m.exchange_buffer_factor) == ("drop", 2.0)
    # the experts rounds cannot run: gpt-oss's biases, the clamped activation
    for kw in (dict(expert_bias=True), dict(activation=grouped.GLU(alpha=1.702, limit=7.0))):
        assert MoE(partitioner=ep4, **args, **kw).overflow == "drop"
    # top-1 on EP 2: worst case 8 rows per peer, rounds 5 -- not under half, one round
    m = MoE(partitioner=Partitioner(make_mesh(fsdp=4, expert=2), "ep_as_cp"),
            **{**args, "num_experts_per_tok": 1}, dispatch="all_to_all")
    assert (m.overflow, m.exchange_buffer_factor) == ("drop", None)
    # all_gather and unsharded keep no buffers
    assert MoE(partitioner=None, **args).overflow == "drop"
    # explicit choices stay as given
    assert MoE(partitioner=ep4, **{**args, "overflow": "drop"}).overflow == "drop"


@pytest.mark.parametrize("kw, mesh, match", [
    (dict(num_experts=6), ("fsdp", dict(fsdp=2, expert=4)),
     r"num_experts=6 .* divisible by its 4 shards"),
    (dict(num_experts_per_tok=9), None, r"num_experts_per_tok=9 must be between 1 and"),
    (dict(scoring="sigmoid", n_group=3), None, r"num_experts=8 is not divisible by n_group=3"),
    (dict(scoring="sigmoid", n_group=4, topk_group=5), None, r"topk_group=5 must be"),
    (dict(scoring="sigmoid", n_group=4, topk_group=1, num_experts_per_tok=3), None,
     r"num_experts_per_tok=3 exceeds the 2 experts"),
    (dict(scoring="relu"), None, r"scoring='relu'"),
    (dict(capacity_factor=0.0), None, r"capacity_factor=0.0 must be > 0"),
    (dict(dispatch="ragged"), None, r"dispatch='ragged' must be one of"),
    (dict(grouped_matmul="cutlass"), None, r"grouped_matmul='cutlass' must be one of"),
    (dict(buffer_factor=0.0), None, r"buffer_factor=0.0 must be > 0"),
    (dict(buffer_factor=2.0, dispatch="all_gather"), None, r"dispatch='all_gather' has none"),
    (dict(capacity_factor=1.0, dispatch="all_to_all"), None, r"bound the buffers with buffer_f"),
    (dict(inputs_shape=(8, 6, 16)), ("cp", dict(context=4, expert=2)),
     r"length=6 is not divisible by its 4 shards"),
    (dict(inputs_shape=(4, 8, 16)), ("fsdp", dict(fsdp=8)),
     r"batch=4 is not divisible by its 8 shards"),
    (dict(inputs_shape=(8, 8, 12)), ("fsdp", dict(fsdp=8)),
     r"embed=12 is not divisible by its 8 shards"),
    (dict(mlp_dim=3), ("fsdp", dict(fsdp=4, tensor=2)),
     r"mlp_dim=3 is not divisible by its 2 shards"),
])
def test_construction_errors(kw, mesh, match):
    args = dict(num_experts=E, num_experts_per_tok=2, mlp_dim=F, inputs_shape=(B, L, D))
    part = None if mesh is None else Partitioner(make_mesh(**mesh[1]), mesh[0])
    with pytest.raises(ValueError, match=match):
        MoE(partitioner=part, rngs=nnx.Rngs(0), **{**args, **kw})


# -- exact overflow: all_to_all in rounds --------------------------------------------------------

def _exact_case(s, mesh, factor, values):
    """The exact-overflow layer against the dense reference (nothing masked): output, expert
    counts, input and parameter gradients; returns its aux."""
    part = _mesh(mesh)
    moe = build(s["cfg"], part, values, s["bias"], dispatch="all_to_all", buffer_factor=factor,
                overflow="exact")
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    (_, (y, aux)), (g_params, g_x) = _loss_fn(graphdef, rest, s["ct"])(params, s["x"])

    def ref_loss(params, x):
        y, lb, counts = reference(params, x, s["cfg"], s["bias"])
        return jnp.sum(y * s["ct"]) + 0.3 * lb, (y, counts)
    (_, (y_ref, counts)), (g_ref, g_ref_x) = jax.jit(jax.value_and_grad(
        ref_loss, (0, 1), has_aux=True))({n: jnp.asarray(v) for n, v in values.items()},
                                         jnp.asarray(s["x"]))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), np.asarray(counts))
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_ref_x), rtol=1e-4, atol=1e-5)
    for name in values:
        np.testing.assert_allclose(np.asarray(_leaf(g_params, PATHS[name])[...]),
                                   np.asarray(g_ref[name]), rtol=1e-4, atol=1e-5, err_msg=name)
    assert int(aux["dropped_tokens"]) == 0
    return aux


@pytest.mark.parametrize("config, mesh, factor", [("mixtral", "ep8", 1.0),
                                                  ("deepseek", "epcp_f2e2c2", 0.5),
                                                  ("mixtral", "fsdp_f2e2t2", 0.5)])
def test_exact_overflow_equals_dense_reference(setups, config, mesh, factor):
    """Buffers that drop copies under overflow='drop' (test above) lose none with 'exact':
    the overflow runs in further rounds and the layer equals the dense reference."""
    s = setups[config]
    aux = _exact_case(s, mesh, factor, s["values"])
    assert int(aux["moe_rounds"]) >= 2  # the overflow really took further rounds


def test_exact_overflow_with_every_token_on_the_same_experts(setups):
    """A zero router ties every expert: every token picks experts 0 and 1 (one device each on
    ep8), the worst imbalance; with buffers of the balanced share the exchange needs one round
    per share of the 8 devices' copies, and stays exact."""
    s = setups["mixtral"]
    values = dict(s["values"], router=np.zeros_like(s["values"]["router"]))
    aux = _exact_case(s, "ep8", 1.0, values)
    # each device sends all its T copies of choice j to device j: T / (T * k / EP) = 4 rounds
    assert int(aux["moe_rounds"]) == 4


@pytest.mark.slow
def test_exact_overflow_loads_the_drop_layers_weights(setups):
    """overflow='exact' adds no state: its parameters and variables are the drop layer's."""
    s = setups["deepseek"]
    part = _mesh("epcp_f2e4")
    kw = dict(dispatch="all_to_all", buffer_factor=2.0)
    drop, exact = (build(s["cfg"], part, **kw, overflow=o) for o in ("drop", "exact"))
    shapes = lambda m: jax.tree.map(lambda v: v.shape, nnx.state(m))
    assert shapes(drop) == shapes(exact)
    nnx.update(exact, nnx.state(drop))  # loads by path
    x = jnp.asarray(s["x"])
    y_drop, aux_drop = drop(x)
    y_exact, aux_exact = exact(x)
    if int(aux_drop["dropped_tokens"]) == 0:  # nothing overflowed: the same numbers
        np.testing.assert_allclose(np.asarray(y_exact), np.asarray(y_drop), rtol=1e-6, atol=1e-6)
        assert int(aux_exact["moe_rounds"]) == 1
    with pytest.raises(ValueError, match="overflow='exact' runs all_to_all in rounds"):
        build(s["cfg"], part, dispatch="all_gather", overflow="exact")
    with pytest.raises(ValueError, match="overflow='spill' must be one of"):
        build(s["cfg"], part, dispatch="all_to_all", overflow="spill")


# gpt-oss's options: router bias, expert biases, the clamped GLU, gate/up interleaved in one
# weight (the unsharded layer is checked against transformers in the conformance suite)
OSS = dict(num_experts=E, num_experts_per_tok=2, mlp_dim=F, scoring="softmax",
           router_bias=True, expert_bias=True, gate_up="interleaved",
           activation=grouped.GLU(alpha=1.702, limit=0.5, up_offset=1.0))


@pytest.fixture(scope="module")
def oss_reference():
    """The unsharded gpt-oss-style layer with random biases, its output and gradients."""
    rng = np.random.default_rng(3)
    moe = MoE(inputs_shape=(B, L, D), partitioner=None, rngs=nnx.Rngs(1), **OSS)
    for name in ("router_bias", "wi_gate_up_bias", "wo_bias"):
        var = getattr(moe, name)
        var[...] = jnp.asarray(rng.normal(size=var[...].shape).astype(np.float32) * 0.5)
    x = rng.normal(size=(B, L, D)).astype(np.float32)
    ct = rng.normal(size=(B, L, D)).astype(np.float32)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    (_, (y, _)), grads = _loss_fn(graphdef, rest, ct)(params, x)
    values = {"/".join(map(str, p)): np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(params)}
    return values, x, ct, np.asarray(y), grads


@pytest.mark.parametrize("mesh, dispatch, impl", [
    (None, "all_gather", "ragged_dot"), ("fsdp_f2e2t2", "all_gather", "auto"),
    ("epcp_f2e4", "all_to_all", "auto"), ("ep8", "all_to_all", "ragged_dot"),
    ("cp_c4e2", "all_gather", "auto")])
def test_gpt_oss_options_under_every_dispatch(oss_reference, mesh, dispatch, impl):
    """Biases, clamp and interleaved weights are exact under expert, tensor and FSDP sharding
    and every grouped matmul (output and every gradient against the unsharded layer)."""
    values, x, ct, y_ref, g_ref = oss_reference
    moe = MoE(inputs_shape=(B, L, D), partitioner=_mesh(mesh), rngs=nnx.Rngs(1),
              dispatch=dispatch, grouped_matmul=impl, **OSS)
    for path, var in nnx.to_flat_state(nnx.state(moe, nnx.Param)):
        var.set_value(jax.device_put(values["/".join(map(str, path))], var.get_value().sharding))
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    (_, (y, _)), (g, g_x) = _loss_fn(graphdef, rest, ct)(params, x)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_ref[1]), rtol=1e-4, atol=1e-5)
    want = dict(nnx.to_flat_state(g_ref[0]))
    for path, var in nnx.to_flat_state(g):
        np.testing.assert_allclose(np.asarray(var.get_value()), np.asarray(want[path].get_value()),
                                   rtol=1e-4, atol=1e-5, err_msg=str(path))
    assert float(jnp.abs(want[("wi_gate_up_bias",)].get_value()).max()) > 0


def test_glu_clamps_as_gpt_oss():
    act = grouped.GLU(alpha=1.702, limit=7.0, up_offset=1.0)
    gate, up = jnp.asarray([-9.0, 0.5, 9.0]), jnp.asarray([-9.0, 0.5, 9.0])
    g = np.minimum(np.asarray(gate), 7.0)
    want = g / (1 + np.exp(-1.702 * g)) * (np.clip(np.asarray(up), -7, 7) + 1)
    np.testing.assert_allclose(np.asarray(act(gate, up)), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grouped.GLU()(gate, up)),
                                  np.asarray(jax.nn.silu(gate) * up))


def test_grouped_matmul_traced_for_a_target_device_is_exact(devices):
    """`zoo.ops.grouped.tokamax_dot` with a static target ``device``: tokamax's grouped matmul
    traced with that device as the default (what a GPU/TPU mesh compiled on a CPU host gets)
    has its own backward; values and both gradients equal `jax.lax.ragged_dot`'s, plain and
    inside a shard_map (where the kernel's outputs are marked as varying like its inputs)."""
    from jax.sharding import PartitionSpec as P
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (48, 8))  # two shards of 24 rows
    w = jax.random.normal(kw, (3, 8, 5))
    gs = jnp.array([7, 0, 13], jnp.int32)  # 20 of a shard's 24 rows in groups
    g = jax.random.normal(kg, (48, 5)) * (jnp.arange(48) % 24 < 20)[:, None]

    def target(x, w, gs):
        return grouped.tokamax_dot(x, w, gs, device=devices[0])

    def grads(dot, x, w, g):
        return jax.value_and_grad(lambda x, w: jnp.sum(dot(x, w, gs) * g), (0, 1))(x, w)

    halves = [grads(jax.lax.ragged_dot, x[i:i + 24], w, g[i:i + 24]) for i in (0, 24)]
    got = [jax.jit(grads, static_argnums=0)(target, x[i:i + 24], w, g[i:i + 24])
           for i in (0, 24)]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(halves)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    mesh = make_mesh(fsdp=2, devices=devices[:2])
    runs = {}
    for w_spec in (P(), P("fsdp")):  # the weights replicated (invariant) or varying per shard
        ws = w if w_spec == P() else jnp.concatenate([w, w])
        runs[w_spec] = {dot: jax.jit(jax.shard_map(
            lambda x, w, g, dot=dot: grads(dot, x, w, g)[1], mesh=mesh,
            in_specs=(P("fsdp"), w_spec, P("fsdp")), out_specs=(P("fsdp"), w_spec)))(x, ws, g)
            for dot in (target, jax.lax.ragged_dot)}
        for a, b in zip(runs[w_spec][target], runs[w_spec][jax.lax.ragged_dot]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    dx, dw = runs[P()][target]
    np.testing.assert_allclose(dx, jnp.concatenate([h[1][0] for h in halves]), rtol=1e-5,
                               atol=1e-5)
    # replicated weights: their gradient is the sum over the shards
    np.testing.assert_allclose(dw, halves[0][1][1] + halves[1][1][1], rtol=1e-5, atol=1e-5)


def _ragged_all_to_all_by_gathers(operand, output, input_offsets, send_sizes, output_offsets,
                                  recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics from all-gathers and a scatter (XLA:CPU has no
    ragged all-to-all): sender j's rows ``input_offsets[p] ..`` (``send_sizes[p]`` of them)
    land on peer p at ``output_offsets[p] ..``."""
    me = jax.lax.axis_index(axis_name)
    rows, offs, sizes, dests = (jax.lax.all_gather(v, axis_name) for v in
                                (operand, input_offsets, send_sizes, output_offsets))
    r = jnp.arange(operand.shape[0])
    for j in range(rows.shape[0]):
        src = rows[j][jnp.clip(offs[j, me] + r, 0, operand.shape[0] - 1)]
        at = jnp.where(r < sizes[j, me], dests[j, me] + r, output.shape[0])  # else dropped
        output = output.at[at].set(src.astype(output.dtype), mode="drop")
    return output


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_ragged_transport_equals_the_padded_one(impl, monkeypatch):
    """The accelerator transport of `all_to_all_experts` (ragged all-to-all of only the rows
    that fit, grouped by expert on the way, placed by the receiver from per-expert counts)
    gives the CPU transport's outputs, dropped counts and gradients, with a buffer small
    enough to drop copies -- checked on CPU against an all-gather form of the collective."""
    n, T, k, num_local, d, f = 8, 16, 2, 2, 8, 4
    keys = jax.random.split(jax.random.key(3), 6)
    # skewed routing: experts 0..3 popular, so peers 0 and 1 overflow their buffers
    logits = jax.random.normal(keys[0], (n * T, n * num_local)) + 3.0 * (jnp.arange(
        n * num_local) < 4)
    indices = jax.lax.top_k(logits, k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[1], (n * T, k)), -1)
    x = jax.random.normal(keys[2], (n * T, d))
    wg, wu = (0.3 * jax.random.normal(kk, (n * num_local, d, f)) for kk in keys[3:5])
    wo = 0.3 * jax.random.normal(keys[5], (n * num_local, f, d))
    mesh = make_mesh(expert=n)
    cap = a2a_capacity(T, k, num_local, n, 0.75)
    P = jax.sharding.PartitionSpec

    def run(transport):
        def local(x, indices, weights, wg, wu, wo):
            y, dropped = ops.all_to_all_experts(
                x, indices, weights, wg, wu, wo, axis_name="expert", num_shards=n,
                capacity=cap, impl=impl, transport=transport)
            return y, jax.lax.psum(dropped, "expert")
        fn = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"),) * 6,
                           out_specs=(P("expert"), P()))
        loss = lambda x, w, g, u, o: jnp.sum(fn(x, indices, w, g, u, o)[0] ** 2)
        y, dropped = jax.jit(fn)(x, indices, weights, wg, wu, wo)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weights, wg, wu, wo)
        return y, dropped, grads

    y_pad, dropped_pad, g_pad = run("padded")
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gathers)
    y_rag, dropped_rag, g_rag = run("ragged")
    assert int(dropped_pad) == int(dropped_rag) > 0
    np.testing.assert_allclose(y_rag, y_pad, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_rag, g_pad):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
