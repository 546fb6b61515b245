"""The KV cache of `zoo.inference`: a pytree the decoder layers read and return.

* `KVCache` -- per layer the arrays its attention keeps (`AttentionBlock.cache_shape`: K/V
  per kv head for `zoo.layers.Attention`, MLA's latent and rotary key), each slot's position
  and segment id, the slots written; `KVCache.shapes` for a model (abstract models too).
* `cache_slots` -- a layer's slots (`AttentionBlock.cache_slots`): all of them, or a ring of
  the window for a mask whose reach back is bounded; `cache_bytes_per_token` at a context.
* `cache_axes` / `constrain_cache` -- the cache sharded as the attention shards its
  activations (batch, kv heads over ``tensor``, slots over the context axes), each array by
  the logical axes its layer declares (`AttentionBlock.cache_axes`).
* `fill`, `write`, `put`, `ring_view` -- how prefill and decode put tokens in and read them
  out.

The cache knows no layer kind: a new attention-like layer brings its own arrays through
``cache_axes``, ``cache_shape``, ``cache_entry``, ``prefill_cache`` and ``decode_step``. An
array whose ``cache_axes`` name ``"length"`` has a slot per token there (`slotted`: filled by
prefill, written a slot at a time); any other array is a layer's *state*, constant in the
context (gated DeltaNet's recurrent state and convolution window), which prefill leaves whole
and each decode step replaces (`zoo.layers.attention.LayerCache`). A layer may keep an array
in its own dtype (``cache_dtypes``, e.g. a float32 state; `array_dtype`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zoo.layers.attention import SCOPE, splittable_axes
from zoo.partitioning import Partitioner

__all__ = ["SLOTS", "KVCache", "array_dtype", "cache_axes", "cache_bytes_per_token",
           "cache_slots", "constrain_cache", "entry_slots", "fill", "layer_axes", "put",
           "ring_view", "slotted", "write"]

SLOTS = 3  # the slot axis of an entry's arrays [n, B, K, S, F]


def cache_slots(attn, max_length: int) -> int:
    """Slots layer `attn`'s cache keeps for a sequence of `max_length`
    (`AttentionBlock.cache_slots`): all of them, or a ring of a bounded mask's reach."""
    return attn.cache_slots(max_length)


def slotted(axes: Sequence[str | None]) -> bool:
    """Whether a cache array with these logical axes (a layer's ``cache_axes`` entry) has a
    slot per token (its ``"length"`` axis, `SLOTS` in the stacked entry); else it is a state
    the layer replaces whole each step."""
    return "length" in axes


def entry_slots(attn, entry: dict[str, jax.Array]) -> int | None:
    """The slots of layer `attn`'s stacked cache entry (its slotted arrays' `SLOTS` axis), or
    None when it holds only state."""
    for name, a in entry.items():
        if slotted(attn.cache_axes[name]):
            return a.shape[SLOTS]
    return None


def array_dtype(attn, name: str, dtype):
    """The dtype layer `attn` keeps cache array `name` in: its ``cache_dtypes`` entry, else
    `dtype` (the model's compute dtype)."""
    return jnp.dtype(getattr(attn, "cache_dtypes", {}).get(name, dtype))


def layer_axes(attn) -> tuple[tuple[str, tuple[str | None, ...]], ...]:
    """The logical axes of each array of `attn`'s cache entry ``[n, B, K, S, F]`` (the layer's
    `cache_axes` after the stack axis ``layers``), as `KVCache.axes` keeps them."""
    return tuple((name, ("layers", *axes)) for name, axes in attn.cache_axes.items())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer cache arrays for a batch, plus each slot's position and segment id.

    Attributes:
      layers: one dict per entry of ``model.layers``, arrays ``[n, B, K, S_l, F]`` (``n``
        the entry's layer count, heads before slots as the decode step's products read
        them): ``{"k", "v"}`` per kv head for `zoo.layers.Attention`, ``{"latent_pe"}``
        (K = 1, the one key all heads share) for `zoo.layers.MLA`; or ``[n, ...]`` state
        arrays without slots (`slotted`): ``{"conv", "state"}`` for
        `zoo.layers.GatedDeltaNet`. ``S_l`` is `max_length`,
        or for a sliding-window layer of window W ``min(W, max_length)``: a ring whose slot
        ``r`` holds the newest global slot ``g`` with ``g % S_l == r`` (`cache_slots`).
      positions: [B, S] int32, the position of the token in each (global) slot.
      segment_ids: [B, S] int32, 1 where a slot holds a token, 0 where empty or padding.
      length: int32 scalar (or [B] while decoding speculatively), slots written (the next
        one decode writes).
      next_positions: [B] int32, the position of each row's next token.
      axes: static, per entry of ``layers``, each array's logical axes (`layer_axes`).
    """

    layers: tuple[dict[str, jax.Array], ...]
    positions: jax.Array
    segment_ids: jax.Array
    length: jax.Array
    next_positions: jax.Array
    axes: tuple[tuple[tuple[str, tuple[str | None, ...]], ...], ...] = dataclasses.field(
        default=(), metadata=dict(static=True))

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @property
    def max_length(self) -> int:
        return self.positions.shape[1]

    def bytes_per_token(self) -> int:
        """Bytes the layers' entries hold per slot of one row, rounded down: all the layers'
        bytes over ``batch * max_length`` (positions excluded). A window layer's ring of W <
        max_length slots is amortised over the whole context, so it adds ``W / max_length``
        of its per-token bytes; a state (`slotted`) is amortised the same way."""
        total = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                    for entry in self.layers for a in entry.values())
        return total // (self.batch * self.max_length)

    @classmethod
    def shapes(cls, model, batch: int, max_length: int, dtype=None) -> KVCache:
        """The cache's `jax.ShapeDtypeStruct` s for `model` (works on `nnx.eval_shape` models:
        only the layers' sizes are read). ``dtype``: the model's compute dtype by default."""
        dtype = jnp.dtype(dtype or model.config.dtype)
        layers = []
        for layer in model.layers:
            n = layer.stack_size or 1
            shapes = layer.self_attn.cache_shape(batch, max_length)
            layers.append({k: jax.ShapeDtypeStruct((n, *s), array_dtype(layer.self_attn, k,
                                                                          dtype))
                           for k, s in shapes.items()})
        i32 = jnp.int32
        return cls(tuple(layers), jax.ShapeDtypeStruct((batch, max_length), i32),
                   jax.ShapeDtypeStruct((batch, max_length), i32),
                   jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((batch,), i32),
                   axes=tuple(layer_axes(layer.self_attn) for layer in model.layers))


def cache_bytes_per_token(model, dtype=None, *, context: int = 1) -> int:
    """Cache bytes per token of one sequence of `context` tokens, all layers (``model`` may
    be abstract): `KVCache.bytes_per_token` of a cache of `context` slots. The default, 1,
    counts every layer's bytes for each token (no window full yet); at a context longer than
    a layer's window W that layer holds W tokens, amortised over the context."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"cache_bytes_per_token: context={context!r} must be an int >= 1")
    return KVCache.shapes(model, 1, context, dtype).bytes_per_token()


def cache_axes(p: Partitioner, axes: Sequence[str | None],
               shape: Sequence[int]) -> tuple[str | None, ...]:
    """The logical axes `constrain_cache` shards a cache array of `shape` by: its layer's
    `axes` (`layer_axes`), less any whose dimension does not split over its mesh axes -- a
    ring of W slots (`cache_slots`) that the context axes do not divide, or fewer kv heads
    than the tensor axis (then each tensor shard needs every kv head) -- kept whole instead."""
    return splittable_axes(p, axes, shape)


def constrain_cache(cache: KVCache, p: Partitioner) -> KVCache:
    """The cache sharded as the attention shards its activations (`cache_axes`): batch over
    the batch axes, K/V heads over ``tensor``, and under context parallelism (``cp``,
    ``ep_as_cp``) the slots over the context axes, as prefill computed them.

    Decode keeps that sharding rather than gathering the length once after prefill: each
    device holds 1/context of every cache array for the whole generation (the memory that
    makes long contexts fit), and a step's collectives are per-query reductions of the scores
    and the output ([B, 1, N, ...], not the cache). Positions and segment ids are small and
    shard over the batch only, which keeps a ring's `ring_view` gather local."""
    layers = tuple({k: p.constrain(a, cache_axes(p, dict(axes)[k], a.shape), SCOPE)
                    for k, a in entry.items()}
                   for entry, axes in zip(cache.layers, cache.axes, strict=True))
    return dataclasses.replace(
        cache, layers=layers, positions=p.constrain(cache.positions, ("batch", None), SCOPE),
        segment_ids=p.constrain(cache.segment_ids, ("batch", None), SCOPE),
        next_positions=p.constrain(cache.next_positions, ("batch",), SCOPE))


def fill(a, slots: int):
    """A prompt's entry ``[n, B, K, L, F]`` -> ``[n, B, K, slots, F]``: padded when it fits,
    else the last ``slots`` of it as a ring (global slot ``g`` at ``g % slots``)."""
    L = a.shape[SLOTS]
    if L <= slots:
        return jnp.pad(a, [(0, slots - L) if d == SLOTS else (0, 0) for d in range(a.ndim)])
    ring = np.arange(slots)
    return a[:, :, :, (L - 1) - (L - 1 - ring) % slots]


def write(cache_array, new, slot, axis: int = 1):
    """Write ``new`` into slots ``slot ... slot + T - 1`` of ``cache_array``, its slots on
    `axis` (``[B, S]`` positions: 1; ``[B, K, S, F]`` one layer's keys: 2) and rows first;
    ``slot`` a scalar, or one per row ``[B]`` (speculative decoding's rows advance apart)."""
    new = new.astype(cache_array.dtype)
    if jnp.ndim(slot) == 1:
        return jax.vmap(lambda c, n, s: write(c, n, s, axis - 1))(cache_array, new, slot)
    at = [0] * new.ndim
    at[axis] = slot
    return jax.lax.dynamic_update_slice(cache_array, new, tuple(at))


def put(stack, new, layer, slot):
    """Layer ``layer``'s ``new [B, K, T, F]`` written at ``slot`` (scalar or ``[B]``) into an
    entry's stack ``[n, B, K, S, F]`` (in place when the stack is the decode loop's carry):
    (the stack, that layer's ``[B, K, S, F]`` to attend over)."""
    new = new.astype(stack.dtype)
    if jnp.ndim(slot) == 0:
        stack = jax.lax.dynamic_update_slice(stack, new[None], (layer, 0, 0, slot, 0))
    else:
        stack = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n[None],
                                                                      (layer, 0, s, 0)),
                         in_axes=(1, 0, 0), out_axes=1)(stack, new, slot)
    return stack, jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False)


def ring_view(kv_pos, kv_seg, slot, slots: int):
    """The positions and segment ids ``[B, slots]`` of a ring of `slots` after global slot
    ``slot`` (scalar or ``[B]``) is written: ring slot ``r`` holds the newest global slot ``g
    <= slot`` with ``g % slots == r``; none yet (``g < 0``): segment 0."""
    s = jnp.asarray(slot, jnp.int32)[..., None]  # [1] or [B, 1]
    g = jnp.broadcast_to(s - (s - jnp.arange(slots)) % slots, (kv_pos.shape[0], slots))
    at = jnp.maximum(g, 0)
    return (jnp.take_along_axis(kv_pos, at, axis=1),
            jnp.where(g >= 0, jnp.take_along_axis(kv_seg, at, axis=1), 0))
