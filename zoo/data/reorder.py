"""Load-balanced reordering of packed rows for causal context parallelism, and its inverse.

With causal attention split over ``cp`` shards of the sequence, a shard's work depends on which
tokens it holds: a query at position ``p`` of its document attends to ``p + 1`` keys. Every
strategy is a per-row permutation; attention masks come from the carried ``positions`` and
``segment_ids``, never from array indices, so *any* permutation is exact and the model never
un-permutes. Each shard holds ``L/cp`` consecutive tokens of the reordered row.

* ``"row"`` -- cut the row into ``2*cp`` chunks, shard ``r`` holds chunks ``r`` and
  ``2cp-1-r``. Balanced when the row is one document; with several documents per row the long
  ones decide the work and it is not.
* ``"document"`` -- every document (segment) is cut into ``2*cp`` near-equal pieces, shard
  ``r`` holds pieces ``r`` and ``2cp-1-r`` of *every* document: equal causal pairs per shard.
  Pieces differ by at most one token; the odd tokens rotate over the shards from one document
  to the next, so shards differ by at most one token of documents. Padding goes last in each
  shard. Short documents become pieces smaller than a kernel tile: pairs balance, tiles grow.
* ``"auto"`` (default) -- per row, the candidate with the fewest kernel tiles on the busiest
  shard (`zoo.data.work.shard_tiles`; ties: fewest tiles in total), among ``"row"``,
  ``"document"``, no reordering, and two hybrid families that split only the ``k`` longest
  documents into ``2*cp`` mirrored pieces (``k`` = 0, 1, 2, 3, 4, 6, 8, 12, 16) and keep the
  rest whole:
    - ``split{k}+row``: the other documents keep packing order and are cut like ``"row"`` into
      ``2*cp`` chunks sized to fill every shard (``k=0`` is ``"row"``);
    - ``split{k}+greedy``: the other documents stay whole, largest first, each on the shard
      with the least work that still has room (a document that fits nowhere is cut across the
      shards with room).
  By construction never worse than ``"row"`` or ``"document"`` in the busiest shard's tiles.
* ``"none"`` -- no reordering.

Inside a shard, tokens keep packing order (segment id, then position), so the kernels' min/max
tile test stays as tight as the layout allows and padding ends every shard.

`restore_order` inverts any strategy from the *reordered* batch's positions and segment ids:
sorting a row by (padding last, segment id, position) gives packing order back, as long as
segment ids number the documents of a row in packing order (1, 2, ...; padding 0 at the end),
which `zoo.data.text_dataset` guarantees. Padding tokens (all alike in a batch) keep their
relative order under every strategy but ``"row"``, which moves whole chunks; after ``"row"``
they come back in their balanced order (``"auto"`` re-sorts the padding of whichever candidate
it picks). Without positions it inverts ``"row"`` exactly.

``"row"`` works on numpy arrays and on jax arrays or tracers (static slices and one
concatenation, so under `jax.jit` it lowers to copies, not gathers). The other strategies read
the values of positions and segment ids: numpy (the data pipeline's side), or concrete jax
arrays. Without positions and segment ids a row is one document without padding, for which
``"document"`` and ``"auto"`` are exactly ``"row"``.

Example, ``cp=4``, one document of 16 tokens (chunks of 2), every strategy but "none"::

    0 1 | 14 15 | 2 3 | 12 13 | 4 5 | 10 11 | 6 7 | 8 9

Legend: B rows, L length (the reordered axis), ``m = 2*cp`` chunks, ``n = L/cp`` per shard.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from zoo.data import work

__all__ = ["STRATEGIES", "balance_permutation", "balance_candidates", "best_candidate",
           "load_balance", "restore_order", "chunk_order", "check_length"]

STRATEGIES = ("auto", "row", "document", "none")


def _check_cp(cp) -> int:
    if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"context_parallel={cp!r} must be a positive integer (1 = no reorder)")
    return int(cp)


def check_length(length: int, cp: int, what: str = "sequence length") -> None:
    """Raise a `ValueError` unless ``length`` splits into ``2*cp`` equal chunks (cp=1: any)."""
    cp = _check_cp(cp)
    if cp == 1:
        return
    m = 2 * cp
    if length % m == 0 and length > 0:
        return
    lower, upper = (length // m) * m, (length // m + 1) * m
    nearest = upper if lower == 0 or length - lower > upper - length else lower
    raise ValueError(
        f"{what} {length} is not divisible by 2*context_parallel = {m} (load-balanced "
        f"reordering cuts it into {m} equal chunks); the nearest valid length is {nearest}"
        + (f" (or {upper})" if nearest != upper else ""))


def chunk_order(cp: int) -> list[int]:
    """Chunk indices in load-balanced order: ``[0, 2cp-1, 1, 2cp-2, ..., cp-1, cp]``."""
    cp = _check_cp(cp)
    order = []
    for r in range(cp):
        order += [r, 2 * cp - 1 - r]
    return order


def _permute_chunks(x, cp: int, axis: int, order: list[int]):
    cp = _check_cp(cp)
    if cp == 1:
        return x
    if not hasattr(x, "shape"):  # lists and scalars: treat as numpy
        x = np.asarray(x)
    ndim = np.ndim(x)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array of rank {ndim}")
    axis %= ndim
    length = np.shape(x)[axis]
    check_length(length, cp)
    if isinstance(x, np.ndarray):
        xp = np
    else:  # jax arrays and tracers; imported lazily so numpy-only users never pay for jax
        import jax.numpy as xp
    chunk = length // (2 * cp)
    index = [slice(None)] * ndim

    def piece(c):
        index[axis] = slice(c * chunk, (c + 1) * chunk)
        return x[tuple(index)]

    return xp.concatenate([piece(c) for c in order], axis=axis)


# -- the strategies, one row at a time ------------------------------------------------------------

_SPLIT_COUNTS = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # k of the hybrid candidates


def _check_strategy(strategy) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"load-balance strategy {strategy!r} is not one of "
                         f"{', '.join(map(repr, STRATEGIES))}")
    return strategy


def _row_order(length: int, cp: int) -> np.ndarray:
    chunk = length // (2 * cp)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunk_order(cp)])


class _Packed:
    """One row in packing order (``canon``): documents ``lens`` then ``length - real`` padding.

    Strategies label each packing-order token with its shard (-1: not placed yet);
    `permutation` turns labels into the row's permutation, packing order kept inside a shard.
    """

    def __init__(self, positions: np.ndarray, segment_ids: np.ndarray, cp: int):
        self.cp, self.length, self.n = cp, len(positions), len(positions) // cp
        self.canon = np.lexsort((positions, segment_ids, segment_ids == 0))
        seg = segment_ids[self.canon]
        self.real = int(np.count_nonzero(seg))
        docs = seg[:self.real]
        self.starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]]) if self.real else \
            np.zeros(0, np.int64)
        self.lens = np.diff(np.r_[self.starts, self.real]).astype(np.int64)
        # pieces 0..2cp-1 -> shard; the odd tokens of a document go to pieces in this order,
        # which visits every shard once in any cp consecutive steps
        m = 2 * cp
        self.piece_shard = np.array([p if p < cp else m - 1 - p for p in range(m)])
        self.extra_order = np.array(list(range(cp)) + list(range(m - 1, cp - 1, -1)))

    def empty(self) -> np.ndarray:
        return np.full(self.length, -1, np.int64)

    def split(self, labels: np.ndarray, docs) -> np.ndarray:
        """Cut each of ``docs`` into 2cp mirrored pieces (the "document" strategy)."""
        m, turn = 2 * self.cp, 0
        for d in docs:
            base, extra = divmod(int(self.lens[d]), m)
            sizes = np.full(m, base)
            sizes[self.extra_order[(turn + np.arange(extra)) % m]] += 1
            turn = (turn + extra) % m
            start = self.starts[d]
            labels[start:start + self.lens[d]] = np.repeat(self.piece_shard, sizes)
        return labels

    def room(self, labels: np.ndarray) -> np.ndarray:
        return self.n - np.bincount(labels[labels >= 0], minlength=self.cp)

    def row_rest(self, labels: np.ndarray) -> np.ndarray:
        """Unplaced tokens (packing order) in 2cp chunks, mirrored like "row", filling shards."""
        need = self.room(labels)
        first = need // 2
        shards = np.r_[np.arange(self.cp), np.arange(self.cp)[::-1]]
        sizes = np.r_[first, (need - first)[::-1]]
        labels[labels < 0] = np.repeat(shards, sizes)
        return labels

    def greedy_rest(self, labels: np.ndarray, docs, tile: int) -> np.ndarray:
        """Whole documents, costliest first, each on the least-loaded shard with room."""
        room = self.room(labels)
        load = np.zeros(self.cp)
        # ~ tiles of a whole document (its triangle plus a diagonal of partly-filled tiles)
        cost = self.lens * (self.lens + 2 * tile) / 2.0
        for d in sorted(docs, key=lambda d: -cost[d]):
            start, left = int(self.starts[d]), int(self.lens[d])
            fits = room >= left
            while left:
                r = int(np.argmin(np.where(fits if fits.any() else room > 0, load, np.inf)))
                take = min(left, int(room[r]))
                labels[start:start + take] = r
                room[r] -= take
                load[r] += cost[d] * take / self.lens[d]
                start, left = start + take, left - take
        return labels

    def permutation(self, labels: np.ndarray) -> np.ndarray:
        pad = np.flatnonzero(labels < 0)
        labels[pad] = np.repeat(np.arange(self.cp), self.room(labels))
        return self.canon[np.argsort(labels, kind="stable")]


def _document(row: _Packed) -> np.ndarray:
    return row.permutation(row.split(row.empty(), range(len(row.lens))))


def _row_candidates(positions, segment_ids, cp: int, tile: int) -> dict[str, np.ndarray]:
    row = _Packed(positions, segment_ids, cp)
    ndocs = len(row.lens)
    out = {"row": _row_order(row.length, cp),
           "document": _document(row)}
    longest = np.argsort(-row.lens, kind="stable")
    for k in _SPLIT_COUNTS:
        if k >= ndocs and k:
            break
        split = sorted(longest[:k].tolist())
        if k:  # k=0 is "row" itself
            out[f"split{k}+row"] = row.permutation(row.row_rest(row.split(row.empty(), split)))
        rest = sorted(longest[k:].tolist())
        out[f"split{k}+greedy"] = row.permutation(
            row.greedy_rest(row.split(row.empty(), split), rest, tile))
    out["none"] = np.arange(row.length)
    return out


def balance_candidates(positions, segment_ids, *, cp: int, tile: int | None = None
                       ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every candidate "auto" weighs for one row: ``{name: (permutation [L], tiles [cp])}``,
    in the order ties are broken (``"row"``, ``"document"``, the hybrids, ``"none"``)."""
    positions = np.asarray(positions, np.int64).reshape(-1)
    segment_ids = np.asarray(segment_ids, np.int64).reshape(-1)
    cp = _check_cp(cp)
    check_length(len(positions), cp)
    tile = work.TILE if tile is None else _check_tile(tile)
    perms = _row_candidates(positions, segment_ids, cp, work.tile_size(len(positions) // cp, tile))
    stacked = np.stack(list(perms.values()))
    tiles = work.shard_tiles(np.take(positions.astype(np.int32), stacked),
                             np.take(segment_ids.astype(np.int32), stacked), cp, tile)
    return {name: (perm, t) for (name, perm), t in zip(perms.items(), tiles)}


def best_candidate(scored: dict[str, tuple[np.ndarray, np.ndarray]]) -> str:
    """The candidate "auto" picks: fewest busiest-shard tiles, then fewest in total, then first."""
    names = list(scored)
    return min(names, key=lambda k: (scored[k][1].max(), scored[k][1].sum(), names.index(k)))


def _auto(positions, segment_ids, cp: int, tile: int | None) -> np.ndarray:
    seg = segment_ids
    if seg[0] != 0 and np.all(seg == seg[0]):  # one document fills the row: "document" and
        # every split hybrid are "row" itself, the rest cut it contiguously: nothing to search
        return _row_order(len(seg), cp)
    scored = balance_candidates(positions, segment_ids, cp=cp, tile=tile)
    return _padding_in_order(scored[best_candidate(scored)][0], segment_ids)


def _padding_in_order(perm: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Padding keeps its relative order (free: padding never attends): restore_order is exact."""
    perm = perm.copy()
    slots = np.flatnonzero(segment_ids[perm] == 0)
    perm[slots] = np.sort(perm[slots])
    return perm


def _auto_device(positions, segment_ids, cp: int, tile: int | None) -> list[np.ndarray]:
    """"auto" for rows that share a device: the kernels skip a tile only when it is empty in
    every row, so the cost is the busiest shard's tiles in the *union* of the rows' tile maps.
    Start from the candidate that is best for all rows alike (``"row"`` among them, so never
    worse than it or ``"document"``), then let each row in turn switch to the candidate that
    lowers the union, once."""
    scored = [balance_candidates(p, s, cp=cp, tile=tile) for p, s in zip(positions, segment_ids)]
    names = list(dict.fromkeys(k for sc in scored for k in sc))
    perms = [[sc.get(k, sc["document"])[0] for k in names] for sc in scored]  # [rows][C]
    maps = np.stack([work.tile_map(np.take(p, np.stack(pr)), np.take(s, np.stack(pr)), cp, tile)
                     for p, s, pr in zip(positions, segment_ids, perms)])  # [rows, C, T, T]
    rows = np.arange(len(maps))

    def cost(choice):
        per_shard = maps[rows, choice].any(0).sum(-1).reshape(cp, -1).sum(-1)
        return per_shard.max(), per_shard.sum()

    best = min(range(len(names)), key=lambda c: (*cost([c] * len(rows)), c))
    choice = [best] * len(rows)
    for i in rows:
        current = cost(choice)
        for c in range(len(names)):
            trial = [*choice[:i], c, *choice[i + 1:]]
            if cost(trial) < current:
                choice, current = trial, cost(trial)
    return [_padding_in_order(perms[i][c], segment_ids[i]) for i, c in zip(rows, choice)]


def _check_tile(tile) -> int:
    if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)) or tile < 1:
        raise ValueError(f"tile={tile!r} must be a positive integer (the kernel's tile size, "
                         f"default {work.TILE})")
    return int(tile)


def balance_permutation(positions, segment_ids, *, cp: int, strategy: str = "auto",
                        tile: int | None = None, rows_per_device: int = 1) -> np.ndarray:
    """The load-balancing permutation of every row: int ``[B, L]`` (``[L]`` for ``[L]`` input).

    Row ``b`` of the balanced batch is ``x[b, perm[b]]``; shard ``r`` holds
    ``perm[b, r*L/cp:(r+1)*L/cp]``. ``positions``/``segment_ids`` are the packed batch's
    (segment 0 is padding). ``tile`` is the kernel tile "auto" counts with (default
    `zoo.data.work.TILE`, 64: zoo's flash kernel on CPU). ``rows_per_device``: consecutive rows
    that one device's attention holds together; "auto" then minimises their common cost (the
    kernels skip a tile only when every row allows it; see `_auto_device`). See the module
    docstring.
    """
    cp = _check_cp(cp)
    _check_strategy(strategy)
    if tile is not None:
        tile = _check_tile(tile)
    if isinstance(rows_per_device, bool) or not isinstance(rows_per_device, (int, np.integer)) \
            or rows_per_device < 1:
        raise ValueError(f"rows_per_device={rows_per_device!r} must be a positive integer")
    positions = np.asarray(positions, np.int64)
    segment_ids = np.asarray(segment_ids, np.int64)
    if positions.shape != segment_ids.shape or positions.ndim not in (1, 2):
        raise ValueError(f"positions {positions.shape} and segment_ids {segment_ids.shape} must "
                         "have the same shape, [B, L] or [L]")
    rows_p, rows_s = np.atleast_2d(positions), np.atleast_2d(segment_ids)
    length = rows_p.shape[1]
    if cp == 1 or strategy == "none":
        perm = np.broadcast_to(np.arange(length), rows_p.shape).copy()
    else:
        check_length(length, cp)
        if strategy == "row":
            perm = np.broadcast_to(_row_order(length, cp), rows_p.shape).copy()
        elif strategy == "document":
            perm = np.stack([_document(_Packed(p, s, cp)) for p, s in zip(rows_p, rows_s)])
        elif rows_per_device == 1:
            perm = np.stack([_auto(p, s, cp, tile) for p, s in zip(rows_p, rows_s)])
        else:
            if len(rows_p) % rows_per_device:
                raise ValueError(f"{len(rows_p)} rows do not split into devices of "
                                 f"rows_per_device={rows_per_device}; use a divisor of the rows")
            perm = np.stack([q for g in range(0, len(rows_p), rows_per_device)
                             for q in _auto_device(rows_p[g:g + rows_per_device],
                                                   rows_s[g:g + rows_per_device], cp, tile)])
    return perm if positions.ndim == 2 else perm[0]


# -- applying and inverting ------------------------------------------------------------------------

def _values(a, what: str) -> np.ndarray:
    try:
        return np.asarray(a)
    except TypeError as e:  # a jax tracer: the permutation needs concrete values
        raise ValueError(f"load_balance: {what} must be concrete (numpy) for strategies other "
                         "than 'row'; reorder in the data pipeline, or use strategy='row' "
                         "inside jit") from e


def _take(x, perm: np.ndarray, axis: int):
    """``x`` reordered along ``axis`` by ``perm`` ([L]: every row; [B, L]: row b by perm[b])."""
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    xp = np
    if not isinstance(x, np.ndarray):
        import jax.numpy as xp
    ndim = x.ndim
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array of rank {ndim}")
    axis %= ndim
    if x.shape[axis] != perm.shape[-1]:
        raise ValueError(f"length {x.shape[axis]} along axis {axis} does not match the "
                         f"positions' length {perm.shape[-1]}")
    if perm.ndim == 1:
        return xp.take(x, perm, axis=axis)
    if axis == 0 or x.shape[0] != perm.shape[0]:
        raise ValueError(f"per-row reordering needs rows on axis 0 ({perm.shape[0]} rows) and "
                         f"the length on another axis; got shape {x.shape}, axis={axis}")
    shape = [perm.shape[0]] + [1] * (ndim - 1)
    shape[axis] = perm.shape[1]
    return xp.take_along_axis(x, perm.reshape(shape), axis=axis)


def load_balance(x, cp: int, axis: int = 1, *, strategy: str = "auto", positions=None,
                 segment_ids=None, tile: int | None = None, rows_per_device: int = 1):
    """Reorder ``x`` along ``axis`` for ``cp`` context shards (see the module docstring).

    ``x`` is an array (rows on axis 0 for per-row strategies) or a dict of them -- a batch,
    whose ``"positions"``/``"segment_ids"`` are used when not passed -- all reordered alike.
    ``cp=1`` and ``strategy="none"`` return ``x`` unchanged. The length must be divisible by
    ``2*cp`` (`ValueError` naming the nearest valid length otherwise).
    """
    cp = _check_cp(cp)
    _check_strategy(strategy)
    if isinstance(x, Mapping):
        positions = x.get("positions") if positions is None else positions
        segment_ids = x.get("segment_ids") if segment_ids is None else segment_ids
    if cp == 1 or strategy == "none":
        return x
    if (positions is None) != (segment_ids is None):
        raise ValueError("load_balance: pass both positions and segment_ids, or neither (one "
                         "document without padding)")
    if strategy == "row" or positions is None:  # one document: every strategy is "row"
        perm = None
    else:
        perm = balance_permutation(_values(positions, "positions"),
                                   _values(segment_ids, "segment_ids"), cp=cp,
                                   strategy=strategy, tile=tile,
                                   rows_per_device=rows_per_device)

    def one(v):
        return _permute_chunks(v, cp, axis, chunk_order(cp)) if perm is None else \
            _take(v, perm, axis)

    return {k: one(v) for k, v in x.items()} if isinstance(x, Mapping) else one(x)


def restore_order(x, cp: int, axis: int = 1, *, positions=None, segment_ids=None):
    """Exact inverse of `load_balance`: ``restore_order(load_balance(x, cp), cp) == x``.

    With the *balanced* ``positions`` and ``segment_ids`` ([B, L]) it inverts any strategy (rows
    sorted back into packing order; see the module docstring); without them, ``"row"``.
    """
    cp = _check_cp(cp)
    if isinstance(x, Mapping):
        positions = x.get("positions") if positions is None else positions
        segment_ids = x.get("segment_ids") if segment_ids is None else segment_ids
    if cp == 1:
        return x
    if (positions is None) != (segment_ids is None):
        raise ValueError("restore_order: pass both positions and segment_ids, or neither (the "
                         "'row' strategy)")
    if positions is None:
        order = chunk_order(cp)
        inverse = [0] * len(order)
        for position, c in enumerate(order):
            inverse[c] = position

        def one(v):
            return _permute_chunks(v, cp, axis, inverse)
    else:
        if isinstance(positions, np.ndarray) and isinstance(segment_ids, np.ndarray):
            order = np.lexsort((positions, segment_ids, segment_ids == 0))
        else:  # jax arrays or tracers
            import jax.numpy as jnp
            order = jnp.lexsort((positions, segment_ids, segment_ids == 0))
            if all(isinstance(v, np.ndarray) for v in
                   (x.values() if isinstance(x, Mapping) else [x])):
                order = np.asarray(order)

        def one(v):
            return _take(v, order, axis)

    return {k: one(v) for k, v in x.items()} if isinstance(x, Mapping) else one(x)
