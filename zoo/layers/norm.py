"""`RMSNorm`: root-mean-square normalisation, computed in float32 as Hugging Face does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.partitioning import Partitioner, resolve


class RMSNorm(nnx.Module):
    """``scale * (x / sqrt(mean(x**2) + eps))``, the normalisation in float32.

    Matches the Hugging Face Llama/Mixtral/DeepSeek ``RMSNorm``: normalise in float32, cast back
    to the input dtype, then multiply by the (unit-initialised) scale.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, partitioner: Partitioner | None = None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.dim, self.eps = dim, eps
        p = resolve(partitioner)
        self.scale = nnx.Param(p.param(nnx.initializers.ones_init(), ("norm",))(
            rngs.params(), (dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm of dim {self.dim} got input of shape {x.shape}")
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return [hfk.copy(("scale",), f"{prefix}.weight")]
