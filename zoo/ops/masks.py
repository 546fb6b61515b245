"""Attention masks from positions and segment ids -- never from array indices.

A query sees a key iff
  * both carry the same non-zero segment id (segment 0 is padding: it sees nothing and is seen
    by nothing),
  * ``causal``: key position <= query position,
  * ``sliding_window=W``: query position - key position < W.

Because the rule reads the tokens' original positions, it stays exact after any reordering of
the sequence (load-balanced context parallelism permutes chunks of it).

`attention_mask` builds the dense [B, L, S] mask (reference, small tiles); `block_may_attend`
is the cheap block-level test (from min/max of positions and segment ids) the ring and the
tiled kernels use to skip (query block, key block) pairs the mask empties.

Legend: B batch, L query length, S key length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max


def attention_mask(q_positions: jax.Array, kv_positions: jax.Array,
                   q_segment_ids: jax.Array | None = None,
                   kv_segment_ids: jax.Array | None = None, *, causal: bool = True,
                   sliding_window: int | None = None) -> jax.Array:
    """Boolean mask [B, L, S]: True where query l may attend to key s.

    ``*_segment_ids=None`` means one document with no padding (all ids 1).
    """
    qp = q_positions[:, :, None]
    kp = kv_positions[:, None, :]
    if q_segment_ids is None:
        q_segment_ids = jnp.ones(q_positions.shape, jnp.int32)
    if kv_segment_ids is None:
        kv_segment_ids = jnp.ones(kv_positions.shape, jnp.int32)
    qs = q_segment_ids[:, :, None]
    ks = kv_segment_ids[:, None, :]
    mask = (qs == ks) & (qs != 0)
    if causal:
        mask &= kp <= qp
    if sliding_window is not None:
        mask &= (qp - kp) < sliding_window
    return mask


def segment_range(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row (min, max) of the non-zero segment ids, [B] each; (BIG, 0) for an all-padding row."""
    valid = segment_ids != 0
    lo = jnp.min(jnp.where(valid, segment_ids, _BIG), axis=-1)
    hi = jnp.max(jnp.where(valid, segment_ids, 0), axis=-1)
    return lo, hi


def position_range(positions: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row (min, max) of the positions of non-padding tokens, [B] each."""
    valid = segment_ids != 0
    lo = jnp.min(jnp.where(valid, positions, _BIG), axis=-1)
    hi = jnp.max(jnp.where(valid, positions, -_BIG), axis=-1)
    return lo, hi


def block_may_attend(q_positions: jax.Array, kv_positions: jax.Array, q_segment_ids: jax.Array,
                     kv_segment_ids: jax.Array, *, causal: bool,
                     sliding_window: int | None) -> jax.Array:
    """Scalar bool: False only if the mask between the two blocks is certainly all False.

    Conservative (True may still mean an empty mask), cheap (min/max per row), and exact enough
    to skip the upper triangle of a causal mask, windows that have slid past, and blocks whose
    documents do not overlap or that are pure padding.
    """
    qs_lo, qs_hi = segment_range(q_segment_ids)
    ks_lo, ks_hi = segment_range(kv_segment_ids)
    ok = (qs_lo <= ks_hi) & (ks_lo <= qs_hi)  # segment ranges overlap (False if either is padding)
    qp_lo, qp_hi = position_range(q_positions, q_segment_ids)
    kp_lo, kp_hi = position_range(kv_positions, kv_segment_ids)
    if causal:
        ok &= kp_lo <= qp_hi  # some key is not after every query
    if sliding_window is not None:
        # some query is within the window of some key: min over pairs of (q - k) < W.
        # Clamp the all-padding sentinels (+-int32 max) so the difference cannot overflow.
        lim = 2**30
        ok &= (jnp.clip(qp_lo, -lim, lim) - jnp.clip(kp_hi, -lim, lim)) < sliding_window
    return jnp.any(ok)
