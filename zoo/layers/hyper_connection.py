"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): `HyperConnection`, `HyperHead`.

The residual stream is ``n = hc_mult`` streams ``[B, L, n, D]``. Around each block (attention
or MoE) a `HyperConnection`:

* flattens the streams, normalises them (unweighted RMSNorm over ``n * D``, float32) and
  projects them with ``fn`` to ``2n + n^2`` numbers per token, which become, with a per-output
  ``scale`` and ``base``:
  - ``pre [B, L, n] = sigmoid(.) + eps``: collapses the streams into the block's input
    ``sum_j pre_j * x_j`` ``[B, L, D]``;
  - ``post [B, L, n] = 2 sigmoid(.)``: expands the block's output ``y`` back into streams;
  - ``comb [B, L, n, n] = sinkhorn(softmax(.) + eps)``: the residual mixing matrix, made doubly
    stochastic by Sinkhorn-Knopp (`sinkhorn`), so mixing the streams cannot grow their norm;
* ``out_k = post_k * y + sum_j comb[j, k] * x_j`` (`HyperConnection.expand`).

`HyperHead` collapses the streams once more (``pre`` only) before the model's final norm.
Both compute in float32 (the projection at full precision) as transformers keeps them.

Sharding: the streams shard like the residual stream, ``("batch", "length", None,
"act_embed")``; the projections ``fn`` ``[n * D, 2n + n^2]`` are FSDP-sharded over ``embed``
on their input side (XLA all-gathers them, they are small).

Hugging Face keys (``DeepseekV4HyperConnection``): ``{prefix}.fn`` ``[2n + n^2, n * D]``,
``.base``, ``.scale`` ``[3]``; ``DeepseekV4HyperHead``: ``.hc_fn``, ``.hc_base``, ``.hc_scale``.

Legend: B batch, L length, n streams (hc_mult), D embed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.partitioning import Partitioner, resolve

__all__ = ["STREAMS", "HyperConnection", "HyperHead", "sinkhorn", "expand_streams"]

# logical axes of the streams: the residual stream's, with the stream axis whole
STREAMS = ("batch", "length", None, "act_embed")


def sinkhorn(comb: jax.Array, iters: int, eps: float) -> jax.Array:
    """Sinkhorn-Knopp on positive matrices ``[..., n, n]`` as DeepSeek-V4 runs it: columns
    normalised first, then ``iters - 1`` rounds of rows then columns, each sum ``+ eps``.

    The rounds are a loop in the program (`jax.lax.fori_loop`), not unrolled in Python: on
    the unrolled chain XLA:GPU's priority fusion runs for hours (see CHANGELOG). The loop
    runs the same operations in the same order."""
    def normalise(m, axis):
        return m / (m.sum(axis, keepdims=True) + eps)

    comb = normalise(comb, -2)
    return jax.lax.fori_loop(0, iters - 1,
                             lambda _, m: normalise(normalise(m, -1), -2), comb)


def expand_streams(x: jax.Array, hc_mult: int) -> jax.Array:
    """The embedding ``[B, L, D]`` copied into ``hc_mult`` streams ``[B, L, n, D]``."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], hc_mult, x.shape[-1]))


def _check_streams(x: jax.Array, n: int, dim: int, what: str) -> None:
    if x.ndim != 4 or x.shape[-2:] != (n, dim):
        raise ValueError(f"{what} expects streams [batch, length, {n}, {dim}] (hc_mult={n}, "
                         f"embed_dim={dim}), got {x.shape}; expand the hidden state with "
                         f"zoo.layers.hyper_connection.expand_streams first")


def _check_args(what: str, **values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what}: {name}={v!r} must be a positive int (DeepSeek-V4: "
                             f"hc_mult=4, hc_sinkhorn_iters=20)")


class _StreamProjection(nnx.Module):
    """The shared part: ``unweighted_rmsnorm(flatten(x)) @ kernel`` in float32."""

    def _project(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        B, L = x.shape[:2]
        flat = x.reshape(B, L, -1).astype(jnp.float32)
        flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, -1, keepdims=True) + self.norm_eps)
        return jnp.einsum("blc,co->blo", flat, kernel.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)

    @staticmethod
    def _collapse(x: jax.Array, pre: jax.Array) -> jax.Array:
        """``sum_j pre_j * x_j`` in float32, cast to x's dtype."""
        return jnp.einsum("bln,blnd->bld", pre, x.astype(jnp.float32)).astype(x.dtype)


class HyperConnection(_StreamProjection):
    """mHC around one block; see the module docstring.

    Args:
      embed_dim: D; hc_mult: n, the streams; sinkhorn_iters: Sinkhorn-Knopp iterations;
      eps: added to ``pre``, to ``comb`` and to each Sinkhorn sum (``hc_eps``);
      norm_eps: the unweighted RMSNorm's epsilon (``rms_norm_eps``);
      partitioner: shards the projection (None: unsharded).

    ``collapsed, post, comb = hc.collapse(x)``; ``x = hc.expand(y, x, post, comb)``;
    ``hc(x, block)`` is both around ``block(collapsed) -> y [B, L, D]``.
    """

    def __init__(self, *, embed_dim: int, hc_mult: int = 4, sinkhorn_iters: int = 20,
                 eps: float = 1e-6, norm_eps: float = 1e-6,
                 partitioner: Partitioner | None = None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        _check_args("HyperConnection", embed_dim=embed_dim, hc_mult=hc_mult,
                    sinkhorn_iters=sinkhorn_iters)
        p = resolve(partitioner)
        n = hc_mult
        self.partitioner = p
        self.embed_dim, self.hc_mult, self.sinkhorn_iters = embed_dim, n, sinkhorn_iters
        self.eps, self.norm_eps = eps, norm_eps
        out = (2 + n) * n
        self.fn = nnx.Param(p.param(nnx.initializers.normal(0.02), ("embed", None))(
            rngs.params(), (n * embed_dim, out), param_dtype))
        self.base = nnx.Param(p.param(nnx.initializers.zeros_init(), (None,))(
            rngs.params(), (out,), param_dtype))
        self.scale = nnx.Param(p.param(nnx.initializers.ones_init(), (None,))(
            rngs.params(), (3,), param_dtype))

    def weights(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(pre [B, L, n], post [B, L, n], comb [B, L, n, n])`` in float32 from the streams."""
        n = self.hc_mult
        mix = self._project(x, self.fn[...])
        base = self.base[...].astype(jnp.float32)
        scale = self.scale[...].astype(jnp.float32)
        pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + self.eps
        post = 2 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
        comb = mix[..., 2 * n:] * scale[2] + base[2 * n:]
        comb = jax.nn.softmax(comb.reshape(*comb.shape[:-1], n, n), axis=-1) + self.eps
        return pre, post, sinkhorn(comb, self.sinkhorn_iters, self.eps)

    def collapse(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Streams ``[B, L, n, D]`` -> ``(block input [B, L, D], post, comb)``."""
        _check_streams(x, self.hc_mult, self.embed_dim, "HyperConnection")
        x = self.partitioner.constrain(x, STREAMS)
        pre, post, comb = self.weights(x)
        return self._collapse(x, pre), post, comb

    def expand(self, y: jax.Array, x: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """``out_k = post_k * y + sum_j comb[j, k] * x_j`` in x's dtype ``[B, L, n, D]``."""
        dtype = x.dtype
        out = (post.astype(dtype)[..., None] * y.astype(dtype)[..., None, :]
               + jnp.einsum("bljk,bljd->blkd", comb.astype(dtype), x))
        return self.partitioner.constrain(out, STREAMS)

    def __call__(self, x: jax.Array, block: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """The streams after ``block``: collapse, run it, expand."""
        h, post, comb = self.collapse(x)
        return self.expand(block(h), x, post, comb)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return [hfk.linear(("fn",), f"{prefix}.fn"), hfk.copy(("base",), f"{prefix}.base"),
                hfk.copy(("scale",), f"{prefix}.scale")]


class HyperHead(_StreamProjection):
    """The streams collapsed before the final norm: ``sum_j pre_j x_j`` with ``pre =
    sigmoid(hc_scale * (norm(flatten(x)) @ hc_fn) + hc_base) + eps`` (float32)."""

    def __init__(self, *, embed_dim: int, hc_mult: int = 4, eps: float = 1e-6,
                 norm_eps: float = 1e-6, partitioner: Partitioner | None = None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        _check_args("HyperHead", embed_dim=embed_dim, hc_mult=hc_mult)
        p = resolve(partitioner)
        n = hc_mult
        self.partitioner = p
        self.embed_dim, self.hc_mult, self.eps, self.norm_eps = embed_dim, n, eps, norm_eps
        self.hc_fn = nnx.Param(p.param(nnx.initializers.normal(0.02), ("embed", None))(
            rngs.params(), (n * embed_dim, n), param_dtype))
        self.hc_base = nnx.Param(p.param(nnx.initializers.zeros_init(), (None,))(
            rngs.params(), (n,), param_dtype))
        self.hc_scale = nnx.Param(p.param(nnx.initializers.ones_init(), (None,))(
            rngs.params(), (1,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Streams ``[B, L, n, D]`` -> ``[B, L, D]`` in x's dtype."""
        _check_streams(x, self.hc_mult, self.embed_dim, "HyperHead")
        x = self.partitioner.constrain(x, STREAMS)
        mix = self._project(x, self.hc_fn[...])
        pre = jax.nn.sigmoid(mix * self.hc_scale[...].astype(jnp.float32)
                             + self.hc_base[...].astype(jnp.float32)) + self.eps
        return self.partitioner.constrain(self._collapse(x, pre),
                                          ("batch", "length", "act_embed"))

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return [hfk.linear(("hc_fn",), f"{prefix}.hc_fn"),
                hfk.copy(("hc_base",), f"{prefix}.hc_base"),
                hfk.copy(("hc_scale",), f"{prefix}.hc_scale")]
