"""Sampling and the checks on generation's arguments.

* `sample(logits, key, step, *, temperature, top_k, top_p)` -- greedy (``temperature=0``), or
  temperature, then top-k, then top-p (nucleus) on the scaled logits, drawn with
  ``jax.random.fold_in(key, step)``.
* `check_sampling` -- every number is finite and in range, refused with the value, the rule
  and the fix (`ValueError`, raised before anything compiles); the command line maps each
  argument to its flag (`FLAGS`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

__all__ = ["FLAGS", "check_sampling", "sample"]

# generate's arguments as the command line spells them
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
         "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
         "speculative": "--speculative"}


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(logits, key, step, *, temperature: float, top_k: int | None, top_p: float | None):
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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_sampling(max_new_tokens, temperature, top_k, top_p, vocab: int,
                   seed=0) -> None:
    """Refuse a generation argument that is not a finite number in its range (NaN and
    infinities included), naming it, the rule and the fix."""
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be an int >= 0 "
                         f"(the tokens to generate per prompt)")
    if not _is_number(temperature) or temperature < 0:
        raise ValueError(f"generate: temperature={temperature!r} must be a finite number >= 0 "
                         f"(0: greedy; e.g. 0.7 to sample)")
    if top_k is not None and (not _is_int(top_k) or not 1 <= top_k <= vocab):
        raise ValueError(f"generate: top_k={top_k!r} must be an int in [1, vocab={vocab}] or "
                         f"None (off)")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"generate: top_p={top_p!r} must be a number in (0, 1] or None (off)")
    if not _is_int(seed):
        raise ValueError(f"generate: seed={seed!r} must be an int (the sampling key)")
