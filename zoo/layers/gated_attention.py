"""`GatedAttention`: the full-attention layer of Qwen3-Next and Qwen3.5, an `Attention` subclass.

* ``q_proj`` D -> (N, 2H): per head its query then its output gate, the layout transformers
  splits with ``view(..., N, 2H).chunk(2)`` (a checkpoint's ``[2NH, D]`` weight becomes the
  kernel by ``W.T.reshape(D, N, 2H)``).
* ``q_norm``/``k_norm``: `ZeroCentredRMSNorm` over ``head_dim`` on every q and k head before
  RoPE (``(1 + w)``, zeros at init).
* RoPE on the leading ``partial_rotary_factor * H`` dims of each head (`zoo.layers.RoPE`,
  Qwen3-Next: 0.25); attention as `Attention` (masks, context parallelism, kernels).
* Output: ``o_proj(o * sigmoid(gate))``.

`project` returns q, k, v as `Attention`'s (the gate dropped), `gated_project` also the gate;
`__call__` and `prefill_cache` multiply the attention output by ``sigmoid(gate)`` before
``o_proj``; so does the cached ``decode_step`` (`Attention`'s K/V cache, unchanged).

Legend: B batch, L length, D embed, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.attention import SCOPE, Attention, CachePut, check_call
from zoo.layers.linear import Linear
from zoo.layers.norm import ZeroCentredRMSNorm
from zoo.partitioning import Partitioner, resolve


class GatedAttention(Attention):
    """`Attention` with a sigmoid output gate per head and zero-centred q/k norms.

    Takes `Attention`'s keyword arguments; ``qk_norm`` (default True) builds
    `ZeroCentredRMSNorm` q/k norms with ``qk_norm_eps``. Hugging Face names: ``q_proj`` (query
    and gate interleaved per head), ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``.
    """

    def __init__(self, *, qk_norm: bool = True, qk_norm_eps: float = 1e-6, use_bias: bool = False,
                 dtype=None, param_dtype=jnp.float32, fp8: str | None = None, rngs: nnx.Rngs,
                 **kwargs):
        super().__init__(qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, use_bias=use_bias,
                         dtype=dtype, param_dtype=param_dtype, fp8=fp8, rngs=rngs, **kwargs)
        N, H, p = self.num_heads, self.head_dim, self.partitioner
        self.q_proj = Linear(self.embed_dim, (N, 2 * H), in_axes=("embed",),
                             out_axes=("heads", "head_dim"), partitioner=p, scope=SCOPE,
                             use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, fp8=fp8,
                             rngs=rngs)
        if qk_norm:
            self.q_norm, self.k_norm = (
                ZeroCentredRMSNorm(H, eps=float(qk_norm_eps), partitioner=p,
                                   param_dtype=param_dtype, rngs=rngs) for _ in range(2))

    def gated_project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x [B, L, D] -> q [B, L, N, H], gate [B, L, N, H], k, v [B, L, K, H]."""
        c = self.partitioner.constrain
        H = self.head_dim
        qg = c(self.q_proj(x), ("batch", "length", "act_heads", "act_head_dim"), SCOPE)
        q, gate = qg[..., :H], qg[..., H:]
        kv_axes = ("batch", "length", self.kv_act_axis, "act_head_dim")
        k = c(self.k_proj(x), kv_axes, SCOPE)
        v = c(self.v_proj(x), kv_axes, SCOPE)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, gate, k, v

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, _, k, v = self.gated_project(x)
        return q, k, v

    def gate(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        """The attention output o [B, L, N, H] times ``sigmoid(gate)``."""
        return o * jax.nn.sigmoid(gate.astype(o.dtype))

    def run(self, x, positions, segment_ids):
        check_call(self, x, positions, segment_ids)
        x = self.partitioner.constrain(x, ("batch", "length", "act_embed"), SCOPE)
        with jax.named_scope("project"):
            q, gate, k, v = self.gated_project(x)
        with jax.named_scope("rope"):
            q, k = self.apply_rope(q, k, positions)
        with jax.named_scope("attend"):
            o = self.attend(q, k, v, positions=positions, segment_ids=segment_ids)
        with jax.named_scope("out"):
            return self.out(self.gate(o, gate)), k, v

    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """x [B, L, D], positions [B, L] (int), segment_ids [B, L] (0 = padding) -> [B, L, D]."""
        with jax.named_scope(self.block_name):
            return self.run(x, positions, segment_ids)[0]

    def prefill_cache(self, x: jax.Array, *, positions: jax.Array,
                      segment_ids: jax.Array | None = None):
        with jax.named_scope(self.block_name):
            y, k, v = self.run(x, positions, segment_ids)
            return y, self.cache_entry(k, v)

    def decode_step(self, x: jax.Array, put: CachePut, *, q_positions: jax.Array,
                    kv_positions: jax.Array, kv_segment_ids: jax.Array,
                    partitioner: Partitioner | None = None) -> jax.Array:
        """`Attention.decode_step` (the same K/V cache) with the output gate: T new tokens
        per row over the cache, x [B, T, D] -> [B, T, D]."""
        p = resolve(partitioner)
        with jax.named_scope(self.block_name):
            q, gate, k, v = self.gated_project(x)
            q, k = self.apply_rope(q, k, q_positions)
            o = self.attend_cache(q, k, v, put, p, **self.cached_kwargs(
                q_positions, kv_positions, kv_segment_ids))
            return self.out(self.gate(o.astype(q.dtype), gate))
