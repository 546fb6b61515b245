"""The MoE's routed expert weights quantised once per step (`zoo.layers.MoE.fp8_weights`, made
by `zoo.layers.linear.prequantized_weights`): under expert, FSDP and tensor sharding, for both
dispatches and the exact rounds, the layer's outputs and gradients with the copies equal
those of quantising at each use, and the program quantises each expert weight once -- where
quantising per use does it in every grouped matmul, its backward and the statistics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import weight_block_amaxes

from zoo.layers import MoE
from zoo.layers.linear import Linear, prequantized_weights
from zoo.partitioning import Partitioner, make_mesh


def moe(embed, mlp_dim, partitioner, **kw):
    return MoE(num_experts=8, num_experts_per_tok=2, mlp_dim=mlp_dim, inputs_shape=(4, 16, embed),
               partitioner=partitioner, fp8="blockwise", rngs=nnx.Rngs(0), **kw)


def grad_fn(layer, prequantize: bool):
    """``x -> ((loss, y), (param grads, dx))`` of the layer, with the FP8 copies made inside
    the differentiated function (as `zoo.train.step.loss_fn` makes them) or not at all."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        model = nnx.merge(graphdef, params, rest)
        if prequantize:
            with prequantized_weights(model):
                y, _ = model(x)
        else:
            y, _ = model(x)
        return jnp.sum(y * jnp.cos(y)), y
    return params, jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


# mesh (fsdp, expert, tensor), embed: FSDP shards of 64 rows (the copies' scales cross whole
# along embed and the shards gather the float8 values) or of 128 (the scales cross sharded
# and are gathered too); tensor shards of the expert width hold whole 128-column blocks
CASES = [
    pytest.param(dict(dispatch="all_gather"), 128, id="all_gather"),
    pytest.param(dict(dispatch="all_to_all", overflow="drop"), 256, id="all_to_all"),
    pytest.param(dict(dispatch="all_to_all", overflow="exact", buffer_factor=1.0), 256,
                 id="exact_rounds"),
]


@pytest.mark.slow  # 11-27 s each on a loaded 2-core box: two compiles of the gradient
@pytest.mark.parametrize("kw, embed", CASES)
def test_moe_takes_its_fp8_copies_on_a_mesh(devices, kw, embed):
    p = Partitioner(make_mesh(fsdp=2, expert=2, tensor=2), "ep_as_cp")
    layer = moe(embed, 256, p, **kw)
    assert layer.dispatch == kw["dispatch"]
    assert layer.overflow == kw.get("overflow", layer.overflow)
    copies = layer.fp8_weights()
    assert sorted(copies) == ["wi_gate", "wi_up", "wo"]
    assert copies["wo"].q.shape == (8, 256, embed) and copies["wo"].q.dtype == jnp.float8_e4m3fn
    x = jax.random.normal(jax.random.key(1), layer.inputs_shape, jnp.float32)

    params, grad = grad_fn(layer, True)
    _, grad_ref = grad_fn(layer, False)
    # the copies are the program's only quantisations of the expert weights: once each
    assert weight_block_amaxes(jax.make_jaxpr(grad)(params, x).jaxpr) == 3
    assert weight_block_amaxes(jax.make_jaxpr(grad_ref)(params, x).jaxpr) >= 6
    (_, y), (g, dx) = jax.jit(grad)(params, x)
    (_, y_ref), (g_ref, dx_ref) = jax.jit(grad_ref)(params, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=0,
                               atol=1e-6 * float(jnp.abs(y_ref).max()))
    leaves, ref_leaves = jax.tree.leaves((g, dx)), jax.tree.leaves((g_ref, dx_ref))
    assert len(leaves) == len(ref_leaves) == 5  # router, gate, up and down weights; x
    for a, b in zip(leaves, ref_leaves):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=1e-6 * max(float(jnp.abs(b).max()), 1e-30))
    assert float(jnp.abs(g["wo"][...]).max()) > 0


def test_copies_fall_back_where_a_tensor_shard_cuts_a_block(devices):
    """A tensor shard of 64 expert columns would cut the whole weight's 128-column blocks,
    which each shard's product quantises as its own: no copies (per-shard quantisation)."""
    p = Partitioner(make_mesh(fsdp=2, expert=2, tensor=2), "ep_as_cp")
    assert not moe(128, 128, p, dispatch="all_gather").fp8_weights()
    assert moe(128, 256, p, dispatch="all_gather").fp8_copies_cross()
    # no FP8, a capacity (its batched matmul is not FP8), a compute dtype left to the input
    assert not MoE(num_experts=8, num_experts_per_tok=2, mlp_dim=256, inputs_shape=(4, 16, 128),
                   partitioner=None, rngs=nnx.Rngs(0)).fp8_weights()
    assert not moe(128, 256, None, capacity_factor=2.0).fp8_weights()
    assert not moe(128, 256, None, dtype=None).fp8_weights()
    from zoo.ops import fp8, grouped
    copy = fp8.prequantize(jnp.ones((2, 128, 128)))
    with pytest.raises(ValueError, match="only impl='fp8_blockwise' takes"):
        grouped.grouped_swiglu(jnp.ones((4, 128)), copy, copy, copy, jnp.array([2, 2]),
                               "blocked")


@pytest.mark.slow  # 10-12 s on a loaded 2-core box: two compiles of the gradient
def test_unsharded_interleaved_moe_takes_gate_and_up_copies_apart():
    """gpt-oss's fused ``wi_gate_up`` (gate in the even columns, biases, clamped SwiGLU): the
    copies hold its gate and up columns apart; outputs and gradients equal per-use ones."""
    from zoo.ops.grouped import GLU
    layer = moe(128, 128, None, gate_up="interleaved", expert_bias=True,
                activation=GLU(alpha=1.702, limit=7.0, up_offset=1.0))
    copies = layer.fp8_weights()
    np.testing.assert_array_equal(np.asarray(copies["wi_up"].w),
                                  np.asarray(layer.wi_gate_up[...][..., 1::2]))
    x = jax.random.normal(jax.random.key(2), layer.inputs_shape, jnp.float32)
    params, grad = grad_fn(layer, True)
    _, grad_ref = grad_fn(layer, False)
    assert weight_block_amaxes(jax.make_jaxpr(grad)(params, x).jaxpr) == 3
    got, ref = jax.jit(grad)(params, x), jax.jit(grad_ref)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                   atol=1e-6 * max(float(jnp.abs(b).max()), 1e-30))


@pytest.mark.parametrize("scan, remat", [
    pytest.param(True, "full", marks=pytest.mark.slow),  # 15-23 s: traces two gradients
    (False, None)])
def test_train_step_quantizes_each_expert_weight_once(scan, remat):
    """DeepSeek-V3 mini's full train step (MLA, dense MLP, MoE with shared experts): one
    128x128-block amax reduction per FP8 weight parameter -- each `Linear` kernel and each
    MoE's gate, up and down weights (a scanned stack's for all its layers) -- where the
    rematerialised per-use program quantises far more."""
    from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
    from zoo.train.step import make_train_step, make_tx
    B, L, V = 2, 16, 64
    cfg = DeepSeek3Config.mini(vocab_size=V, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, n_routed_experts=8, n_group=2, topk_group=1,
                               num_experts_per_tok=2, fp8="blockwise", first_k_dense_replace=1)
    cfg = dataclasses.replace(cfg, scan_layers=scan, remat_policy=remat)
    model = DeepSeek3(cfg, inputs_shape=(B, L), rngs=nnx.Rngs(0))
    tokens = jnp.arange(B * L, dtype=jnp.int32).reshape(B, L) % V
    batch = dict(inputs=tokens, targets=(tokens * 7 + 3) % V,
                 positions=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
                 segment_ids=jnp.ones((B, L), jnp.int32), loss_weights=jnp.ones((B, L)))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    step = make_train_step()
    jaxpr = jax.make_jaxpr(lambda m, o, b: step(m, o, b, 1e-3))(model, optimizer, batch).jaxpr
    modules = [m for _, m in nnx.iter_modules(model)]
    kernels = sum(isinstance(m, Linear) and m.fp8 == "blockwise" for m in modules)
    moes = [m for m in modules if isinstance(m, MoE)]
    assert len(moes) == 1 and moes[0].fp8_weights()
    assert weight_block_amaxes(jaxpr) == kernels + 3 * len(moes)
    assert not any(hasattr(m, "fp8_copies") for m in modules)
    if scan:  # the count can fail: quantising per use makes more
        per_use = jax.make_jaxpr(nnx.grad(lambda m: jnp.sum(m(batch["inputs"])[0])))(model)
        assert weight_block_amaxes(per_use.jaxpr) > 2 * (kernels + 3 * len(moes))
