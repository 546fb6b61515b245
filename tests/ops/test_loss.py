"""`zoo.ops.cross_entropy` against optax's fp32 cross-entropy: values and gradients, fp32 and
bf16 logits, sharded over a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zoo.ops.loss import cross_entropy


def reference(logits, targets, w):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * w)


def ours(logits, targets, w):
    return jnp.sum(cross_entropy(logits, targets) * w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_matches_optax(dtype, devices):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    logits = (4 * jax.random.normal(k1, (4, 16, 300))).astype(dtype)
    targets = jax.random.randint(k2, (4, 16), 0, 300)
    w = (jax.random.uniform(k3, (4, 16)) > 0.3).astype(jnp.float32)
    mesh = jax.sharding.Mesh(np.array(devices[:4]).reshape(2, 2), ("b", "v"))
    logits = jax.device_put(logits, NamedSharding(mesh, P("b", None, "v")))
    for f in (jax.jit, lambda f: f):
        v_ref, g_ref = f(jax.value_and_grad(reference))(logits, targets, w)
        v, g = f(jax.value_and_grad(ours))(logits, targets, w)
        assert g.dtype == logits.dtype
        np.testing.assert_allclose(v, v_ref, rtol=1e-6)
        tol = 1e-6 if dtype == jnp.float32 else 1e-2  # both round the same fp32 gradient
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32),
                                   atol=tol * float(jnp.max(jnp.abs(g_ref.astype(jnp.float32)))))
    # the rows a weight of zero masks (padding) get no gradient
    assert not np.any(np.asarray(g, np.float32)[np.asarray(w) == 0])
