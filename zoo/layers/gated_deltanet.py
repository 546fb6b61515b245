"""`GatedDeltaNet`: the linear-attention token mixer of Qwen3-Next and Qwen3.5.

* ``in_proj_qkvz`` D -> (Hk, 2*Dk + 2*r*Dv) and ``in_proj_ba`` D -> (Hk, 2*r), ``r = Hv // Hk``:
  per key head, its q and k, then the v and z (output gate) of its ``r`` value heads, then
  their b (write strength) and a (decay) -- the interleaved layout of transformers'
  ``fix_query_key_value_ordering``, so a checkpoint's ``[out, in]`` weight becomes the kernel
  by ``W.T.reshape(...)``. ``projections="separate"`` (Qwen3.5): ``in_proj_qkv`` D -> C (q, k,
  v flat, the convolution's channel order), ``in_proj_z`` D -> (Hv, Dv), ``in_proj_b`` and
  ``in_proj_a`` D -> Hv.
* q, k, v (flattened, in that order) go through the short causal depthwise convolution
  (``conv1d`` [C, 1, W], SiLU; `zoo.ops.causal_conv1d`), then the gated delta rule
  (`zoo.ops.gated_delta_rule`, q/k L2-normalised inside) with ``g = -exp(A_log) *
  softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` (`zoo.ops.gates`).
* Output: `GatedRMSNorm` over Dv per value head with gate z, then ``out_proj`` (Hv, Dv) -> D.
* The cached call (`zoo.inference`): the cache is constant in the context length --
  ``conv`` [B, W-1, C], the convolution's last W-1 inputs (0 before the document start), and
  ``state`` [B, Hv, Dk, Dv] float32, the recurrent state. ``prefill_cache`` leaves both after
  each row's last token (padding anywhere in the row, left as generation pads); ``decode_step``
  convolves its tokens with the window (`zoo.ops.causal_conv1d`) and continues the state
  (`zoo.ops.gated_delta.recurrent_step`), replacing both through the cache it is given.
* Documents: both ops follow ``segment_ids``/``positions``, so rows may be packed and in any
  order `zoo.data.load_balance` produces; under context parallelism (the partitioner's
  attention scope shards ``length``, ``ep_as_cp`` included) the ops exchange only state
  summaries and convolution context. Heads are not sharded (the layer's parameters are
  FSDP-sharded over ``embed`` only).

Legend: B batch, L length, D embed, Hk key heads, Hv value heads, Dk/Dv head dims, C conv
channels ``2*Hk*Dk + Hv*Dv``, W conv kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.layers.attention import LayerCache, reshard
from zoo.layers.linear import Linear
from zoo.layers.norm import GatedRMSNorm
from zoo.ops import gated_delta as gd
from zoo.partitioning import Partitioner, resolve

SCOPE = "attention"  # the sequence axes context parallelism cuts (ep_as_cp: expert too)
PROJECTIONS = ("interleaved", "separate")


def _positive(what: str, **values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what}: {name}={v!r} must be a positive int")


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet over packed documents; see the module docstring.

    Args:
      num_key_heads, num_value_heads: Hk and Hv (``linear_num_key_heads`` /
        ``linear_num_value_heads``); Hv a multiple of Hk.
      key_head_dim, value_head_dim: Dk, Dv.
      conv_kernel: W (``linear_conv_kernel_dim``, 4).
      inputs_shape: ``(batch, length, embed)`` the layer will see; validated here.
      partitioner: how the mesh cuts parameters and activations (None: unsharded).
      norm_eps: the output norm's epsilon (``rms_norm_eps``).
      implementation: `zoo.ops.gated_delta_rule`'s (``"chunked"`` or ``"recurrent"``).
      max_pieces: state slots per shard and row under context parallelism (the op's).
      projections: ``"interleaved"`` (Qwen3-Next) or ``"separate"`` (Qwen3.5).
      dtype: computation dtype (None: the input's); param_dtype: storage dtype.

    ``y = layer(x, positions=..., segment_ids=None)``: x [B, L, D] -> [B, L, D]. Override
    `project`, `mix` or `out` in a subclass.
    """

    def __init__(self, *, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, inputs_shape: Sequence[int],
                 partitioner: Partitioner | None, conv_kernel: int = 4, norm_eps: float = 1e-6,
                 implementation: str = "chunked", max_pieces: int = 4,
                 projections: str = "interleaved", dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        what = "GatedDeltaNet"
        _positive(what, num_key_heads=num_key_heads, num_value_heads=num_value_heads,
                  key_head_dim=key_head_dim, value_head_dim=value_head_dim,
                  conv_kernel=conv_kernel, max_pieces=max_pieces)
        if num_value_heads % num_key_heads:
            raise ValueError(f"{what}: linear_num_value_heads={num_value_heads} is not a "
                             f"multiple of linear_num_key_heads={num_key_heads} (each key head "
                             f"serves Hv/Hk value heads); choose Hv among the multiples of "
                             f"{num_key_heads}")
        if implementation not in gd.IMPLEMENTATIONS:
            raise ValueError(f"{what}: implementation={implementation!r}; valid values are "
                             f"{gd.IMPLEMENTATIONS}")
        if projections not in PROJECTIONS:
            raise ValueError(f"{what}: projections={projections!r}; valid values are "
                             f"{PROJECTIONS} (Qwen3-Next's in_proj_qkvz/in_proj_ba, Qwen3.5's "
                             f"in_proj_qkv/z/b/a)")
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or \
                not norm_eps > 0:
            raise ValueError(f"{what}: norm_eps={norm_eps!r} must be a positive number")
        p = resolve(partitioner)
        batch, length, embed = p.check_inputs_shape(inputs_shape, what=what)
        p.check_tokens(batch, length, SCOPE, what=what, balanced=True)
        p.check_split("embed", embed, "embed", SCOPE, what=what,
                      role="the parameters' embed axis")
        Hk, Hv, Dk, Dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
        r = Hv // Hk
        self.num_key_heads, self.num_value_heads = Hk, Hv
        self.key_head_dim, self.value_head_dim = Dk, Dv
        self.conv_kernel, self.implementation, self.max_pieces = conv_kernel, implementation, \
            max_pieces
        self.inputs_shape, self.embed_dim = (batch, length, embed), embed
        self.partitioner, self.projections = p, projections
        self.conv_dim = 2 * Hk * Dk + Hv * Dv
        kw = dict(partitioner=p, scope=SCOPE, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if projections == "interleaved":
            self.in_proj_qkvz = Linear(embed, (Hk, 2 * Dk + 2 * r * Dv), in_axes=("embed",),
                                       out_axes=(None, None), **kw)
            self.in_proj_ba = Linear(embed, (Hk, 2 * r), in_axes=("embed",),
                                     out_axes=(None, None), **kw)
        else:
            self.in_proj_qkv = Linear(embed, self.conv_dim, in_axes=("embed",), out_axes=(None,),
                                      **kw)
            self.in_proj_z = Linear(embed, (Hv, Dv), in_axes=("embed",), out_axes=(None, None),
                                    **kw)
            self.in_proj_b = Linear(embed, Hv, in_axes=("embed",), out_axes=(None,), **kw)
            self.in_proj_a = Linear(embed, Hv, in_axes=("embed",), out_axes=(None,), **kw)
        bound = 1 / math.sqrt(conv_kernel)  # torch's Conv1d default (fan-in = W per channel)

        def conv_init(key, shape, dtype):
            return jax.random.uniform(key, shape, dtype, -bound, bound)

        def a_log_init(key, shape, dtype):  # transformers: A ~ U(0.01, 16)
            return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)

        def param(init, shape):
            return nnx.Param(p.param(init, (None,) * len(shape), SCOPE)(
                rngs.params(), shape, param_dtype))
        self.conv1d = param(conv_init, (self.conv_dim, 1, conv_kernel))
        self.dt_bias = param(nnx.initializers.ones_init(), (Hv,))
        self.A_log = param(a_log_init, (Hv,))
        self.norm = GatedRMSNorm(Dv, eps=float(norm_eps), partitioner=p,
                                 param_dtype=param_dtype, rngs=rngs)
        self.out_proj = Linear((Hv, Dv), embed, in_axes=(None, None), out_axes=("embed",),
                               **kw)

    # -- steps a subclass may override --------------------------------------------------------
    def project(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x [B, L, D] -> q, k [B, L, Hk, Dk], v, z [B, L, Hv, Dv], b, a [B, L, Hv]."""
        B, L, _ = x.shape
        Hk, Hv, Dk, Dv = (self.num_key_heads, self.num_value_heads, self.key_head_dim,
                          self.value_head_dim)
        r = Hv // Hk
        if self.projections == "separate":
            qkv = self.in_proj_qkv(x)
            q = qkv[..., :Hk * Dk].reshape(B, L, Hk, Dk)
            k = qkv[..., Hk * Dk:2 * Hk * Dk].reshape(B, L, Hk, Dk)
            v = qkv[..., 2 * Hk * Dk:].reshape(B, L, Hv, Dv)
            return q, k, v, self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        qkvz = self.in_proj_qkvz(x)  # [B, L, Hk, 2Dk + 2rDv]
        ba = self.in_proj_ba(x)  # [B, L, Hk, 2r]
        q, k = qkvz[..., :Dk], qkvz[..., Dk:2 * Dk]
        v = qkvz[..., 2 * Dk:2 * Dk + r * Dv].reshape(B, L, Hv, Dv)
        z = qkvz[..., 2 * Dk + r * Dv:].reshape(B, L, Hv, Dv)
        b, a = ba[..., :r].reshape(B, L, Hv), ba[..., r:].reshape(B, L, Hv)
        return q, k, v, z, b, a

    def conv_inputs(self, q, k, v) -> jax.Array:
        """q, k [B, L, Hk, Dk], v [B, L, Hv, Dv] -> the convolution's channels [B, L, C]."""
        B, L = q.shape[:2]
        return jnp.concatenate([q.reshape(B, L, -1), k.reshape(B, L, -1),
                                v.reshape(B, L, -1)], axis=-1)

    def conv_outputs(self, mixed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The convolution's output [B, L, C] -> q, k [B, L, Hk, Dk], v [B, L, Hv, Dv]."""
        B, L = mixed.shape[:2]
        Hk, Hv, Dk, Dv = (self.num_key_heads, self.num_value_heads, self.key_head_dim,
                          self.value_head_dim)
        return (mixed[..., :Hk * Dk].reshape(B, L, Hk, Dk),
                mixed[..., Hk * Dk:2 * Hk * Dk].reshape(B, L, Hk, Dk),
                mixed[..., 2 * Hk * Dk:].reshape(B, L, Hv, Dv))

    def conv_weight(self, dtype) -> jax.Array:
        """The depthwise kernel [C, W] (``conv1d.weight[:, 0]``) in `dtype`."""
        return self.conv1d[...][:, 0, :].astype(dtype)

    def mix(self, q, k, v, b, a, *, positions: jax.Array, segment_ids: jax.Array,
            return_cache: bool = False):
        """The convolution and the gated delta rule -> o [B, L, Hv, Dv]; with `return_cache`
        also the cache after each row's last token (``{"conv", "state"}``, `cache_shape`)."""
        p = self.partitioner
        mixed = self.conv_inputs(q, k, v)
        conv = gd.causal_conv1d(mixed, self.conv_weight(mixed.dtype), segment_ids=segment_ids,
                                positions=positions, partitioner=p, activation="silu",
                                max_pieces=self.max_pieces)
        g, beta = gd.gates(a, b, self.A_log[...], self.dt_bias[...])
        out = gd.gated_delta_rule(*self.conv_outputs(conv), g, beta, segment_ids=segment_ids,
                                  positions=positions, partitioner=p,
                                  implementation=self.implementation,
                                  max_pieces=self.max_pieces, return_state=return_cache)
        if not return_cache:
            return out
        o, state = out
        tail = gd.conv_tail(mixed, self.conv_kernel - 1, segment_ids=segment_ids,
                            positions=positions)
        return o, {"conv": tail, "state": state}

    def out(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """The gated norm per value head, then ``out_proj``: o, z [B, L, Hv, Dv] -> [B, L, D]."""
        y = self.out_proj(self.norm(o, z.astype(o.dtype)))
        return self.partitioner.constrain(y, ("batch", "length", "act_embed"), SCOPE)

    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """x [B, L, D], positions [B, L] (int), segment_ids [B, L] (0 = padding; None: one
        document per row) -> [B, L, D]."""
        return self.run(x, positions, segment_ids, return_cache=False)

    # -- the cached call (zoo.inference): a cache constant in the context length -------------
    # logical axes of each cache array (no "length": nothing here grows with the context)
    cache_axes: ClassVar[dict[str, tuple[str | None, ...]]] = {
        "conv": ("batch", None, None), "state": ("batch", None, None, None)}
    # arrays kept in their own dtype rather than the model's compute dtype
    cache_dtypes: ClassVar[dict[str, jnp.dtype]] = {"state": jnp.dtype(jnp.float32)}

    def cache_slots(self, max_length: int) -> int:
        """No per-token slots: the cache is a window and a state, whatever the length."""
        del max_length
        return 0

    def cache_shape(self, batch: int, max_length: int) -> dict[str, tuple[int, ...]]:
        """``conv`` [B, W-1, C] and ``state`` [B, Hv, Dk, Dv], for any `max_length`."""
        del max_length
        return {"conv": (batch, self.conv_kernel - 1, self.conv_dim),
                "state": (batch, self.num_value_heads, self.key_head_dim,
                          self.value_head_dim)}

    def prefill_cache(self, x: jax.Array, *, positions: jax.Array,
                      segment_ids: jax.Array | None = None
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`__call__` that also returns the cache after each row's last token in packing order
        (its last document): x [B, L, D] -> (out [B, L, D], {"conv", "state"})."""
        return self.run(x, positions, segment_ids, return_cache=True)

    def decode_step(self, x: jax.Array, cache: LayerCache, *, q_positions: jax.Array,
                    kv_positions: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None,
                    partitioner: Partitioner | None = None) -> jax.Array:
        """T new tokens per row continuing each row's last document: x [B, T, D] -> [B, T, D].
        ``cache.read(name)`` gives this layer's ``conv`` and ``state``, ``cache.replace``
        stores the new ones (sharded by `partitioner` as `cache_axes` say). The positions and
        segment ids of the attention layers' slots are not needed."""
        del q_positions, kv_positions, kv_segment_ids
        p = resolve(partitioner)
        W = self.conv_kernel
        with jax.named_scope("gated_deltanet"):
            q, k, v, z, b, a = self.project(x)
            mixed = self.conv_inputs(q, k, v)  # [B, T, C]
            T = mixed.shape[1]
            window = jnp.concatenate([cache.read("conv").astype(mixed.dtype), mixed], axis=1)
            ones = jnp.ones(window.shape[:2], jnp.int32)
            conv = gd.causal_conv1d(window, self.conv_weight(mixed.dtype), segment_ids=ones,
                                    positions=jnp.broadcast_to(jnp.arange(W - 1 + T),
                                                               ones.shape),
                                    activation="silu")[:, W - 1:]
            g, beta = gd.gates(a, b, self.A_log[...], self.dt_bias[...])
            o, state = gd.recurrent_step(cache.read("state"), *self.conv_outputs(conv), g, beta)
            cache.replace("conv", reshard(p, window[:, T:], self.cache_axes["conv"]))
            cache.replace("state", reshard(p, state, self.cache_axes["state"]))
            return self.out(o, z)

    def run(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, *,
            return_cache: bool):
        """`__call__`'s checks and steps; with `return_cache` also the cache (`mix`)."""
        what = type(self).__name__
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"{what}: x has shape {x.shape}; expected [B, L, D={self.embed_dim}]")
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if arr is not None and tuple(arr.shape) != x.shape[:2]:
                raise ValueError(f"{what}: {name} has shape {tuple(arr.shape)}; expected "
                                 f"[B, L] = {x.shape[:2]}")
        if x.shape != self.inputs_shape:
            self.partitioner.check_tokens(x.shape[0], x.shape[1], SCOPE, what=what,
                                          balanced=True)
        if segment_ids is None:
            segment_ids = jnp.ones(x.shape[:2], jnp.int32)
        with jax.named_scope("gated_deltanet"):
            x = self.partitioner.constrain(x, ("batch", "length", "act_embed"), SCOPE)
            with jax.named_scope("project"):
                q, k, v, z, b, a = self.project(x)
            with jax.named_scope("mix"):
                out = self.mix(q, k, v, b, a, positions=positions, segment_ids=segment_ids,
                               **(dict(return_cache=True) if return_cache else {}))
            o, cache = out if return_cache else (out, None)
            with jax.named_scope("out"):
                y = self.out(o, z)
            return (y, cache) if return_cache else y

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """transformers' ``Qwen3NextGatedDeltaNet`` names (``conv1d.weight`` [C, 1, W])."""
        rows = hfk.children(self, prefix, ("in_proj_qkvz", "in_proj_ba") if
                            self.projections == "interleaved" else
                            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        rows += [hfk.copy(("conv1d",), f"{prefix}.conv1d.weight"),
                 hfk.copy(("dt_bias",), f"{prefix}.dt_bias"),
                 hfk.copy(("A_log",), f"{prefix}.A_log")]
        return rows + hfk.children(self, prefix, ("norm", "out_proj"))
