"""Rotary position embeddings: standard RoPE and YaRN scaling, in both checkpoint layouts.

* ``RoPE(theta, interleaved, scaling)`` -- a frozen config; ``rope.apply(x, positions)`` rotates
  ``x [B, L, N, H]`` by the angles ``positions * inv_freq`` (computed in float32).
* Layouts: ``interleaved=False`` rotates the two halves ``(x[i], x[i + H/2])`` (Llama, Mixtral
  checkpoints); ``interleaved=True`` rotates adjacent pairs ``(x[2i], x[2i+1])`` (DeepSeek
  checkpoints). Hugging Face implements the latter by de-interleaving both q and k; the
  attention scores are the same because q and k are permuted alike.
* ``YaRN`` -- NTK-by-parts frequency interpolation with a linear ramp between
  ``beta_fast``/``beta_slow`` rotations over the original context, plus the attention
  temperature: cos/sin scaled by ``attention_factor`` and (DeepSeek-V3) the softmax scale
  multiplied by ``softmax_scale_multiplier()``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class YaRN:
    """YaRN context extension (Peng et al., 2023) with DeepSeek's mscale conventions."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"YaRN needs factor > 0 and original_max_position_embeddings > 0, "
                             f"got {self.factor} and {self.original_max_position_embeddings}")

    def cos_sin_factor(self) -> float:
        """The factor applied to cos and sin (Hugging Face's ``attention_factor``)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    def softmax_scale_multiplier(self) -> float:
        """DeepSeek-V3 multiplies the softmax scale by ``mscale(factor, mscale_all_dim)**2``."""
        if not self.mscale_all_dim:
            return 1.0
        m = yarn_get_mscale(self.factor, self.mscale_all_dim)
        return m * m

    def inv_freq(self, dim: int, theta: float) -> np.ndarray:
        pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low ones)
        inv = interpolation * (1 - keep) + extrapolation * keep
        return inv.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class RoPE:
    """Rotary embedding config. ``apply(x [..., L, N, H], positions [..., L])``.

    ``partial_rotary_factor`` (GLM-4.5: 0.5): only the leading ``int(H * factor)`` dims of a
    head rotate (in the configured layout, within that slice); the rest pass unchanged.
    """

    theta: float = 10000.0
    interleaved: bool = False
    scaling: YaRN | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"RoPE: partial_rotary_factor={f!r} must be in (0, 1] (the "
                             f"fraction of each head's dims that rotate; 1: all)")

    def rotary_dim(self, head_dim: int) -> int:
        """The rotating dims of a head of `head_dim` (even; ValueError naming the fix)."""
        dim = int(head_dim * self.partial_rotary_factor)
        if dim < 2 or dim % 2:
            raise ValueError(f"RoPE: head_dim={head_dim} * partial_rotary_factor="
                             f"{self.partial_rotary_factor} gives {dim} rotary dims, which must "
                             f"be even and >= 2 (RoPE rotates pairs); change either")
        return dim

    def inv_freq(self, dim: int) -> np.ndarray:
        if dim % 2:
            raise ValueError(f"rotary dimension {dim} must be even")
        if self.scaling is not None:
            return self.scaling.inv_freq(dim, self.theta)
        return (1.0 / self.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(
            np.float32)

    def cos_sin_factor(self) -> float:
        return 1.0 if self.scaling is None else self.scaling.cos_sin_factor()

    def softmax_scale_multiplier(self) -> float:
        return 1.0 if self.scaling is None else self.scaling.softmax_scale_multiplier()

    def apply(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        dim = self.rotary_dim(x.shape[-1]) if self.partial_rotary_factor != 1 else x.shape[-1]
        rot = apply_rope(x[..., :dim], positions, self.inv_freq(dim),
                         interleaved=self.interleaved, factor=self.cos_sin_factor())
        return rot if dim == x.shape[-1] else jnp.concatenate([rot, x[..., dim:]], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array, *,
               interleaved: bool = False, factor: float = 1.0) -> jax.Array:
    """Rotate ``x [B, L, N, H]`` by ``positions [B, L]``; angles and products in float32."""
    if x.shape[:-2] != positions.shape:
        raise ValueError(f"positions of shape {positions.shape} do not match x {x.shape} "
                         f"(expected positions [B, L] for x [B, L, N, H])")
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos = (jnp.cos(angles) * factor)[..., None, :]  # [B, L, 1, H/2]
    sin = (jnp.sin(angles) * factor)[..., None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        pairs = xf.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    else:
        a, b = jnp.split(xf, 2, axis=-1)
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.astype(x.dtype)
