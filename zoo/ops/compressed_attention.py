"""Compressed attention (DeepSeek-V4): compression windows per document, and each query's
attention over its sliding window plus the compressed entries, with sinks.

Compression windows (`window_table`, `window_slots`, `compress`):

* A window is ``rate`` consecutive positions of one document, aligned to multiples of ``rate``
  (a document's first token has position 0, so its windows start there; a continuation that
  starts mid-window leaves that partial window out). Only complete windows make an entry:
  padding (segment id 0) and a document's trailing partial window never enter one, and a
  window never mixes two documents. Everything is read from positions and segment ids, never
  array indices, so any order of the tokens (`zoo.data.load_balance`) gives the same entries.
* Entries are numbered per row into ``num_entries = length // rate`` slots (each complete window
  holds ``rate`` distinct tokens, so they fit): segment by segment id, then window by window;
  unused slots have segment id 0. ``entry_start`` is the position of a window's first token
  (where DeepSeek-V4 rotates the entry); a query at position ``t`` of the same document sees
  the entry once its last token ``entry_start + rate - 1 <= t``.
* An entry is the gated mix ``sum_j softmax_j(gate_j + bias[j mod rate]) * kv_j`` per channel
  over its window (HCA, ``overlap=False``). CSA (``overlap=True``): each token carries two
  halves, ``Ca = [..., :H]`` and ``Cb = [..., H:]``; entry ``w`` mixes window ``w``'s ``Cb``
  with window ``w - 1``'s ``Ca`` (width ``2 * rate``, stride ``rate``); a document's first
  entry has only its ``Cb`` half.
* `pool_window` is one window's entry from its tokens (a decode step closing a window).
* `compress` is a segment reduction, so under context parallelism (``axes``: the sequence mesh
  axes, inside `jax.shard_map`) each shard reduces its own tokens into the row's slots and the
  partial softmax sums are combined exactly (``pmax`` of the maxima, ``psum`` of the sums): a
  window that straddles shards is completed from every holder of its tokens, and every shard
  ends with all entries of the row. Per row that moves ``3 * num_entries * H`` values through
  an all-reduce instead of the tokens' projections.

`attend`: queries [B, L, N, H] over keys that are their own values (single-KV-head MQA):
tokens within ``window`` of the query in its document (causal), plus the compressed entries it
sees -- all of them (HCA) or the ``indices`` a lightning indexer selected (CSA) -- plus one sink
logit per head (no value), in one float32 softmax. The sliding keys come dense over the given
tokens (the reference; a decode step's ring) or through `sliding_band`: the row sorted by
(segment id, position), each query gathers the ``window`` tokens ending at it, so the work and
memory are O(L * window), for any token order. ``query_chunk`` bounds the per-step arrays
(`zoo.ops.sparse_attention.choose_query_chunk`, `zoo.ops.sparse_attention.map_query_chunks`):
[B, chunk, N, window + E] (HCA) or [B, chunk, window + k, H] (CSA). `attention_logits` is
its softmax's input by part (`Logits`: sliding keys, entries, sinks), which DeepSeek-V4's CSA
indexer learns from.

Legend: B batch, L queries / tokens, S key tokens, E entry slots, N heads, H head dim,
k selected entries.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from zoo.ops.sparse_attention import gather_keys, map_query_chunks

F32 = jnp.float32


class WindowTable(NamedTuple):
    """Where a row's complete windows live (`window_table`); per segment-id bucket [B, G] and
    per entry slot [B, E]."""

    first: jax.Array  # first complete window index of each segment id
    end: jax.Array  # one past its last complete window
    offset: jax.Array  # slot of its first complete window
    entry_start: jax.Array  # [B, E] position of each entry's first token
    entry_segment_ids: jax.Array  # [B, E] its document (0: unused slot)


def _ids(segment_ids, buckets):
    seg = segment_ids.astype(jnp.int32)
    return jnp.where(seg > 0, jnp.clip(seg, 0, buckets - 1), 0)


def window_slots(table: WindowTable, positions: jax.Array, segment_ids: jax.Array,
                 rate: int) -> tuple[jax.Array, jax.Array]:
    """(slot, next slot) [B, L] int32 of each token: the entry of its window and the entry of the
    next window of its document (CSA's ``Ca`` goes there); ``-1`` where there is none."""
    ids = _ids(segment_ids, table.first.shape[1])
    first, end, offset = (jnp.take_along_axis(a, ids, axis=1)
                          for a in (table.first, table.end, table.offset))
    w = jnp.floor_divide(positions.astype(jnp.int32), rate)
    ok = (segment_ids > 0) & (w >= first) & (w < end)
    slot = jnp.where(ok, offset + w - first, -1)
    return slot, jnp.where(ok & (w + 1 < end), slot + 1, -1)


def window_table(positions: jax.Array, segment_ids: jax.Array, rate: int,
                 num_entries: int | None = None) -> WindowTable:
    """The `WindowTable` of whole rows: positions and segment ids [B, S] of every token of the
    row, in any order (module docstring). Segment ids are 0 (padding) or 1..S.
    ``num_entries``: slots per row (default ``S // rate``)."""
    B, S = positions.shape
    E = S // rate if num_entries is None else int(num_entries)
    G = S + 1  # segment id buckets; bucket 0 is padding
    pos = positions.astype(jnp.int32)
    valid = segment_ids > 0
    ids = _ids(segment_ids, G)
    big = jnp.iinfo(jnp.int32).max
    lo = jax.vmap(lambda v, i: jax.ops.segment_min(v, i, G))(jnp.where(valid, pos, big), ids)
    hi = jax.vmap(lambda v, i: jax.ops.segment_max(v, i, G))(jnp.where(valid, pos, -big), ids)
    present = (hi >= lo) & (jnp.arange(G) > 0)
    first = jnp.where(present, -jnp.floor_divide(-lo, rate), 0)  # ceil(lo / rate)
    end = jnp.where(present, jnp.floor_divide(hi + 1, rate), 0)
    count = jnp.maximum(end - first, 0)
    offset = jnp.cumsum(count, axis=1) - count
    table = WindowTable(first, end, offset, jnp.zeros((B, E), jnp.int32),
                        jnp.zeros((B, E), jnp.int32))
    slot, _ = window_slots(table, pos, segment_ids, rate)
    dump = jnp.where(slot >= 0, slot, E)  # slot E collects the tokens of no entry, dropped

    def scatter(v):
        return jax.vmap(lambda a, i: jax.ops.segment_max(a, i, E + 1))(v, dump)[:, :E]

    start = scatter(jnp.where(slot >= 0, jnp.floor_divide(pos, rate) * rate, -big))
    seg = scatter(jnp.where(slot >= 0, segment_ids.astype(jnp.int32), 0))
    seg = jnp.maximum(seg, 0)
    return table._replace(entry_start=jnp.where(seg > 0, start, 0), entry_segment_ids=seg)


def compress(kv: jax.Array, gate: jax.Array, bias: jax.Array, positions: jax.Array,
             slots: jax.Array, next_slots: jax.Array | None, *, num_entries: int,
             axes: tuple[str, ...] = ()) -> jax.Array:
    """The row's pooled entries [B, E, H] in float32 (before any norm).

    Args:
      kv, gate: [B, L, H] (HCA) or [B, L, 2H] (CSA: ``[Ca | Cb]``) per token.
      bias: [rate, H] / [rate, 2H], added to the gate of the token at ``position mod rate``.
      positions, slots, next_slots: [B, L]; `window_slots` of these tokens (``next_slots``
        None: no overlap, HCA).
      num_entries: E, the slots of the row.
      axes: sequence mesh axes when called inside `jax.shard_map` on one shard's tokens: the
        partial sums are all-reduced over them (module docstring).
    """
    rate, width = bias.shape
    E = int(num_entries)
    g = gate.astype(F32) + jnp.take(bias.astype(F32), jnp.mod(positions, rate), axis=0)
    v = kv.astype(F32)
    ids = jnp.where(slots >= 0, slots, E)
    if next_slots is not None:
        H = width // 2
        nxt = jnp.where(next_slots >= 0, next_slots, E)
        g = jnp.concatenate([g[..., H:], g[..., :H]], axis=1)  # Cb to its window, Ca to next
        v = jnp.concatenate([v[..., H:], v[..., :H]], axis=1)
        ids = jnp.concatenate([ids, nxt], axis=1)

    def seg(fn, a):
        return jax.vmap(lambda x, i: fn(x, i, E + 1))(a, ids)

    m = seg(jax.ops.segment_max, jax.lax.stop_gradient(g))
    if axes:
        m = jax.lax.pmax(m, axes)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(g - jnp.take_along_axis(m, ids[..., None], axis=1))
    den, num = seg(jax.ops.segment_sum, e), seg(jax.ops.segment_sum, e * v)
    if axes:
        den, num = jax.lax.psum((den, num), axes)
    return (num / jnp.where(den > 0, den, 1.0))[:, :E]


def pool_window(kv: jax.Array, gate: jax.Array, prev_kv: jax.Array | None = None,
                prev_gate: jax.Array | None = None) -> jax.Array:
    """One window's entry from its tokens, for a decode step: kv / gate [B, rate, H] (the gate
    with its position bias) and, for CSA, the previous window's ``Ca`` half ``prev_*``
    [B, rate, H] (gate ``-inf``: none) -> [B, H] float32, the softmax over the window axis."""
    g, v = gate.astype(F32), kv.astype(F32)
    if prev_kv is not None:
        g = jnp.concatenate([prev_gate.astype(F32), g], axis=1)
        v = jnp.concatenate([prev_kv.astype(F32), v], axis=1)
    return jnp.sum(jax.nn.softmax(g, axis=1) * v, axis=1)


def entry_visible(q_positions: jax.Array, q_segment_ids: jax.Array, entry_start: jax.Array,
                  entry_segment_ids: jax.Array, rate: int) -> jax.Array:
    """[B, L, E] (or broadcast): the entries each query sees -- its document's, complete by its
    position."""
    return ((entry_segment_ids == q_segment_ids) & (q_segment_ids > 0)
            & (entry_start + rate - 1 <= q_positions))


def lexsort_stable(major: jax.Array, minor: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(major sorted, order)``: the indices along the last axis that sort (``major``,
    ``minor``) ascending, ties in index order, with ``major`` taken in that order -- what
    ``jax.lax.sort((major, minor, iota), num_keys=2, is_stable=True)`` gives, as two stable
    one-key sorts (by ``minor``, then by ``major``), which libtpu compiles several times
    faster than the one two-key, three-operand sort."""
    idx = jax.lax.broadcasted_iota(jnp.int32, major.shape, major.ndim - 1)
    _, order = jax.lax.sort((minor, idx), dimension=-1, num_keys=1, is_stable=True)
    key = jnp.take_along_axis(major, order, axis=-1)
    return tuple(jax.lax.sort((key, order), dimension=-1, num_keys=1, is_stable=True))


def sliding_band(query_index: jax.Array, kv_positions: jax.Array, kv_segment_ids: jax.Array,
                 window: int) -> jax.Array:
    """Each query's sliding-window keys as indices [B, L, window] into the S keys (``-1``:
    none), for queries that are tokens of the row (``query_index`` [B, L]: their indices in
    it). The row is sorted by (segment id, position) -- any token order works -- and a query's
    window is the ``window`` tokens ending at it in that order, checked for its document and
    positions; O(S log S + L * window), never a [L, S] array."""
    B, S = kv_positions.shape
    big = jnp.iinfo(jnp.int32).max
    seg = jnp.where(kv_segment_ids > 0, kv_segment_ids.astype(jnp.int32), big)
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    _, order = lexsort_stable(seg, kv_positions.astype(jnp.int32))
    rank = jnp.zeros((B, S), jnp.int32).at[jnp.arange(B)[:, None], order].set(idx)
    r = jnp.take_along_axis(rank, query_index.astype(jnp.int32), axis=1)  # [B, L]
    back = r[..., None] - jnp.arange(window, dtype=jnp.int32)  # [B, L, W] sorted ranks
    cand = jnp.take_along_axis(order, jnp.maximum(back, 0).reshape(B, -1), axis=1)
    cand = cand.reshape(back.shape)
    qp = jnp.take_along_axis(kv_positions, query_index, axis=1)[..., None]
    qs = jnp.take_along_axis(kv_segment_ids, query_index, axis=1)[..., None]
    kp = jnp.take_along_axis(kv_positions, cand.reshape(B, -1), axis=1).reshape(cand.shape)
    ks = jnp.take_along_axis(kv_segment_ids, cand.reshape(B, -1), axis=1).reshape(cand.shape)
    ok = (back >= 0) & (ks == qs) & (qs > 0) & (kp <= qp) & (qp - kp < window)
    return jnp.where(ok, cand, -1)


def attend(q: jax.Array, kv: jax.Array, entries: jax.Array | None, *, q_positions: jax.Array,
           q_segment_ids: jax.Array, kv_positions: jax.Array, kv_segment_ids: jax.Array,
           window: int, entry_start: jax.Array | None = None,
           entry_segment_ids: jax.Array | None = None, rate: int = 1,
           indices: jax.Array | None = None, sinks: jax.Array | None = None,
           scale: float | None = None, band: jax.Array | None = None,
           query_chunk: int | None = None) -> jax.Array:
    """Attention of q [B, L, N, H] over the tokens kv [B, S, H] within ``window`` and the
    entries [B, E, H] it sees (``indices`` [B, L, k]: only those, ``-1`` empty), keys = values,
    plus ``sinks`` [N] -> [B, L, N, H] in q's dtype (module docstring). A query that sees
    nothing gives zeros.

    ``band`` [B, L, window] (`sliding_band`): each query's window keys as indices into kv, so
    the sliding part gathers ``window`` keys a query instead of scoring all S (None: dense
    over S, the reference and the decode step's small ring). ``query_chunk``: queries per step
    of a `jax.lax.map` (None: all at once; must divide L).
    """
    H = q.shape[-1]
    scale = H ** -0.5 if scale is None else float(scale)
    kvf = kv.astype(F32)
    ef = None if entries is None else entries.astype(F32)
    per_query = (q, q_positions, q_segment_ids, indices, band)

    def one(args):
        qc, qpos, qseg, idx, bnd = args
        return _attend_chunk(qc, kvf, ef, qpos, qseg, kv_positions, kv_segment_ids, window,
                             entry_start, entry_segment_ids, rate, idx, sinks, scale, bnd)

    return map_query_chunks(one, query_chunk, per_query).astype(q.dtype)


class Logits(NamedTuple):
    """One chunk of queries' scaled logits in `attend`'s softmax, by part (`attention_logits`),
    each ``-inf`` where the query does not see the key."""

    sliding: jax.Array  # [B, L, N, S] (dense over the row) or [B, L, N, window] (band)
    keys: jax.Array  # the sliding keys = values: kv [B, S, H] or gathered [B, L, window, H]
    entries: jax.Array | None  # [B, L, N, E] (all entries) or [B, L, N, k] (selected)
    values: jax.Array | None  # the entries scored: [B, E, H] or gathered [B, L, k, H]
    entry_visible: jax.Array | None  # [B, L, E] / [B, L, k]: which of them the query sees
    sinks: jax.Array | None  # [B, L, N, 1]

    def log_norm(self) -> jax.Array:
        """Each head's log-normaliser of the whole softmax [B, L, N] (float32)."""
        parts = [a for a in (self.sliding, self.entries, self.sinks) if a is not None]
        return jax.nn.logsumexp(jnp.concatenate(parts, axis=-1), axis=-1)


def attention_logits(q, kv, entries, *, q_positions, q_segment_ids, kv_positions,
                     kv_segment_ids, window, entry_start=None, entry_segment_ids=None, rate=1,
                     indices=None, sinks=None, scale=None, band=None) -> Logits:
    """The `Logits` of `attend`'s softmax for queries ``q [B, L, N, H]`` (`attend`'s
    arguments; float32): what `attend` normalises, and what a DeepSeek-V4 CSA indexer learns
    from (`zoo.layers.compressed_attention.CompressedAttention`'s ``index_stage``)."""
    B, L, N, H = q.shape
    scale = H ** -0.5 if scale is None else float(scale)
    kvf = kv.astype(F32)
    ef = None if entries is None else entries.astype(F32)
    qf = q.astype(F32) * scale
    qp, qs = q_positions[:, :, None], q_segment_ids[:, :, None]
    if band is None:  # dense over every key of the row
        vis = ((kv_segment_ids[:, None, :] == qs) & (qs > 0) & (kv_positions[:, None, :] <= qp)
               & (qp - kv_positions[:, None, :] < window))  # [B, L, S]
        keys = kvf
        s = jnp.einsum("blnh,bsh->blns", qf, kvf)
    else:
        (keys,) = gather_keys(band, kvf)  # [B, L, W, H]
        vis = band >= 0
        s = jnp.einsum("blnh,blwh->blnw", qf, keys)
    sliding = jnp.where(vis[:, :, None], s, -jnp.inf)
    ent = values = ev = sink = None
    if ef is not None:
        if indices is None:
            ev = entry_visible(qp, qs, entry_start[:, None, :], entry_segment_ids[:, None, :],
                               rate)
            values = ef
            s = jnp.einsum("blnh,beh->blne", qf, ef)
        else:
            values, start, seg = gather_keys(indices, ef, entry_start, entry_segment_ids)
            ev = entry_visible(qp, qs, start, seg, rate) & (indices >= 0)
            s = jnp.einsum("blnh,blkh->blnk", qf, values)
        ev = jnp.broadcast_to(ev, s.shape[:2] + s.shape[3:])
        ent = jnp.where(ev[:, :, None], s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(F32)[None, None, :, None], (B, L, N, 1))
    return Logits(sliding, keys, ent, values, ev, sink)


def _attend_chunk(q, kv, entries, q_positions, q_segment_ids, kv_positions, kv_segment_ids,
                  window, entry_start, entry_segment_ids, rate, indices, sinks, scale, band):
    lg = attention_logits(q, kv, entries, q_positions=q_positions, q_segment_ids=q_segment_ids,
                          kv_positions=kv_positions, kv_segment_ids=kv_segment_ids,
                          window=window, entry_start=entry_start,
                          entry_segment_ids=entry_segment_ids, rate=rate, indices=indices,
                          sinks=sinks, scale=scale, band=band)
    s = jnp.concatenate([a for a in (lg.sliding, lg.entries, lg.sinks) if a is not None], -1)
    mx = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    S = lg.sliding.shape[-1]
    out = (jnp.einsum("blns,bsh->blnh", p[..., :S], lg.keys) if band is None
           else jnp.einsum("blnw,blwh->blnh", p[..., :S], lg.keys))
    if lg.entries is not None:
        pe = p[..., S:S + lg.entries.shape[-1]]
        out = out + (jnp.einsum("blne,beh->blnh", pe, lg.values) if indices is None
                     else jnp.einsum("blnk,blkh->blnh", pe, lg.values))
    return out
