"""The work causal context-parallel attention does on each shard, counted as its kernels count it.

A row of ``L`` tokens is split into ``cp`` shards of ``n = L/cp`` consecutive tokens (after any
reordering). Each shard's queries meet the keys of the whole row: the ring brings every other
shard's block in turn; the all-gather strategy gathers them (the same tiles when ``n`` is a
multiple of the tile). Two measures per shard:

* `shard_pairs` -- (query, key) pairs the causal document mask allows: what an ideal kernel
  does. A query at position ``p`` of its document sees ``p + 1`` keys.
* `shard_tiles` -- (query tile, key tile) pairs the flash kernel does *not* skip: what zoo's
  kernels (`zoo.ops.flash`, `zoo.ops.ring`) actually compute. The shard's local ``n`` queries
  are cut into tiles of ``t = tile_size(n, tile)`` (the largest divisor of ``n`` not above
  ``tile``), and so is every shard's block of keys. A tile pair is skipped by the kernels' own
  rule (`zoo.ops.masks.block_may_attend`): from min/max only, it is kept when the two tiles'
  non-padding segment-id ranges overlap and the smallest key position is not above the largest
  query position. That rule is conservative -- a query tile holding the end of document 3 and
  the start of document 7 keeps every key tile of documents 3..7 whose positions start low
  enough -- so the count can exceed the tiles an exact mask would need, and layouts that keep a
  shard's documents in consecutive ids pay less for it.

`TILE` (64) is the default tile of zoo's flash kernel on CPU (``zoo.ops.flash.CPU_TILES``);
pass the kernel's tile when it differs. The kernels skip a tile only when it is empty for every
row of the local batch; both counts here are per row (one row per device), the cost the data
pipeline can steer. Sliding windows are not modelled (causal document masks only).

Legend: B rows, L row length, cp shards, n = L/cp tokens per shard, T = L/t tiles per row.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TILE", "tile_size", "tile_map", "shard_tiles", "shard_pairs"]

TILE = 64  # zoo's flash kernel default on CPU (zoo.ops.flash.CPU_TILES = (64, 64))
_BIG = np.iinfo(np.int32).max


def tile_size(n: int, target: int) -> int:
    """Largest divisor of ``n`` that is ``<= target`` (the kernels' rule: tiles cover exactly)."""
    t = max(1, min(int(n), int(target)))
    while n % t:
        t -= 1
    return t


def _rows(positions, segment_ids, cp: int) -> tuple[np.ndarray, np.ndarray]:
    positions = np.asarray(positions, np.int32)
    segment_ids = np.asarray(segment_ids, np.int32)
    if positions.ndim == 1:
        positions, segment_ids = positions[None], segment_ids[None]
    if positions.shape != segment_ids.shape or positions.ndim != 2:
        raise ValueError(f"positions {positions.shape} and segment_ids {segment_ids.shape} must "
                         "both be [B, L] (or [L])")
    if positions.shape[1] % cp:
        raise ValueError(f"row length {positions.shape[1]} is not divisible by cp={cp}: every "
                         "context shard holds L/cp tokens")
    return positions, segment_ids


def _tile_bounds(positions, segment_ids, t):
    """Per tile [B, T]: min/max of non-padding segment ids and positions (kernel sentinels)."""
    B, L = positions.shape
    seg = segment_ids.reshape(B, L // t, t)
    pos = positions.reshape(B, L // t, t)
    valid = seg != 0
    return (np.where(valid, seg, _BIG).min(-1), np.where(valid, seg, 0).max(-1),
            np.where(valid, pos, _BIG).min(-1), np.where(valid, pos, -_BIG).max(-1))  # as masks.py


def tile_map(positions, segment_ids, cp: int, tile: int | None = None) -> np.ndarray:
    """bool [B, T, T]: query tile i meets key tile j (not skipped); tiles in row order."""
    positions, segment_ids = _rows(positions, segment_ids, cp)
    t = tile_size(positions.shape[1] // cp, TILE if tile is None else tile)
    s_lo, s_hi, p_lo, p_hi = _tile_bounds(positions, segment_ids, t)
    ok = (s_lo[:, :, None] <= s_hi[:, None, :]) & (s_lo[:, None, :] <= s_hi[:, :, None])
    return ok & (p_lo[:, None, :] <= p_hi[:, :, None])  # causal: some key not after all queries


def shard_tiles(positions, segment_ids, cp: int, tile: int | None = None) -> np.ndarray:
    """int [B, cp]: tile pairs each shard's kernels compute (see the module docstring)."""
    per_q_tile = tile_map(positions, segment_ids, cp, tile).sum(-1)  # [B, T]
    return per_q_tile.reshape(per_q_tile.shape[0], cp, -1).sum(-1)


def shard_pairs(positions, segment_ids, cp: int) -> np.ndarray:
    """int [B, cp]: allowed causal (query, key) pairs per shard: a query sees the keys of its
    document at positions up to its own (positions are distinct within a document)."""
    positions, segment_ids = _rows(positions, segment_ids, cp)
    B, L = positions.shape
    seen = np.zeros((B, L), np.int64)
    for b in range(B):
        order = np.lexsort((positions[b], segment_ids[b]))
        seg = segment_ids[b, order]
        first = np.r_[True, seg[1:] != seg[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(L), 0))
        seen[b, order] = np.where(seg != 0, np.arange(L) - start + 1, 0)
    return seen.reshape(B, cp, L // cp).sum(-1)
