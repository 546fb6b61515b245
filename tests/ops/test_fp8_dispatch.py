"""FP8 tokens on the MoE's all_to_all wire (`zoo.ops.moe_execution.MoEExecution.fp8_dispatch`).

* Bytes: the program's own collectives (the HLO JAX hands XLA, before XLA:CPU widens bfloat16
  collectives to float32) -- the dispatch all-to-all carries ``D + 4 * D/128`` bytes a row
  (FP8 values and float32 tile scales) against ``2 * D`` in bfloat16; the gradient comes back
  in bfloat16 and the combine is unchanged.
* Numerics: the sharded layer's outputs equal the unsharded FP8 layer's (the receiver's
  grouped matmul takes the tiles that crossed the wire, the very ones the unsharded layer
  makes); gradients finite and within FP8's error.
* Construction: the choice is validated where the layer is built.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zoo.layers import MoE
from zoo.ops import hlo
from zoo.partitioning import Partitioner, make_mesh

D = 256  # two 128-wide tiles a row
SHAPE = (4, 32, D)


def moe(partitioner, dtype=jnp.float32, **kw):
    return MoE(num_experts=8, num_experts_per_tok=2, mlp_dim=48, inputs_shape=SHAPE,
               partitioner=partitioner, fp8="blockwise", dtype=dtype, rngs=nnx.Rngs(0), **kw)


def functions(layer):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def forward(params, x):
        return nnx.merge(graphdef, params, rest)(x)[0]

    def loss(params, x):
        y = forward(params, x).astype(jnp.float32)
        return jnp.sum(y * jnp.cos(y)), y
    return params, forward, jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def ep_as_cp():
    return Partitioner(make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_fp8_dispatch_halves_the_wire(devices):
    x = jax.random.normal(jax.random.key(0), SHAPE, jnp.bfloat16)
    wire = {}
    for fp8_dispatch in (None, False):
        layer = moe(ep_as_cp(), jnp.bfloat16, dispatch="all_to_all", overflow="drop",
                    fp8_dispatch=fp8_dispatch)
        assert layer.execution.fp8_dispatch is (fp8_dispatch is None)
        assert layer.execution.as_dict()["fp8_dispatch"] is (fp8_dispatch is None)
        params, forward, grad = functions(layer)
        text = {name: jax.jit(f).lower(params, x).as_text(dialect="hlo", debug_info=True)
                for name, f in (("forward", forward), ("grad", grad))}
        wire[fp8_dispatch] = {(name, scope): hlo.collective_bytes(t, scope=scope)["all-to-all"]
                              for name, t in text.items()
                              for scope in ("moe_dispatch", "moe_combine")}
    fp8, bf16 = wire[None], wire[False]
    # forward: FP8 values plus one float32 scale per 128 features, against bfloat16
    assert fp8["forward", "moe_dispatch"] / bf16["forward", "moe_dispatch"] == \
        (D + 4 * D // 128) / (2 * D)
    # with the backward: the gradient of the dispatched rows travels back in bfloat16
    assert fp8["grad", "moe_dispatch"] == fp8["forward", "moe_dispatch"] + \
        bf16["forward", "moe_dispatch"]
    assert bf16["grad", "moe_dispatch"] == 2 * bf16["forward", "moe_dispatch"]
    # the combine (expert outputs back, and their gradient out) stays in the compute dtype
    for name in ("forward", "grad"):
        assert fp8[name, "moe_combine"] == bf16[name, "moe_combine"] > 0


@pytest.mark.slow
def test_fp8_dispatch_equals_unsharded_fp8(devices):
    """One round of worst-case buffers (the exact rounds: tests/models/test_fp8_models.py)."""
    x = jax.random.normal(jax.random.key(0), SHAPE)
    params, _, grad = functions(moe(None))
    (_, ref), ref_grads = jax.jit(grad)(params, x)
    layer = moe(ep_as_cp(), dispatch="all_to_all", overflow="drop")
    assert layer.execution.fp8_dispatch and layer.overflow == "drop"
    params, _, grad = functions(layer)
    (_, y), grads = jax.jit(grad)(params, x)
    # the tiles the receiver multiplies are the ones the unsharded layer makes
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), atol=1e-5)
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(ref_grads)]
    assert len(paths) == len(jax.tree.leaves(grads)) == 5  # router, gate, up, down; x
    for path, g, r in zip(paths, jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        g, r = np.asarray(g), np.asarray(r)
        assert g.dtype == r.dtype and np.all(np.isfinite(g)), path
        # the weight gradients take x^T's tiles from the dequantised rows (the original rows
        # stay with their sender): FP8's own error, observed ~0.05; the rest are equal
        assert rel(g, r) < 0.1, (path, rel(g, r))


def test_fp8_dispatch_checked_at_construction(devices):
    p = ep_as_cp()
    with pytest.raises(ValueError, match="fp8_dispatch=True sends the tokens as FP8 tiles"):
        MoE(num_experts=8, num_experts_per_tok=2, mlp_dim=48, inputs_shape=SHAPE,
            partitioner=p, dispatch="all_to_all", fp8_dispatch=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="fp8_dispatch=True is the all_to_all wire's"):
        moe(p, dispatch="all_gather", fp8_dispatch=True)
    with pytest.raises(ValueError, match="resolves to 'all_gather' without a mesh"):
        moe(None, fp8_dispatch=True)
    with pytest.raises(ValueError, match="fp8_dispatch='yes' must be None"):
        moe(p, fp8_dispatch="yes")
    # asked for, or left to the default: recorded; off where there is no all_to_all wire
    assert moe(p, dispatch="all_to_all", fp8_dispatch=True).execution.fp8_dispatch
    assert not moe(p, dispatch="all_gather").execution.fp8_dispatch
    assert not moe(None).execution.fp8_dispatch
