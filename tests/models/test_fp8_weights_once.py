"""FP8 weight copies made once per step (`zoo.layers.linear.prequantized_weights`, entered by
`zoo.train.step.loss_fn`): the full train step's program quantises each FP8 weight parameter
once -- one 128x128-block amax reduction per parameter, scanned or not, rematerialised or not
-- and its numerics are those of quantising where each product uses the weight."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import weight_block_amaxes

import zoo.train.step as step_module
from zoo.layers.linear import Linear
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
from zoo.train.step import loss_fn, make_train_step, make_tx

B, L, V = 2, 16, 64
BASE = DeepSeek3Config.mini(vocab_size=V, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, n_routed_experts=8, n_group=2, topk_group=1,
                            num_experts_per_tok=2, fp8="blockwise")
BATCH = dict(inputs=jnp.arange(B * L, dtype=jnp.int32).reshape(B, L) % V,
             targets=(jnp.arange(B * L, dtype=jnp.int32).reshape(B, L) * 7 + 3) % V,
             positions=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
             segment_ids=jnp.ones((B, L), jnp.int32), loss_weights=jnp.ones((B, L)))


def fp8_kernels(model) -> int:
    """FP8 weight parameters: one kernel per FP8 `Linear` (a stack's holds all its layers)."""
    return sum(isinstance(m, Linear) and m.fp8 == "blockwise" for _, m in nnx.iter_modules(model))


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("remat", [None, "full"])
def test_train_step_quantizes_each_fp8_weight_once(scan, remat):
    # dense layers only: every FP8 weight is a Linear kernel (MLA's projections and latent
    # expansion, the dense MLP); the routed experts' copies: tests/layers/test_fp8_moe_once.py
    cfg = dataclasses.replace(BASE, first_k_dense_replace=BASE.num_hidden_layers,
                              scan_layers=scan, remat_policy=remat)
    model = DeepSeek3(cfg, inputs_shape=(B, L), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    step = make_train_step()
    jaxpr = jax.make_jaxpr(lambda m, o, b: step(m, o, b, 1e-3))(model, optimizer, BATCH).jaxpr
    params = fp8_kernels(model)
    assert params == (5 + 3) * (1 if scan else cfg.num_hidden_layers)
    assert weight_block_amaxes(jaxpr) == params
    assert not any(hasattr(m, "fp8_copies") for _, m in nnx.iter_modules(model))
    if scan and remat == "full":  # the count can fail: quantising per use makes more
        per_use = jax.make_jaxpr(nnx.grad(lambda m: jnp.sum(m(BATCH["inputs"])[0])))(model)
        assert weight_block_amaxes(per_use.jaxpr) > 2 * params


@pytest.mark.slow  # ~20 s: two compiles of the rematerialised MoE model's gradient
def test_prequantized_step_equals_per_use_quantization(monkeypatch):
    """The scanned, rematerialised DeepSeek-V3 mini (MLA, dense MLP, MoE with shared experts):
    objective, FP8 statistics and gradients with the copies made once equal those of
    quantising at each use."""
    cfg = dataclasses.replace(BASE, first_k_dense_replace=1, remat_policy="full")
    model = DeepSeek3(cfg, inputs_shape=(B, L), rngs=nnx.Rngs(1))

    @jax.jit
    def run(model):
        grad = nnx.value_and_grad(lambda m: loss_fn(m, BATCH), has_aux=True)
        (objective, (_, _, aux)), grads = grad(model)
        return objective, aux["fp8_stats"], grads

    objective, stats, grads = run(model)
    monkeypatch.setattr(step_module, "prequantized_weights", contextlib.nullcontext)
    ref_objective, ref_stats, ref_grads = run(model)
    np.testing.assert_allclose(float(objective), float(ref_objective), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats), np.asarray(ref_stats))
    leaves, ref_leaves = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(leaves) == len(ref_leaves)
    for g, r in zip(leaves, ref_leaves):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0,
                                   atol=1e-5 * max(float(jnp.abs(r).max()), 1e-30))
