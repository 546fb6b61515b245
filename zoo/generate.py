"""Generation with KV caches: prefill a batch of prompts, then decode one token per step.

* `KVCache` -- a pytree (not module state) that the decoder layers read and return, so it
  passes through `jax.jit` and through the `lax.scan` over a stack of layers (each entry of
  ``model.layers`` has one dict of arrays with a leading layer axis, 1 when unrolled):
  grouped-query attention keeps ``k``/``v`` ``[n, B, S, K, H]`` per kv head (after RoPE and
  q/k norms); MLA keeps only ``latent_pe`` ``[n, B, S, Rkv + Hr]`` -- the normalised latent and
  the rotated shared key, 576 values per token per layer for DeepSeek-V3. Slots carry their
  token's position and segment id (0: empty or padding), so masks come from positions as in
  training.
* `prefill` runs the prompts through the model's own attention (its context-parallel strategy
  under a partitioner) and returns the last position's logits and the filled cache; `decode`
  runs one token per row from the cache in one compiled step of fixed shape (the cache has its
  final length from the start). MLA decodes with the up-projections absorbed: the query's
  no-position part goes through ``kv_b_proj``'s key half into latent space, attention runs as
  one shared head over the cached latent, and the value half maps the result back, so the
  expanded K/V are never built.
* `generate(model, prompts, *, max_new_tokens, ...)` -> each prompt's continuation. Prompts of
  any lengths share a batch: they are left-padded (segment 0) to a length and batch the
  partitioner divides, each row's positions starting at 0. Sampling: greedy
  (``temperature=0``), or temperature, then top-k, then top-p (nucleus) on the scaled logits,
  with ``jax.random.fold_in(key(seed), step)``; ``stop`` ids end a row (the stop id is kept).
* MoE layers run dropless here whatever the training capacity (``capacity_factor``,
  ``moe_buffer_factor``), so generation is the model's exact function.
* Under a partitioner, prefill uses the sharded model as trained; decode runs the layers'
  unsharded code on the sharded parameters (XLA partitions it) with the cache sharded as the
  attention shards its activations: batch, kv heads over ``tensor``, and under ``cp`` /
  ``ep_as_cp`` the slots over the context axes, for the whole generation (`_constrain_cache`);
  the residual stream stays split as the weights are (weight-stationary, `_cached_layers`).
* A sliding-window layer keeps a ring of ``min(W, max_length)`` slots (`cache_slots`).
* ``speculative="mtp"``: DeepSeek-V3's MTP module drafts a token per step and the model
  verifies it (`zoo.speculative`), with plain greedy decoding's tokens.
* ``python -m zoo.generate --run DIR --prompt TEXT --max-new-tokens N`` (or ``--hf PATH``;
  ``--speculative mtp``).

Legend: B batch, L prompt length, S cache length, D embed, V vocab, N heads, K kv heads,
H head dim, Rkv kv_lora_rank, Hr qk_rope_head_dim, Hn qk_nope_head_dim, Hv v_head_dim.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.layers.attention import SCOPE, AttentionBlock, check_call
from zoo.layers.mla import MLA
from zoo.layers.moe import MoE
from zoo.models.stacks import layer_groups
from zoo.kv_cache import (CACHE_AXES, KVCache, _constrain_cache, _fill,  # noqa: F401
                          SLOTS, _put, _ring_view, _splittable, _write, cache_axes,
                          cache_bytes_per_token, cache_slots)
from zoo.ops.attention import dot_product_attention
from zoo.partitioning import UNSHARDED, Partitioner

__all__ = ["Decoder", "KVCache", "cache_bytes_per_token", "cache_slots", "decode",
           "generate", "generate_with_logits", "prefill"]

ACT = ("batch", "length", "act_embed")
# decode's residual stream [B, T, D]: split over embed as the weights are (weight-stationary)
DECODE_RESIDUAL = (None, None, "embed")


# -- model views -----------------------------------------------------------------------------

@contextlib.contextmanager
def _patched(model, *, unsharded: bool):
    """Temporarily set trace-time attributes of `model`'s modules: MoE dropless, attention
    layout unknown (prompts are not in the training data's token order); with `unsharded`,
    every module's partitioner is the unsharded one (decode: XLA partitions the program from
    the parameters' and the cache's shardings)."""
    saved = []

    def put(m, name, value):
        saved.append((m, name, getattr(m, name)))
        setattr(m, name, value)

    for _, m in nnx.iter_modules(model):
        if isinstance(m, MoE):
            put(m, "capacity_factor", None)
            put(m, "buffer_factor", None)
            if unsharded:
                put(m, "dispatch", "all_gather")
        if isinstance(m, AttentionBlock):
            put(m, "layout", None)
            if unsharded:
                put(m, "implementation", "reference")
        if unsharded and isinstance(getattr(m, "partitioner", None), Partitioner):
            put(m, "partitioner", UNSHARDED)
    try:
        yield
    finally:
        for m, name, value in reversed(saved):
            setattr(m, name, value)


def _split(model, *, unsharded: bool):
    with _patched(model, unsharded=unsharded):
        return nnx.split(model)


def _run_layers(group, x, entries, fns):
    """``fns[j](one_layer, x, entry) -> (x, entry)`` over a `layer_groups` entry (a stack, or
    the stacks of one cycle, each with its own `fns` entry and cache `entries[j]`, None in
    prefill): scanned over the stacks' layers (their cache entries ``[n, ...]`` are the
    scan's inputs and outputs), a cycle's layers in turn. Returns (x, [entry of each])."""
    if group[0].stack_size is None:
        out = []
        for layer, entry, fn in zip(group, entries, fns, strict=True):
            one = None if entry is None else jax.tree.map(lambda a: a[0], entry)
            x, one = fn(layer, x, one)
            out.append(jax.tree.map(lambda a: a[None], one))
        return x, out
    splits = [nnx.split(layer) for layer in group]

    def body(x, inputs):
        out = []
        for (graphdef, _), (state, entry), fn in zip(splits, inputs, fns, strict=True):
            x, entry = fn(nnx.merge(graphdef, state), x, entry)
            out.append(entry)
        return x, out

    return jax.lax.scan(body, x, [(state, e) for (_, state), e in zip(splits, entries)])


def _logits(model, x: jax.Array, norm=None) -> jax.Array:
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


def _score_kwargs(attn) -> dict[str, Any]:
    kw = dict(logits_soft_cap=attn.logits_soft_cap,
              sinks=None if attn.sinks is None else attn.sinks[...])
    if attn.mask is None:
        kw["sliding_window"] = getattr(attn, "sliding_window", None)
    else:
        kw["mask"] = attn.mask
    return kw


# -- prefill ---------------------------------------------------------------------------------

def _prefill_attention(attn, h, positions, segment_ids, out: dict):
    """`AttentionBlock.__call__` that also leaves the layer's cache entry [B, L, ...] in
    `out`."""
    check_call(attn, h, positions, segment_ids)
    with jax.named_scope(attn.block_name):
        h = attn.partitioner.constrain(h, ACT, SCOPE)
        q, k, v = attn.project(h)
        q, k = attn.apply_rope(q, k, positions)
        o = attn.attend(q, k, v, positions=positions, segment_ids=segment_ids)
        if isinstance(attn, MLA):  # k is the rotated shared key [B, L, 1, Hr], v the latent
            latent_pe = jnp.concatenate([v, k[:, :, 0].astype(v.dtype)], -1)
            out["entry"] = {"latent_pe": latent_pe[:, None]}  # [B, 1, L, Rkv + Hr]
        else:  # heads before slots, as the cache keeps them
            out["entry"] = {"k": jnp.swapaxes(k, 1, 2), "v": jnp.swapaxes(v, 1, 2)}
        return attn.out(o)


def _prefill_positions(segment_ids):
    """Left-padded rows' segment ids [B, L] -> positions counting each row's tokens from 0."""
    return jnp.maximum(jnp.cumsum(segment_ids, axis=1) - 1, 0).astype(jnp.int32)


def _prefill_layers(layers, x, positions, segment_ids, *, dtype, max_length: int):
    """Run ``layers`` (entries of ``model.layers``, or an MTP module's layer) over ``x [B, L,
    D]``: (x, one cache entry per layer, ``[n, B, S_l, ...]`` with the prompt's slots filled:
    the first L, or in a ring of ``S_l < L`` slots the last ``S_l``; `KVCache.layers`)."""

    def layer_fn(layer, x, _):
        out = {}
        x, _ = layer.block(x, lambda h: _prefill_attention(layer.self_attn, h, positions,
                                                           segment_ids, out))
        return x, jax.tree.map(lambda a: a.astype(dtype), out["entry"])

    entries = []
    for group in layer_groups(layers):
        x, filled = _run_layers(group, x, [None] * len(group), [layer_fn] * len(group))
        for layer, entry in zip(group, filled):
            slots = cache_slots(layer.self_attn, max_length)
            entries.append({k: _fill(a, slots) for k, a in entry.items()})
    return x, tuple(entries)


def _prefill_cache(layers, positions, segment_ids, max_length: int) -> KVCache:
    grow = ((0, 0), (0, max_length - positions.shape[1]))
    return KVCache(layers, jnp.pad(positions, grow), jnp.pad(segment_ids, grow),
                   jnp.asarray(positions.shape[1], jnp.int32), positions[:, -1] + 1)


def _prefill(model, p: Partitioner, tokens, segment_ids, max_length: int):
    segment_ids = segment_ids.astype(jnp.int32)
    positions = _prefill_positions(segment_ids)
    x, layers = _prefill_layers(model.layers, model.embed_tokens(tokens), positions,
                                segment_ids, dtype=jnp.dtype(model.config.dtype),
                                max_length=max_length)
    logits = _logits(model, x[:, -1])
    return logits, _constrain_cache(_prefill_cache(layers, positions, segment_ids, max_length), p)


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
    graphdef, state = _split(model, unsharded=False)
    return _compiled(_prefill_jit, dict(graphdef=graphdef, p=model.partitioner,
                                        max_length=max_length), state, tokens, segment_ids)


# -- decode ----------------------------------------------------------------------------------

def _resharded(p: Partitioner, x, axes):
    """``x`` constrained to `axes` through a replicated layout: between a weight-derived
    sharding (over the embed or kv_lora axis) and the cache's batch sharding that is one
    all-gather of a small activation then a local slice; asked in one step, XLA's SPMD
    partitioner finds no collective for it and replicates the tensor itself, warning
    "Involuntary full rematerialization"."""
    return p.constrain(p.constrain(x, (None,) * x.ndim), _splittable(p, axes, x.shape))


def _decode_attention(attn, h, put, q_pos, kv_pos, kv_seg, p=UNSHARDED):
    """The step's T queries per row over the cache: ``put(name, new [B, K, T, F])`` writes
    this layer's new keys into the cache and returns the layer's ``[B, K, S, F]`` with them
    (`_cached_layers`). -> output [B, T, D]."""
    with jax.named_scope(attn.block_name):
        q, k, v = attn.project(h)
        q, k = attn.apply_rope(q, k, q_pos)
        q_seg = jnp.ones(q_pos.shape, jnp.int32)
        kw = dict(q_positions=q_pos, kv_positions=kv_pos, q_segment_ids=q_seg,
                  kv_segment_ids=kv_seg, scale=attn.scale, kv_heads_major=True,
                  **_score_kwargs(attn))
        if isinstance(attn, MLA):
            return _decode_mla(attn, q, k, v, put, kw, p)
        kv_axes = ("batch", "act_kv_heads", None, None)
        k, v = (_resharded(p, jnp.swapaxes(a, 1, 2), kv_axes) for a in (k, v))
        o = dot_product_attention(q, put("k", k), put("v", v), **kw)
        return attn.out(o.astype(q.dtype))


def _decode_mla(attn, q, k_pe, latent, put, kw, p=UNSHARDED):
    """Absorbed MLA: scores ``q_nope W_uk . latent + q_pe . k_pe``, output ``(p . latent)
    W_uv``, as one shared-key head of width Rkv + Hr over the cache."""
    Hn, R = attn.qk_nope_head_dim, attn.kv_lora_rank
    new = jnp.concatenate([latent, k_pe[:, :, 0].astype(latent.dtype)], -1)  # [B, T, Rkv+Hr]
    new = _resharded(p, new[:, None], ("batch", None, None, None))
    cache = put("latent_pe", new)  # [B, 1, S, Rkv + Hr]: one head shared by all
    dtype = attn.kv_b_proj.dtype or cache.dtype
    w = attn.kv_b_proj.kernel[...].astype(dtype)  # [Rkv, N, Hn + Hv]
    w_uk, w_uv = w[..., :Hn], w[..., Hn:]
    # weight-stationary: the product is split over kv_lora as w_uk is (FSDP) and moves to
    # the cache's batch sharding -- [B, 1, N, Rkv] is far smaller than w_uk
    q_lat = jnp.einsum("blnh,rnh->blnr", q[..., :Hn].astype(dtype), w_uk)
    q_lat = _resharded(p, q_lat, ("batch", None, "act_heads", None))
    q_abs = jnp.concatenate([q_lat, q[..., Hn:].astype(dtype)], -1)  # [B, 1, N, Rkv + Hr]
    kv = cache.astype(dtype)
    o_lat = dot_product_attention(q_abs, kv, kv[..., :R], **kw)  # [B, T, N, Rkv]
    o = jnp.einsum("blnr,rnv->blnv", o_lat, w_uv)
    return attn.out(o.astype(q.dtype))


def _cached_layers(layers, entries, x, q_pos, kv_pos, kv_seg, slot,
                   p: Partitioner = UNSHARDED):
    """Run ``layers`` over ``x [B, T, D]`` (queries at ``q_pos [B, T]``) from their cache
    ``entries``, writing the T new slots at ``slot``: (x, the updated entries).
    ``kv_pos``/``kv_seg`` are the cache's positions and segment ids with the new slots; a
    ring entry (fewer slots than they have) sees them through `_ring_view`.

    Layouts under `p` (the model's partitioner; the layers run their unsharded code, see
    `Decoder`, so nothing else states them): a step's activations are a few tokens, far
    smaller than the weights, so decode is weight-stationary -- the residual stream is split
    over ``embed`` as the FSDP-sharded weights are (`DECODE_RESIDUAL`), rather than every
    weight gathered each step -- while attention meets the cache in the cache's batch
    sharding: the new K/V (or latent) and MLA's absorbed query (split over ``kv_lora`` as
    ``kv_b_proj`` is) reach it through `_resharded`. Left implicit, XLA propagates the
    parameters' shardings into the activations and replicates them where they meet the
    cache."""
    S, T = kv_pos.shape[1], x.shape[1]
    views = {}
    for entry in entries:
        slots = next(iter(entry.values())).shape[SLOTS]
        if slots < S and slots not in views:
            if T > 1:  # the T-th write would evict a key the first query still sees
                raise ValueError(f"decoding {T} tokens a step (speculative decoding) over a "
                                 f"sliding-window ring cache of {slots} slots is not "
                                 f"supported; decode one token a step (speculative=None)")
            views[slots] = (*_ring_view(kv_pos, kv_seg, slot, slots), slot % slots)

    def layer_fn(entry):
        pos, seg, at = views.get(next(iter(entry.values())).shape[SLOTS],
                                 (kv_pos, kv_seg, slot))

        def fn(one, x, put):
            x, _ = one.block(x, lambda h: _decode_attention(one.self_attn, h, put, q_pos, pos,
                                                            seg, p))
            return _resharded(p, x, DECODE_RESIDUAL)
        return fn, at

    new = []
    x = _resharded(p, x, DECODE_RESIDUAL)
    entries, i = list(entries), 0
    if len(entries) != len(layers):
        raise ValueError(f"the cache holds {len(entries)} layer entries; the model has "
                         f"{len(layers)}")
    for group in layer_groups(layers):
        mine = entries[i:i + len(group)]
        x, out = _run_cached(group, x, mine, [layer_fn(e) for e in mine])
        new += out
        i += len(group)
    return x, tuple(new)


def _run_cached(group, x, entries, fns):
    """``fn(one_layer, x, put) -> x`` over a `layer_groups` entry and its cache `entries`
    (``{name: [n, B, K, S, F]}`` each; `fns` holds ``(fn, slot)`` per stack), which the loop
    over the stacks carries: ``put(name, new [B, K, T, F])`` writes the layer's new keys at
    its slot in place (`_put`) and returns the layer's ``[B, K, S, F]`` to attend over -- no
    layer's cache is sliced out and written back. Returns (x, [updated entry of each])."""

    def run(one, x, cache, i, fn, slot):
        cache = dict(cache)

        def put(name, new):
            cache[name], layer_keys = _put(cache[name], new, i, slot)
            return layer_keys

        return fn(one, x, put), cache

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
    kv_pos = _write(cache.positions, q_pos, slot)
    kv_seg = _write(cache.segment_ids, jnp.ones_like(q_pos), slot)
    x, layers = _cached_layers(model.layers, cache.layers, model.embed_tokens(tokens[:, None]),
                               q_pos, kv_pos, kv_seg, slot, p)
    logits = _logits(model, x[:, 0])
    cache = KVCache(layers, kv_pos, kv_seg, slot + 1, cache.next_positions + 1)
    return logits, _constrain_cache(cache, p)


@functools.partial(jax.jit, static_argnames=("graphdef", "p"), donate_argnames=("cache",))
def _decode_jit(state, cache, tokens, *, graphdef, p):
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
        self.graphdef, self.state = _split(model, unsharded=True)
        self.partitioner = model.partitioner

    def decode(self, cache: KVCache, tokens) -> tuple[jax.Array, KVCache]:
        return _compiled(_decode_jit, dict(graphdef=self.graphdef, p=self.partitioner),
                         self.state, cache, np.asarray(tokens, np.int32))


# -- compiled steps --------------------------------------------------------------------------

_COMPILED: dict[Any, Any] = {}
_STATS: dict[str, float] = {"compile_s": 0.0}


def _compiled(fn, static: dict[str, Any], *args):
    """``fn(*args, **static)`` through an executable compiled once per static values and
    argument shapes, dtypes and shardings (compile time goes to ``_STATS["compile_s"]``)."""
    leaves, tree = jax.tree.flatten(args)
    key = (fn, tuple(static.items()), tree,
           tuple((np.shape(a), getattr(a, "dtype", type(a)), getattr(a, "sharding", None))
                 for a in leaves))
    exe = _COMPILED.get(key)
    if exe is None:
        start = time.perf_counter()
        exe = fn.lower(*args, **static).compile()
        _STATS["compile_s"] += time.perf_counter() - start
        if len(_COMPILED) >= 32:
            _COMPILED.clear()
        _COMPILED[key] = exe
    return exe(*args)


# -- sampling --------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def _sample(logits, key, step, *, temperature: float, top_k: int | None,
            top_p: float | None):
    """logits [B, V] -> token ids [B] (greedy when temperature is 0)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, -1), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= top_p  # the most likely token is always kept
        drop = jnp.zeros_like(drop_sorted).at[
            jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(jax.random.fold_in(key, step), logits).astype(jnp.int32)


def _check_sampling(max_new_tokens, temperature, top_k, top_p, vocab: int):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be an int >= 0")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"generate: temperature={temperature!r} must be a number >= 0 "
                         f"(0: greedy)")
    if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise ValueError(f"generate: top_k={top_k!r} must be an int in [1, vocab={vocab}] or "
                         f"None")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"generate: top_p={top_p!r} must be in (0, 1] or None")


# -- generate --------------------------------------------------------------------------------

def _as_prompts(model, prompts, tokenizer) -> list[list[int]]:
    if tokenizer is not None:
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        prompts = [[int(t) for t in tokenizer.encode(text)] for text in texts]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("generate: prompts must be a non-empty list of token-id lists (or of "
                         "strings, with tokenizer=)")
    V = model.config.vocab_size
    out = []
    for i, ids in enumerate(prompts):
        ids = [int(t) for t in np.asarray(ids).ravel()] if not isinstance(ids, str) else None
        if ids is None:
            raise ValueError("generate: prompts are text; pass tokenizer= to encode them")
        if not ids:
            raise ValueError(f"generate: prompt {i} is empty; give it at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"generate: prompt {i} holds ids {bad[:5]} outside the "
                             f"vocabulary [0, {V})")
        out.append(ids)
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def generate_with_logits(model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                         stop: int | Sequence[int] | None = None, tokenizer=None,
                         stats: dict[str, Any] | None = None
                         ) -> tuple[list[list[int]], list[np.ndarray]]:
    """`generate`'s token ids and, per prompt, the float32 logits each new token was drawn
    from (``[n_i, V]``); always token ids, even with a tokenizer. ``stats``, a dict, receives
    the seconds spent compiling, in prefill and in the decode steps (compilation excluded),
    their token counts and the cache's bytes per token."""
    return _generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_k=top_k, top_p=top_p, seed=seed, stop=stop, tokenizer=tokenizer,
                     stats=stats, keep_logits=True)


def _pad_prompts(model, ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ``tokens [B, L]`` and ``segment_ids`` (1 on tokens) with B and L rounded up
    to what the model's partitioner divides: every row's last token in the last slot."""
    from zoo.models.decoder import nominal_inputs_shape
    nb, nl = nominal_inputs_shape(model.partitioner)
    B, L = _round_up(len(ids), nb), _round_up(max(map(len, ids)), nl)
    tokens = np.zeros((B, L), np.int32)
    segs = np.zeros((B, L), np.int32)
    for i, row in enumerate(ids):
        tokens[i, L - len(row):], segs[i, L - len(row):] = row, 1
    return tokens, segs


def _checked_prompts(model, prompts, tokenizer, max_new_tokens, temperature, top_k, top_p,
                     stop) -> tuple[list[list[int]], set[int]]:
    """(prompt ids, stop ids) after checking the sampling arguments and the model's room."""
    ids = _as_prompts(model, prompts, tokenizer)
    _check_sampling(max_new_tokens, temperature, top_k, top_p, model.config.vocab_size)
    stops = set() if stop is None else {int(stop)} if isinstance(stop, (int, np.integer)) \
        else {int(s) for s in stop}
    longest = max(map(len, ids))
    limit = model.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(f"generate: the longest prompt ({longest} tokens) plus max_new_tokens="
                         f"{max_new_tokens} exceeds the model's {limit} positions "
                         f"(max_position_embeddings); shorten the prompt or generate fewer")
    return ids, stops


def _generate(model, prompts, *, max_new_tokens, temperature, top_k, top_p, seed, stop,
              tokenizer, stats, keep_logits: bool):
    ids, stops = _checked_prompts(model, prompts, tokenizer, max_new_tokens, temperature,
                                  top_k, top_p, stop)
    V = model.config.vocab_size
    n = len(ids)
    if max_new_tokens == 0:
        return [[] for _ in ids], [np.zeros((0, V), np.float32) for _ in ids]
    tokens, segs = _pad_prompts(model, ids)
    B, L = tokens.shape
    compile_before = _STATS["compile_s"]
    start = time.perf_counter()
    # a length the context axes divide, so the cache's slots shard as prefill made them
    max_length = _round_up(L + max_new_tokens - 1, model.partitioner.size("length", SCOPE))
    logits, cache = prefill(model, tokens, segs, max_length=max_length)
    jax.block_until_ready(logits)
    prefill_compile = _STATS["compile_s"] - compile_before
    prefill_s = time.perf_counter() - start - prefill_compile
    key = jax.random.key(seed)
    sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
    decoder = Decoder(model)
    out: list[list[int]] = [[] for _ in ids]
    kept: list[list[np.ndarray]] = [[] for _ in ids]
    done = np.zeros(n, bool)
    start, steps, host = time.perf_counter(), 0, None
    for step in range(max_new_tokens):
        if step:
            logits, cache = decoder.decode(cache, host)
            steps += 1
        host = np.asarray(_compiled(_sample, sampling, logits, key, np.int32(step)))
        host_logits = np.asarray(logits) if keep_logits else None
        for i in np.flatnonzero(~done):
            out[i].append(int(host[i]))
            if keep_logits:
                kept[i].append(host_logits[i])
            done[i] = int(host[i]) in stops
        if done.all():
            break
    if stats is not None:  # seconds without compilation
        compile_s = _STATS["compile_s"] - compile_before
        stats.update(compile_s=compile_s, prefill_tokens=sum(map(len, ids)),
                     prefill_s=prefill_s, decode_steps=steps,
                     decode_s=time.perf_counter() - start - (compile_s - prefill_compile),
                     batch=n, padded_shape=(B, L), cache_bytes_per_token=cache.bytes_per_token())
    return out, [np.stack(rows) if rows else np.zeros((0, V), np.float32) for rows in kept]


def generate(model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             stop: int | Sequence[int] | None = None, tokenizer=None,
             speculative: str | None = None):
    """Each prompt's continuation (prompt excluded) from `model` (any family, scanned or
    unrolled, sharded or not).

    Args:
      prompts: a list of token-id lists of any lengths (or, with ``tokenizer``, of strings,
        or one string).
      max_new_tokens: tokens per prompt; exactly this many when ``stop`` is None.
      temperature: 0 for greedy; else logits are divided by it and sampled.
      top_k, top_p: keep the k most likely tokens, then the smallest set with probability
        mass >= top_p (None: off).
      seed: the sampling key; the same seed gives the same tokens.
      stop: token id(s) that end a row's continuation (included in it).
      tokenizer: with ``encode``/``decode`` (e.g. `zoo.data.ByteTokenizer`): prompts are text
        and the continuations come back as text (one string for one string).
      speculative: ``"mtp"``: greedy speculative decoding, the model's multi-token-prediction
        module drafting one token that the model verifies (`zoo.speculative`; the same tokens
        as plain greedy decoding; `zoo.speculative.generate_speculative` also returns the
        acceptance statistics). Needs ``temperature=0`` and a model with MTP.

    Returns a list (one per prompt) of token-id lists, or of strings with a tokenizer.
    """
    if speculative is not None:
        from zoo.speculative import generate_speculative
        return generate_speculative(model, prompts, max_new_tokens=max_new_tokens,
                                    temperature=temperature, stop=stop, tokenizer=tokenizer,
                                    speculative=speculative)[0]
    ids, _ = _generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=seed, stop=stop, tokenizer=tokenizer,
                       stats=None, keep_logits=False)
    if tokenizer is None:
        return ids
    texts = [tokenizer.decode(row) for row in ids]
    return texts[0] if isinstance(prompts, str) else texts


# -- command line ----------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zoo.generate`` (`zoo.generate_cli`): 0 on success, 2 on bad input."""
    from zoo import generate_cli
    return generate_cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
