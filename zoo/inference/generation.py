"""`generate`: prompts in, continuations out, through `prefill`, `Decoder` and `sample`.

* Prompts of any lengths share a batch: they are left-padded (segment 0) to a length and
  batch the partitioner divides (`pad_prompts`), each row's positions starting at 0.
* Sampling: greedy (``temperature=0``), or temperature, then top-k, then top-p on the scaled
  logits (`zoo.inference.sampling`); ``stop`` ids end a row (the stop id is kept).
* ``speculative="mtp"``: the model's MTP module drafts a token per step and the model
  verifies it (`zoo.inference.speculative`), with plain greedy decoding's tokens.
* `run` is `generate` with the figures (seconds compiling, in prefill, in the decode steps,
  the cache's bytes per token) the command line prints.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from zoo.inference.engine import STATS, Decoder, compiled, prefill
from zoo.inference.prompts import checked_prompts, decoded, pad_prompts, round_up
from zoo.inference.sampling import sample
from zoo.inference.speculative import generate_speculative
from zoo.layers.attention import SCOPE
from zoo.partitioning import host_value

__all__ = ["generate", "generate_with_logits", "run"]


def run(model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
        top_k: int | None = None, top_p: float | None = None, seed: int = 0,
        stop: int | Sequence[int] | None = None, tokenizer=None,
        stats: dict[str, Any] | None = None, keep_logits: bool = False
        ) -> tuple[list[list[int]], list[np.ndarray]]:
    """`generate`'s token ids (always ids) and, with `keep_logits`, per prompt the float32
    logits each new token was drawn from (``[n_i, V]``; else empty). ``stats``, a dict,
    receives the seconds spent compiling, in prefill and in the decode steps (compilation
    excluded), their token counts and the cache's bytes per token (zeros when
    ``max_new_tokens`` is 0: nothing runs)."""
    ids, stops = checked_prompts(model, prompts, tokenizer, max_new_tokens, temperature,
                                 top_k, top_p, stop, seed)
    V = model.config.vocab_size
    n = len(ids)
    if max_new_tokens == 0:
        if stats is not None:
            stats.update(compile_s=0.0, prefill_tokens=0, prefill_s=0.0, decode_steps=0,
                         decode_s=0.0, batch=n, padded_shape=(0, 0), cache_bytes_per_token=0)
        return [[] for _ in ids], [np.zeros((0, V), np.float32) for _ in ids]
    tokens, segs = pad_prompts(model, ids)
    B, L = tokens.shape
    compile_before = STATS["compile_s"]
    start = time.perf_counter()
    # a length the context axes divide, so the cache's slots shard as prefill made them
    max_length = round_up(L + max_new_tokens - 1, model.partitioner.size("length", SCOPE))
    logits, cache = prefill(model, tokens, segs, max_length=max_length)
    jax.block_until_ready(logits)
    prefill_compile = STATS["compile_s"] - compile_before
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
        host = host_value(compiled(sample, sampling, logits, key, np.int32(step)))
        host_logits = host_value(logits) if keep_logits else None
        for i in np.flatnonzero(~done):
            out[i].append(int(host[i]))
            if keep_logits:
                kept[i].append(host_logits[i])
            done[i] = int(host[i]) in stops
        if done.all():
            break
    if stats is not None:  # seconds without compilation
        compile_s = STATS["compile_s"] - compile_before
        stats.update(compile_s=compile_s, prefill_tokens=sum(map(len, ids)),
                     prefill_s=prefill_s, decode_steps=steps,
                     decode_s=time.perf_counter() - start - (compile_s - prefill_compile),
                     batch=n, padded_shape=(B, L), cache_bytes_per_token=cache.bytes_per_token())
    return out, [np.stack(rows) if rows else np.zeros((0, V), np.float32) for rows in kept]


def generate_with_logits(model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                         stop: int | Sequence[int] | None = None, tokenizer=None,
                         stats: dict[str, Any] | None = None
                         ) -> tuple[list[list[int]], list[np.ndarray]]:
    """`generate`'s token ids and, per prompt, the float32 logits each new token was drawn
    from (``[n_i, V]``); always token ids, even with a tokenizer. ``stats``, a dict, receives
    the seconds spent compiling, in prefill and in the decode steps (compilation excluded),
    their token counts and the cache's bytes per token."""
    return run(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
               top_k=top_k, top_p=top_p, seed=seed, stop=stop, tokenizer=tokenizer,
               stats=stats, keep_logits=True)


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
      temperature: 0 for greedy; else logits are divided by it and sampled (a finite number).
      top_k, top_p: keep the k most likely tokens, then the smallest set with probability
        mass >= top_p (None: off).
      seed: the sampling key; the same seed gives the same tokens.
      stop: token id(s) that end a row's continuation (included in it).
      tokenizer: with ``encode``/``decode`` (e.g. `zoo.data.ByteTokenizer`): prompts are text
        and the continuations come back as text (one string for one string).
      speculative: ``"mtp"``: greedy speculative decoding, the model's multi-token-prediction
        module drafting one token that the model verifies (`zoo.inference.speculative`; the
        same tokens as plain greedy decoding; `generate_speculative` also returns the
        acceptance statistics). Needs ``temperature=0`` and a model with MTP.

    Returns a list (one per prompt) of token-id lists, or of strings with a tokenizer.
    Arguments out of range (NaN and infinities included) raise a `ValueError` naming them.
    """
    if speculative is not None:
        return generate_speculative(model, prompts, max_new_tokens=max_new_tokens,
                                    temperature=temperature, stop=stop, tokenizer=tokenizer,
                                    speculative=speculative)[0]
    ids, _ = run(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                 top_k=top_k, top_p=top_p, seed=seed, stop=stop, tokenizer=tokenizer)
    return decoded(ids, prompts, tokenizer)
