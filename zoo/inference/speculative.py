"""Speculative decoding with a model's multi-token-prediction (MTP) module (DeepSeek-V3,
V3.2, GLM-5, V4: `CausalLM.speculative_support`).

* The MTP module at position ``i`` reads the trunk's hidden state ``h_i`` (before the final
  norm) and the embedding of token ``i + 1``, and predicts token ``i + 2``: after the model has
  chosen token ``p + 1`` from position ``p``, the module drafts token ``p + 2`` for free.
* Prefill runs the prompts through the trunk, takes the greedy first token ``t``, then runs
  the MTP layer over the prompt's hidden states with the shifted embeddings (the prompt's
  next tokens, ``t`` last), filling the MTP layer's own KV cache and drafting ``d``. The
  model says how its MTP layer meets the trunk's stream (``model.draft_input(stream,
  ahead)``, ``model.draft_hidden(x)``: DeepSeek-V4's MTP reads the hyper-connection streams
  and has its own hyper head).
* Each step (one compiled program) verifies: the model runs over 2 positions from its cache,
  the last accepted token ``t`` at ``p`` and the draft ``d`` at ``p + 1``; its greedy choices
  ``g1`` (for ``p + 1``) and ``g2`` (for ``p + 2``). ``d == g1``: both are kept (2 tokens),
  else ``g1`` alone (1 token). The MTP layer runs over the same 2 positions with the
  embeddings of ``[g1, g2]`` and drafts the next token from the last accepted position.
* Rows advance apart: the cache's ``length`` is per row ``[B]``; each step writes its 2 slots
  at the row's length, the row's length and positions advance by the tokens accepted, and a
  rejected slot's segment id is set to 0 (invisible to every later query; the next step
  overwrites it). Finished rows stop advancing.
* A layer whose cache is a state rather than slots (DeepSeek-V4's compressed attention: the
  sliding window, the compressor's open window and carried overlap, the compressed entries
  and index keys) cannot mask a token out: it takes the step's 2 tokens in turn
  (``replaces_state_per_token``), `cached_layers` keeps its state after the first, and a row
  whose draft is rejected takes that one (`kept_states`, per row over each array's batch
  axis). One forward pass still verifies.
* Greedy only: ``temperature > 0`` is refused (rejection sampling is not implemented).
  Only the first MTP module drafts (one token ahead) when the model has more.
* `generate_speculative(model, prompts, ...) -> (tokens, SpeculativeStats)`;
  `zoo.inference.generate`'s ``generate(..., speculative="mtp")`` returns the tokens alone.

Legend: B batch, L prompt length, S cache length, D embed, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.inference.cache import KVCache, constrain_cache, write
from zoo.inference.engine import (cached_layers, compiled, filled_cache, final_logits,
                                  inference_split, prefill_layers, prefill_positions)
from zoo.inference.prompts import checked_prompts, decoded, pad_prompts
from zoo.partitioning import Partitioner

__all__ = ["SpeculativeStats", "check_speculative", "generate_speculative", "kept_states",
           "verify_jit"]


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """What speculative decoding did for one batch.

    Attributes:
      rows: prompts in the batch.
      steps: verify steps (one model forward over 2 positions, plus the MTP layer).
      drafted: drafts checked (one per unfinished row per step).
      accepted: drafts the model's greedy choice agreed with.
      tokens: new tokens returned, all rows (``rows + drafted + accepted - discarded``).
      discarded: tokens produced past a row's end (``max_new_tokens`` or a stop id).
      plain_forward_passes: model forward passes plain greedy decoding needs for the same
        tokens (the prefill, then one decode step per token after the first).
    """

    rows: int
    steps: int
    drafted: int
    accepted: int
    tokens: int
    discarded: int
    plain_forward_passes: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def forward_passes(self) -> int:
        """The prefill and the verify steps."""
        return 1 + self.steps

    @property
    def speedup(self) -> float:
        """Plain greedy decoding's forward passes over these."""
        return self.plain_forward_passes / self.forward_passes

    def __str__(self) -> str:
        return (f"speculative (mtp): {self.accepted}/{self.drafted} drafts accepted "
                f"({self.acceptance_rate:.1%}); {self.forward_passes} forward passes against "
                f"{self.plain_forward_passes} ({self.speedup:.2f}x fewer)")


def check_speculative(model, speculative, temperature) -> None:
    """Refuse what speculative decoding cannot do, naming the fix."""
    if speculative != "mtp":
        raise ValueError(f"generate: speculative={speculative!r} is not a drafting method; "
                         f"pass speculative='mtp' or None")
    refusal = model.speculative_support()
    if refusal:
        raise ValueError(f"generate: speculative='mtp': {refusal}; or pass speculative=None")
    if temperature != 0:
        raise ValueError(f"generate: speculative='mtp' is greedy only (temperature="
                         f"{temperature!r}; rejection sampling is not implemented); pass "
                         f"temperature=0 or speculative=None")


def _per_row(cache: KVCache, p: Partitioner) -> KVCache:
    length = jnp.full((cache.batch,), cache.length, jnp.int32)
    return dataclasses.replace(cache, length=p.constrain(length, ("batch",)))


def _prefill(model, p: Partitioner, tokens, segment_ids, max_length: int):
    """-> (first tokens [B], drafts [B], model cache, MTP cache), both caches per-row."""
    segment_ids = segment_ids.astype(jnp.int32)
    positions = prefill_positions(segment_ids)
    kw = dict(dtype=jnp.dtype(model.config.dtype), max_length=max_length)
    x, layer_kwargs = model.stream_in(tokens)
    x, layers = prefill_layers(model.layers, x, positions, segment_ids,
                               layer_kwargs=layer_kwargs, **kw)
    h = model.stream_out(x)
    first = jnp.argmax(final_logits(model, h[:, -1]), -1).astype(jnp.int32)
    ahead = jnp.concatenate([tokens[:, 1:], first[:, None]], axis=1)  # token i + 1 at i
    mtp = model.mtp[0]
    xm, mtp_kwargs = model.draft_input(x, ahead)
    hm, mtp_layers = prefill_layers([mtp.layer], xm, positions, segment_ids,
                                    layer_kwargs=mtp_kwargs, **kw)
    hm = model.draft_hidden(hm[:, -1:])[:, 0]
    draft = jnp.argmax(final_logits(model, hm, mtp.norm), -1).astype(jnp.int32)
    caches = [_per_row(constrain_cache(filled_cache(owners, e, positions, segment_ids,
                                                    max_length), p), p)
              for owners, e in ((model.layers, layers), ([mtp.layer], mtp_layers))]
    return first, draft, *caches


@functools.partial(jax.jit, static_argnames=("graphdef", "p", "max_length"))
def _prefill_jit(state, tokens, segment_ids, *, graphdef, p, max_length):
    return _prefill(nnx.merge(graphdef, state), p, tokens, segment_ids, max_length)


def _verify(model, p: Partitioner, cache: KVCache, mtp_cache: KVCache, tokens, drafts,
            active):
    """tokens, drafts, active [B] -> (greedy choices [B, 2], accepted [B], next tokens [B],
    next drafts [B], model cache, MTP cache)."""
    slot = cache.length  # [B]
    q_pos = cache.next_positions[:, None] + jnp.arange(2, dtype=jnp.int32)  # [B, 2]
    kv_pos = write(cache.positions, q_pos, slot)
    kv_seg = write(cache.segment_ids, jnp.ones_like(q_pos), slot)
    x, layer_kwargs = model.stream_in(jnp.stack([tokens, drafts], axis=1))
    x, layers, firsts = cached_layers(model.layers, cache.layers, x, q_pos, kv_pos, kv_seg,
                                      slot, p, layer_kwargs=layer_kwargs, first_states=True)
    h = model.stream_out(x)
    choice = jnp.argmax(final_logits(model, h), -1).astype(jnp.int32)  # [B, 2]
    accept = (choice[:, 0] == drafts) & active
    mtp = model.mtp[0]
    xm, mtp_kwargs = model.draft_input(x, choice)
    hm, mtp_layers, mtp_firsts = cached_layers(
        [mtp.layer], mtp_cache.layers, xm, q_pos, kv_pos, kv_seg, slot, p,
        layer_kwargs=mtp_kwargs, first_states=True)
    guess = jnp.argmax(final_logits(model, model.draft_hidden(hm), mtp.norm),
                       -1).astype(jnp.int32)  # [B, 2]
    advance = jnp.where(active, 1 + accept.astype(jnp.int32), 0)
    seen = (jnp.arange(2)[None] < advance[:, None]).astype(jnp.int32)  # rejected: segment 0
    kv_seg = write(cache.segment_ids, seen, slot)

    def new(c, entries, firsts):
        entries = kept_states(entries, firsts, c.axes, advance < 2)
        c = KVCache(entries, kv_pos, kv_seg, slot + advance, cache.next_positions + advance,
                    axes=c.axes)
        c = constrain_cache(c, p)
        return dataclasses.replace(c, length=p.constrain(c.length, ("batch",)))

    nxt = jnp.where(accept, choice[:, 1], choice[:, 0])
    draft = jnp.where(accept, guess[:, 1], guess[:, 0])
    return (choice, accept, nxt, draft, new(cache, layers, firsts),
            new(mtp_cache, mtp_layers, mtp_firsts))


def kept_states(entries, firsts, axes, rows):
    """The cache entries after a verify step: each state array (``firsts``, from
    `cached_layers`' ``first_states``) as it was after the step's first token in ``rows
    [B]`` (a rejected draft, or a finished row), after both elsewhere; the batch axis of each
    array is where its logical axes (`KVCache.axes`) name ``"batch"``."""
    out = []
    for entry, first, names in zip(entries, firsts, axes, strict=True):
        names = dict(names)
        entry = dict(entry)
        for k, a in first.items():
            shape = [1] * a.ndim
            shape[names[k].index("batch")] = -1
            entry[k] = jnp.where(rows.reshape(shape), a, entry[k])
        out.append(entry)
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("graphdef", "p"),
                   donate_argnames=("cache", "mtp_cache"))
def verify_jit(state, cache, mtp_cache, tokens, drafts, active, *, graphdef, p):
    """The compiled verify step (`_verify`) on a split inference view."""
    return _verify(nnx.merge(graphdef, state), p, cache, mtp_cache, tokens, drafts, active)


def generate_speculative(model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
                         stop: int | Sequence[int] | None = None, tokenizer=None,
                         speculative: str = "mtp"
                         ) -> tuple[list[list[int]], SpeculativeStats]:
    """`zoo.inference.generate`'s greedy continuations (the same tokens, the same arguments;
    text with a tokenizer) through MTP drafts verified by the model, and the
    `SpeculativeStats`. Refuses models without MTP and ``temperature > 0``."""
    ids, stops = checked_prompts(model, prompts, tokenizer, max_new_tokens, temperature,
                                 None, None, stop)
    check_speculative(model, speculative, temperature)
    n = len(ids)
    if max_new_tokens == 0:
        empty = SpeculativeStats(n, 0, 0, 0, 0, 0, 0)
        return decoded([[] for _ in ids], prompts, tokenizer), empty
    tokens, segs = pad_prompts(model, ids)
    B, L = tokens.shape
    p = model.partitioner
    graphdef, state = inference_split(model, unsharded=False)
    first, draft, cache, mtp_cache = compiled(
        _prefill_jit, dict(graphdef=graphdef, p=p, max_length=L + max_new_tokens + 1), state,
        jnp.asarray(tokens), jnp.asarray(segs))
    graphdef, state = inference_split(model, unsharded=True)
    out = [[int(t)] for t in np.asarray(first)[:n]]
    done = np.array([len(row) >= max_new_tokens or row[-1] in stops for row in out] +
                    [True] * (B - n))
    token, draft = np.asarray(first), np.asarray(draft)
    steps = drafted = accepted = discarded = 0
    while not done.all():
        active = ~done
        choice, accept, token, draft, cache, mtp_cache = compiled(
            verify_jit, dict(graphdef=graphdef, p=p), state, cache, mtp_cache, token, draft,
            active)
        choice, accept = np.asarray(choice), np.asarray(accept)
        token, draft = np.asarray(token), np.asarray(draft)
        steps += 1
        for i in np.flatnonzero(active):
            drafted += 1
            accepted += int(accept[i])
            for t in choice[i, :1 + int(accept[i])]:
                if done[i]:
                    discarded += 1
                    continue
                out[i].append(int(t))
                done[i] = len(out[i]) >= max_new_tokens or int(t) in stops
    stats = SpeculativeStats(rows=n, steps=steps, drafted=drafted, accepted=accepted,
                             tokens=sum(map(len, out)), discarded=discarded,
                             plain_forward_passes=max(map(len, out)))
    return decoded(out, prompts, tokenizer), stats
