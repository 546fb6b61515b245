"""Prefill and decode: a batch of prompts into a `KVCache`, then tokens a step from it.

* `prefill(model, tokens, segment_ids, *, max_length)` runs left-padded prompts through the
  model's own attention (its context-parallel strategy under a partitioner), each layer's
  `prefill_cache` leaving its cache arrays, and returns the last position's float32 logits
  and the filled cache.
* `decode(model, cache, tokens)` / `Decoder(model).decode(cache, tokens)` runs one token per
  row from the cache in one compiled step of fixed shape (the cache has its final length from
  the start); each layer's `decode_step` writes its new slots through a ``put`` the loop over
  the layers provides and attends over its whole cache. MLA decodes with the up-projections
  absorbed (`zoo.layers.MLA.attend_cache`). A layer whose cache is a state rather than slots
  (gated DeltaNet's window and recurrent state, `zoo.inference.cache.slotted`) reads and
  replaces it through the same object (`zoo.layers.attention.LayerCache`).
* Both run the model's inference view (`CausalLM.for_inference`): MoE dropless whatever the
  training settings, the token layout unknown; decode's view is unsharded (the layers'
  unsharded code on the sharded parameters, XLA partitioning from the arguments'
  shardings), with the cache sharded as the attention shards its activations for the whole
  generation (`constrain_cache`) and the residual stream split as the weights are
  (weight-stationary, `cached_layers`).
* The layers run on the model's stream (`CausalLM.stream_in` / `stream_out`), which may
  carry values between layers beside the residual (a tuple ``(residual, *carried)``): a
  layer's ``block`` hands them to the attention callable these loops give it, which passes
  them on to ``prefill_cache(x, *carried, ...)`` / ``decode_step(x, put, *carried, ...)``
  and returns what that call returns as its output (e.g. a top-k selection that later layers
  reuse, with the new selection beside the output).
* `cached_layers` and `prefill_layers` are the loops `zoo.inference.speculative` reuses
  for the MTP module's layer; `compiled` compiles a step once per static values and argument
  shapes (``STATS["compile_s"]`` counts the seconds).

Legend: B batch, L prompt length, S cache length, D embed, V vocab, K kv heads (cache
"heads"), F a cache array's features, T tokens per decode step.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.inference.cache import (KVCache, array_dtype, cache_slots, constrain_cache,
                                 entry_slots, fill, layer_axes, put, ring_view, slotted, write)
from zoo.layers.attention import reshard
from zoo.models.stacks import layer_groups
from zoo.partitioning import UNSHARDED, Partitioner

__all__ = ["DECODE_RESIDUAL", "STATS", "Decoder", "cached_layers", "compiled",
           "compiled_steps", "decode", "decode_jit", "decode_residual", "filled_cache",
           "final_logits", "grown", "inference_split", "prefill", "prefill_layers",
           "prefill_positions", "reshard_stream"]

# decode's residual stream [B, T, D]: split over embed as the weights are (weight-stationary)
DECODE_RESIDUAL = (None, None, "embed")


def decode_residual(x: jax.Array) -> tuple[str | None, ...]:
    """`DECODE_RESIDUAL` for a residual stream of ``x.ndim`` dims (hyper-connections' ``[B, T,
    n, D]`` streams too): every dim whole but the last, over ``embed``."""
    return (None,) * (x.ndim - 1) + ("embed",)


def reshard_stream(p: Partitioner, x):
    """Decode's stream laid out under `p`: the residual as `decode_residual`; a stream that
    carries values beside it (a tuple ``(residual, *carried)``, `CausalLM.stream_in`) keeps
    those as they are."""
    if isinstance(x, tuple):
        return (reshard(p, x[0], decode_residual(x[0])), *x[1:])
    return reshard(p, x, decode_residual(x))


def inference_split(model, *, unsharded: bool):
    """``nnx.split`` of the model's inference view (`CausalLM.for_inference`)."""
    return nnx.split(model.for_inference(unsharded=unsharded))


def final_logits(model, x: jax.Array, norm=None) -> jax.Array:
    """x [..., D] (after the last layer) -> float32 logits [..., V] through the final norm (or
    `norm`, e.g. an MTP module's) and the head, no sharding constraint."""
    x = (norm or model.norm)(x)
    if model.lm_head is None:
        table = model.embed_tokens.embedding[...]
        dtype = model.embed_tokens.dtype or x.dtype
        logits = jnp.einsum("...d,vd->...v", x.astype(dtype), table.astype(dtype))
    else:
        logits = model.lm_head(x)
    return logits.astype(jnp.float32)


# -- compiled steps --------------------------------------------------------------------------

_COMPILED: dict[Any, Any] = {}
STATS: dict[str, float] = {"compile_s": 0.0}


def compiled(fn, static: dict[str, Any], *args):
    """``fn(*args, **static)`` through an executable compiled once per static values and
    argument shapes, dtypes and shardings (compile time goes to ``STATS["compile_s"]``)."""
    leaves, tree = jax.tree.flatten(args)
    key = (fn, tuple(static.items()), tree,
           tuple((np.shape(a), getattr(a, "dtype", type(a)), getattr(a, "sharding", None))
                 for a in leaves))
    exe = _COMPILED.get(key)
    if exe is None:
        start = time.perf_counter()
        exe = fn.lower(*args, **static).compile()
        STATS["compile_s"] += time.perf_counter() - start
        if len(_COMPILED) >= 32:
            _COMPILED.clear()
        _COMPILED[key] = exe
    return exe(*args)


def compiled_steps(fn) -> int:
    """How many executables of ``fn`` (a jitted step) `compiled` holds."""
    return sum(1 for key in _COMPILED if key[0] is fn)


# -- prefill ---------------------------------------------------------------------------------

def _run_layers(group, x, fns):
    """``fns[j](one_layer, x) -> (x, entry)`` over a `layer_groups` entry (a stack, or the
    stacks of one cycle): scanned over the stacks' layers (their entries ``[n, ...]`` the
    scan's outputs), a cycle's layers in turn. Returns (x, [entry of each])."""
    if group[0].stack_size is None:
        out = []
        for layer, fn in zip(group, fns, strict=True):
            x, one = fn(layer, x)
            out.append(jax.tree.map(lambda a: a[None], one))
        return x, out
    splits = [nnx.split(layer) for layer in group]

    def body(x, states):
        out = []
        for (graphdef, _), state, fn in zip(splits, states, fns, strict=True):
            x, entry = fn(nnx.merge(graphdef, state), x)
            out.append(entry)
        return x, out

    return jax.lax.scan(body, x, [state for _, state in splits])


def prefill_positions(segment_ids):
    """Left-padded rows' segment ids [B, L] -> positions counting each row's tokens from 0."""
    return jnp.maximum(jnp.cumsum(segment_ids, axis=1) - 1, 0).astype(jnp.int32)


def prefill_layers(layers, x, positions, segment_ids, *, dtype, max_length: int,
                   layer_kwargs: dict | None = None):
    """Run ``layers`` (entries of ``model.layers``, or an MTP module's layer) over ``x [B, L,
    D]`` (the model's residual stream, `CausalLM.stream_in`; ``layer_kwargs`` go to each
    layer's ``block``): (x, one cache entry per layer, ``[n, B, K, S_l, F]`` with the prompt's
    slots filled: the first L, or in a ring of ``S_l < L`` slots the last ``S_l``;
    `KVCache.layers`). A state array comes back as the layer leaves it after the prompt,
    zero-padded to its `cache_shape` at ``max_length`` where that is larger (`grown`)."""
    kwargs = layer_kwargs or {}

    def layer_fn(layer, x):
        out = {}

        def attention(h, *carried):
            h, out["entry"] = layer.self_attn.prefill_cache(h, *carried, positions=positions,
                                                            segment_ids=segment_ids)
            return h

        x, _ = layer.block(x, attention, **kwargs)
        return x, {k: a.astype(array_dtype(layer.self_attn, k, dtype))
                   for k, a in out["entry"].items()}

    entries = []
    for group in layer_groups(layers):
        x, filled = _run_layers(group, x, [layer_fn] * len(group))
        for layer, entry in zip(group, filled):
            attn = layer.self_attn
            shapes = attn.cache_shape(positions.shape[0], max_length)
            entries.append({k: fill(a, cache_slots(attn, max_length))
                            if slotted(attn.cache_axes[k]) else grown(a, shapes[k])
                            for k, a in entry.items()})
    return x, tuple(entries)


def grown(a: jax.Array, shape) -> jax.Array:
    """A stacked state array ``[n, *s]`` zero-padded at the end of each dimension to ``[n,
    *shape]`` (a state that grows with the context, e.g. compressed entries one per window,
    filled for the prompt); unchanged when it has that shape."""
    pads = [(0, 0)] + [(0, want - have) for have, want in zip(a.shape[1:], shape, strict=True)]
    if any(hi < 0 for _, hi in pads):
        raise ValueError(f"a cache state of shape {a.shape[1:]} is larger than the cache's "
                         f"{tuple(shape)}")
    return jnp.pad(a, pads) if any(hi for _, hi in pads) else a


def filled_cache(layers, entries, positions, segment_ids, max_length: int) -> KVCache:
    """The `KVCache` of `max_length` slots after a prompt of L slots: ``entries`` (from
    `prefill_layers` over ``layers``), the prompt's positions and segment ids [B, L]."""
    grow = ((0, 0), (0, max_length - positions.shape[1]))
    return KVCache(entries, jnp.pad(positions, grow), jnp.pad(segment_ids, grow),
                   jnp.asarray(positions.shape[1], jnp.int32), positions[:, -1] + 1,
                   axes=tuple(layer_axes(layer.self_attn) for layer in layers))


def _prefill(model, p: Partitioner, tokens, segment_ids, max_length: int):
    segment_ids = segment_ids.astype(jnp.int32)
    positions = prefill_positions(segment_ids)
    x, layer_kwargs = model.stream_in(tokens)
    x, entries = prefill_layers(model.layers, x, positions, segment_ids,
                                dtype=jnp.dtype(model.config.dtype), max_length=max_length,
                                layer_kwargs=layer_kwargs)
    last = jax.tree.map(lambda a: a[:, -1:], x)  # every array of the stream is [B, L, ...]
    logits = final_logits(model, model.stream_out(last)[:, 0])
    cache = filled_cache(model.layers, entries, positions, segment_ids, max_length)
    return logits, constrain_cache(cache, p)


@functools.partial(jax.jit, static_argnames=("graphdef", "p", "max_length"))
def _prefill_jit(state, tokens, segment_ids, *, graphdef, p, max_length):
    return _prefill(nnx.merge(graphdef, state), p, tokens, segment_ids, max_length)


def prefill(model, tokens, segment_ids, *, max_length: int) -> tuple[jax.Array, KVCache]:
    """Left-padded prompts ``tokens [B, L]`` (``segment_ids`` 1 on tokens, 0 on the padding
    before them) -> (float32 logits at the last position [B, V], a `KVCache` of `max_length`
    slots with the first L filled). Positions count each row's tokens from 0. Under a
    partitioner, B and L must shard as the model's inputs do (`generate` pads for you)."""
    tokens, segment_ids = jnp.asarray(tokens, jnp.int32), jnp.asarray(segment_ids, jnp.int32)
    if max_length < tokens.shape[1]:
        raise ValueError(f"prefill: max_length={max_length} is shorter than the prompts "
                         f"({tokens.shape[1]}); give room for the tokens to generate")
    graphdef, state = inference_split(model, unsharded=False)
    return compiled(_prefill_jit, dict(graphdef=graphdef, p=model.partitioner,
                                       max_length=max_length), state, tokens, segment_ids)


# -- decode ----------------------------------------------------------------------------------

def cached_layers(layers, entries, x, q_pos, kv_pos, kv_seg, slot,
                  p: Partitioner = UNSHARDED, *, layer_kwargs: dict | None = None,
                  first_states: bool = False):
    """Run ``layers`` over ``x [B, T, D]`` (queries at ``q_pos [B, T]``) from their cache
    ``entries``, writing the T new slots at ``slot``: (x, the updated entries).
    ``kv_pos``/``kv_seg`` are the cache's positions and segment ids with the new slots; a
    ring entry (fewer slots than they have) sees them through `ring_view`.

    T > 1 (speculative decoding's verify step) over a layer's *state* (arrays that are not
    `slotted`, which a later step cannot mask a token out of) needs a layer that takes the
    T tokens in turn, replacing its state after each (``replaces_state_per_token``,
    `zoo.layers.attention.LayerCache`); with `first_states` the call returns (x, entries,
    firsts), ``firsts`` per entry the state arrays as they were after the first of the T
    tokens (empty for slotted arrays, whose extra slots the caller masks by segment id).

    Layouts under `p` (the model's partitioner; the layers run their unsharded code, see
    `Decoder`, so nothing else states them): a step's activations are a few tokens, far
    smaller than the weights, so decode is weight-stationary -- the residual stream is split
    over ``embed`` as the FSDP-sharded weights are (`DECODE_RESIDUAL`), rather than every
    weight gathered each step -- while attention meets the cache in the cache's batch
    sharding: each layer's `decode_step` reshards its new arrays (`zoo.layers.reshard`).
    Left implicit, XLA propagates the parameters' shardings into the activations and
    replicates them where they meet the cache."""
    S, T = kv_pos.shape[1], q_pos.shape[1]
    views = {}
    if len(entries) != len(layers):
        raise ValueError(f"the cache holds {len(entries)} layer entries; the model has "
                         f"{len(layers)}")
    for layer, entry in zip(layers, entries):
        slots = entry_slots(layer.self_attn, entry)
        if T > 1 and any(not slotted(layer.self_attn.cache_axes[k]) for k in entry) \
                and not getattr(layer.self_attn, "replaces_state_per_token", False):
            # the state takes in every token; a rejected draft could not be taken back out
            raise ValueError(f"decoding {T} tokens a step (speculative decoding) over "
                             f"{type(layer.self_attn).__name__}'s recurrent state is not "
                             f"supported; decode one token a step (speculative=None)")
        if slots is not None and slots < S and slots not in views:
            if T > 1:  # the T-th write would evict a key the first query still sees
                raise ValueError(f"decoding {T} tokens a step (speculative decoding) over a "
                                 f"sliding-window ring cache of {slots} slots is not "
                                 f"supported; decode one token a step (speculative=None)")
            views[slots] = (*ring_view(kv_pos, kv_seg, slot, slots), slot % slots)

    def layer_fn(layer, entry):
        pos, seg, at = views.get(entry_slots(layer.self_attn, entry), (kv_pos, kv_seg, slot))

        def fn(one, x, put_new):
            x, _ = one.block(x, lambda h, *carried: one.self_attn.decode_step(
                h, put_new, *carried, q_positions=q_pos, kv_positions=pos, kv_segment_ids=seg,
                partitioner=p), **kwargs)
            return reshard_stream(p, x)
        return fn, at

    def with_firsts(layer, entry):  # a copy of each state array, for the first token's
        axes = layer.self_attn.cache_axes
        return entry | {k + FIRST: a for k, a in entry.items() if not slotted(axes[k])}

    new = []
    kwargs = layer_kwargs or {}
    x = reshard_stream(p, x)
    entries, i = list(entries), 0
    for group in layer_groups(layers):
        mine = entries[i:i + len(group)]
        fns = [layer_fn(la, e) for la, e in zip(group, mine)]
        if first_states:
            mine = [with_firsts(la, e) for la, e in zip(group, mine)]
        x, out = _run_cached(group, x, mine, fns)
        new += out
        i += len(group)
    if not first_states:
        return x, tuple(new)
    split = lambda e, first: {k.removesuffix(FIRST): a for k, a in e.items()
                              if k.endswith(FIRST) == first}
    return x, tuple(split(e, False) for e in new), tuple(split(e, True) for e in new)


FIRST = "@first"  # a state array's copy after a step's first token (`cached_layers`)


class _StackCache:
    """Layer ``i``'s view of a stack's cache entry ``cache`` (a dict the decode loop carries,
    updated in place): `zoo.layers.attention.LayerCache`."""

    def __init__(self, cache: dict, i, slot):
        self.cache, self.i, self.slot = cache, i, slot
        self.replaced: set[str] = set()

    def __call__(self, name, new):
        self.cache[name], layer_keys = put(self.cache[name], new, self.i, self.slot)
        return layer_keys

    def read(self, name):
        return jax.lax.dynamic_index_in_dim(self.cache[name], self.i, keepdims=False)

    def replace(self, name, value):
        stack = self.cache[name]
        if value.shape != stack.shape[1:]:
            raise ValueError(f"cache array {name!r}: a layer's value has shape {value.shape}; "
                             f"the cache keeps {stack.shape[1:]}")
        self.cache[name] = jax.lax.dynamic_update_index_in_dim(
            stack, value.astype(stack.dtype), self.i, 0)
        if name not in self.replaced and name + FIRST in self.cache:  # after the first token
            self.cache[name + FIRST] = jax.lax.dynamic_update_index_in_dim(
                self.cache[name + FIRST], value.astype(stack.dtype), self.i, 0)
        self.replaced.add(name)


def _run_cached(group, x, entries, fns):
    """``fn(one_layer, x, put) -> x`` over a `layer_groups` entry and its cache `entries`
    (``{name: [n, B, K, S, F]}`` each; `fns` holds ``(fn, slot)`` per stack), which the loop
    over the stacks carries: ``put(name, new [B, K, T, F])`` writes the layer's new slots at
    its slot in place (`zoo.inference.cache.put`) and returns the layer's ``[B, K, S, F]`` to
    attend over -- no layer's cache is sliced out and written back; ``put.read(name)`` and
    ``put.replace(name, value)`` give a state array whole (`_StackCache`). Returns (x,
    [updated entry of each])."""

    def run(one, x, cache, i, fn, slot):
        cache = dict(cache)
        return fn(one, x, _StackCache(cache, i, slot)), cache

    def cycle(layers, x, caches, i):
        out = []
        for one, cache, (fn, slot) in zip(layers, caches, fns, strict=True):
            x, cache = run(one, x, cache, i, fn, slot)
            out.append(cache)
        return x, out

    if group[0].stack_size is None:
        return cycle(group, x, entries, 0)
    splits = [nnx.split(layer) for layer in group]

    def body(carry, inputs):
        states, i = inputs
        layers = [nnx.merge(graphdef, state) for (graphdef, _), state in zip(splits, states)]
        return cycle(layers, *carry, i), None

    states = [state for _, state in splits]
    return jax.lax.scan(body, (x, list(entries)),
                        (states, jnp.arange(group[0].stack_size)))[0]


def _decode(model, p: Partitioner, cache: KVCache, tokens):
    slot = cache.length
    q_pos = cache.next_positions[:, None]  # [B, 1]
    kv_pos = write(cache.positions, q_pos, slot)
    kv_seg = write(cache.segment_ids, jnp.ones_like(q_pos), slot)
    x, layer_kwargs = model.stream_in(tokens[:, None])
    x, layers = cached_layers(model.layers, cache.layers, x, q_pos, kv_pos, kv_seg, slot, p,
                              layer_kwargs=layer_kwargs)
    logits = final_logits(model, model.stream_out(x)[:, 0])
    cache = KVCache(layers, kv_pos, kv_seg, slot + 1, cache.next_positions + 1,
                    axes=cache.axes)
    return logits, constrain_cache(cache, p)


@functools.partial(jax.jit, static_argnames=("graphdef", "p"), donate_argnames=("cache",))
def decode_jit(state, cache, tokens, *, graphdef, p):
    """The compiled decode step on a split inference view (`inference_split(unsharded=True)`):
    what `Decoder` runs and `zoo.inference.rehearsal` compiles ahead of time."""
    return _decode(nnx.merge(graphdef, state), p, cache, tokens)


def decode(model, cache: KVCache, tokens) -> tuple[jax.Array, KVCache]:
    """One step: ``tokens [B]`` (each row's newest token) -> (float32 logits [B, V], the cache
    with one more slot). The input cache is donated (do not reuse it). Each call splits the
    model; a loop makes one `Decoder` and calls its ``decode``."""
    if int(cache.length) >= cache.max_length:
        raise ValueError(f"decode: the cache is full ({cache.max_length} slots); prefill with "
                         f"a larger max_length")
    return Decoder(model).decode(cache, tokens)


class Decoder:
    """`decode` for one model, split once: ``logits, cache = decoder.decode(cache, tokens)``
    (a model whose parameters change afterwards needs a new one)."""

    def __init__(self, model):
        self.graphdef, self.state = inference_split(model, unsharded=True)
        self.partitioner = model.partitioner

    def decode(self, cache: KVCache, tokens) -> tuple[jax.Array, KVCache]:
        return compiled(decode_jit, dict(graphdef=self.graphdef, p=self.partitioner),
                        self.state, cache, np.asarray(tokens, np.int32))
