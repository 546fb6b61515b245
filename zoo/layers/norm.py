"""Root-mean-square normalisations, computed in float32 as Hugging Face does.

* `RMSNorm` -- ``scale * norm(x)`` (Llama, Mixtral, DeepSeek, Qwen3).
* `ZeroCentredRMSNorm` -- ``(1 + scale) * norm(x)``, scale initialised to zeros
  (Qwen3-Next / Qwen3.5's ``Qwen3NextRMSNorm``).
* `GatedRMSNorm` -- ``scale * norm(x) * silu(gate)`` (``Qwen3NextRMSNormGated``, the output norm
  of gated DeltaNet).
"""

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

    scale_init = staticmethod(nnx.initializers.ones_init())  # a subclass may start elsewhere

    def __init__(self, dim: int, *, eps: float = 1e-6, partitioner: Partitioner | None = None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.dim, self.eps = dim, eps
        p = resolve(partitioner)
        self.scale = nnx.Param(p.param(self.scale_init, ("norm",))(
            rngs.params(), (dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm of dim {self.dim} got input of shape {x.shape}")
        return self.scale[...].astype(x.dtype) * self.normalise(x).astype(x.dtype)

    def normalise(self, x: jax.Array) -> jax.Array:
        """``x / sqrt(mean(x**2) + eps)`` over the last axis, in float32."""
        x32 = x.astype(jnp.float32)
        return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return [hfk.copy(("scale",), f"{prefix}.weight")]


class ZeroCentredRMSNorm(RMSNorm):
    """``(1 + scale) * norm(x)`` with the scale initialised to zeros: Qwen3-Next's
    ``Qwen3NextRMSNorm`` (the product in float32, then cast to the input dtype), so weight
    decay pulls the gain towards 1. Hugging Face key ``prefix.weight`` (the zero-centred
    value, as stored)."""

    scale_init = staticmethod(nnx.initializers.zeros_init())

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"ZeroCentredRMSNorm of dim {self.dim} got input of shape {x.shape}")
        return (self.normalise(x) * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(RMSNorm):
    """``scale * norm(x) * silu(gate)``: Qwen3-Next's ``Qwen3NextRMSNormGated`` (norm, cast to
    the input dtype, scale, then the gate in float32; unit-initialised scale).
    ``norm(x, gate)`` with ``gate`` of x's shape."""

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim or gate.shape != x.shape:
            raise ValueError(f"GatedRMSNorm of dim {self.dim} got input {x.shape} and gate "
                             f"{gate.shape}; both must be [..., {self.dim}] of one shape")
        y = self.scale[...].astype(x.dtype) * self.normalise(x).astype(x.dtype)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
