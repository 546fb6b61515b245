"""`zoo.ops.fp8.sharded_dot` under an fsdp mesh (8 CPU devices): weight ``[K, N]`` sharded
over K, rows over the batch, as a mesh's dense layers hold them (issue 49).

* Numerics: output and gradients equal those of `fp8.dot` on unsharded arrays, for the
  weight and for its `prequantize` copy.
* Traffic: no collective inside a loop over 128-blocks, and no more bytes than the bf16
  product's program. `fp8.dot` left to XLA's partitioner fails both (its block loops slice
  sharded axes, so XLA all-gathers a whole operand per iteration): checked too, so the
  traffic test can tell the two apart.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
from zoo.ops import fp8, hlo

M, K, N = 8 * 128, 1024, 256  # 8 K-blocks and 8 M-blocks: one of each per device
ROWS, WEIGHT = P("fsdp", None), P("fsdp", None)


def _grads(product):
    def f(x, w):
        def loss(x, w):
            y = product(x, w)
            return jnp.sum(y * jnp.sin(y))  # a cotangent that varies (no constant folding)
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    return jax.jit(f)


def _operands(mesh=None):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, K), jnp.float32)
    w = jax.random.normal(kw, (K, N), jnp.float32) / np.sqrt(K)
    if mesh is None:
        return x, w
    return (jax.device_put(x, NamedSharding(mesh, ROWS)),
            jax.device_put(w, NamedSharding(mesh, WEIGHT)))


def _sharded(mesh, pre):
    def product(x, w):
        return fp8.sharded_dot(x, fp8.prequantize(w) if pre else w, mesh=mesh, x_spec=ROWS,
                               w_spec=WEIGHT)
    return product


@pytest.mark.parametrize("pre", [False, True])
def test_sharded_dot_and_grads_equal_unsharded_dot(devices, pre):
    mesh = zoo.make_mesh(devices=devices, fsdp=8)
    ref = _grads(fp8.dot)(*_operands())
    out = _grads(_sharded(mesh, pre))(*_operands(mesh))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        # the loss sums over shards in another order: float32 rounding of the sum only
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                   atol=1e-6 * float(jnp.max(jnp.abs(b))))


def _in_loops(module: hlo.Module) -> set[str]:
    """Computations a ``while`` runs (its body and condition, and what they call)."""
    seen: set[str] = set()
    todo = [c for _, ins in module.instructions() if ins.opcode == "while" for c in ins.callees]
    while todo:
        name = todo.pop()
        if name not in seen and name in module.computations:
            seen.add(name)
            todo += [c for ins in module.computations[name] for c in ins.callees]
    return seen


def _traffic(product, x, w):
    """(collectives inside loops, collective bytes by kind) of the gradient program."""
    text = _grads(product).lower(x, w).compile().as_text()
    module = hlo.parse(text)
    inside = [ins.opcode for c in _in_loops(module) for ins in module.computations[c]
              if ins.opcode.removesuffix("-start") in hlo.COLLECTIVES]
    return inside, hlo.collective_bytes(text)


def test_sharded_dot_moves_no_more_than_bf16(devices):
    mesh = zoo.make_mesh(devices=devices, fsdp=8)
    x, w = _operands(mesh)
    _, wide = _traffic(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                            preferred_element_type=jnp.float32), x, w)
    budget = sum(wide.values())
    inside, auto = _traffic(fp8.dot, x, w)  # XLA's partitioner: gathers in every iteration
    assert inside and sum(auto.values()) > budget, (inside, auto, wide)
    for pre in (False, True):
        inside, moved = _traffic(_sharded(mesh, pre), x, w)
        assert not inside, f"collectives inside the block loops: {inside}"
        assert sum(moved.values()) <= budget, (pre, moved, wide)
    # the FP8 copy travels: float8 values and float32 scales, never the weight (XLA:CPU
    # widens float8 collectives to f16, so the lowered program says what an accelerator sends)
    lowered = _grads(_sharded(mesh, True)).lower(x, w).as_text()
    sent = re.findall(r'"stablehlo.all_gather".*?: \(tensor<([^>]*)>', lowered)
    assert sorted(t.split("x")[-1] for t in sent) == ["f32", "f8E4M3FN"], sent


def test_sharded_dot_inside_shard_map_is_dot(devices):
    """Under a `jax.shard_map` over the specs' axes the operands are local: plain `dot`."""
    mesh = zoo.make_mesh(devices=devices, fsdp=8)
    x, w = _operands()
    inner = lambda x, w: fp8.sharded_dot(x, w, mesh=mesh, x_spec=ROWS, w_spec=WEIGHT)
    out = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(ROWS, P()), out_specs=ROWS))(x, w)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(fp8.dot)(x, w)))


def test_sharded_dot_rejects_specs_that_do_not_fit(devices):
    mesh = zoo.make_mesh(devices=devices, fsdp=8)
    x, w = _operands()
    with pytest.raises(ValueError, match="w_spec of at most 2"):
        fp8.sharded_dot(x, w, mesh=mesh, x_spec=ROWS, w_spec=("fsdp", None, None))
    with pytest.raises(ValueError, match=r"x \[..., K\]"):
        fp8.sharded_dot(x, w.T, mesh=mesh, x_spec=ROWS, w_spec=WEIGHT)
