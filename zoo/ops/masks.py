"""Attention masks as values, built from positions and segment ids -- never from array indices.

A mask is a frozen dataclass that says, elementwise, whether a query sees a key::

    mask(q_pos, kv_pos, q_seg, kv_seg) -> bool    (any broadcastable shapes)

* `Causal()` -- key position <= query position.
* `SlidingWindow(w)` -- query position - key position < w (one-sided: combine with `Causal`).
* `Chunked(size)` -- Llama-4 local attention: both in the same chunk ``pos // size``.
* `Document()` -- same document: equal segment ids (compared by absolute value, see PrefixLM).
* `PrefixLM()` -- causal, plus bidirectional among prefix tokens. The prefix flag travels in the
  sign of the segment id: a prefix token of document ``s`` carries segment id ``-s`` (0 stays
  padding). That way the flag moves with K/V around the ring like any segment id, and no new
  argument threads through the strategies. `prefix_segment_ids` builds such ids.
* ``a & b``, ``a | b`` -- combinators; `MaskFn(fn)` wraps any elementwise JAX function
  ``fn(q_pos, kv_pos, q_seg, kv_seg) -> bool`` a user writes.

Segment 0 is padding whatever the mask: the op adds "neither token is padding" (`evaluate`), so
padding rows are exact zeros. Because a mask reads original positions, it stays exact after any
reordering of the sequence (load-balanced context parallelism permutes its chunks).

Block classification: from per-row bounds of a query block and a key block (`Bounds`: min/max of
positions and segment ids, prefix flags, padding), ``mask.classify(q, kv)`` returns per-row
``(may, full)``: ``may`` False only when no pair can be visible (skip the block), ``full`` True
only when every pair is visible (skip evaluating the mask). `MaskFn` says (True, False):
"partial", which is always safe. `block_kind` reduces it to 0 empty / 1 full / 2 partial.

Static reach: ``mask.reach()`` is a `Reach` -- how far back and ahead *in position* a visible key
can be, and whether visible pairs are always in the same document. ``&`` takes the tighter
bound, ``|`` the looser; `MaskFn`, `PrefixLM` and `Document` alone bound nothing. It is what the
ring's static hop plan (`zoo.ops.ring.hop_plan`) reads.

Legend: B batch, L query length, S key length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

_LIM = 2**29  # sentinels: a difference of two stays far from int32 overflow
EMPTY, FULL, PARTIAL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Per-row summary of one block's tokens, each [B]: what `Mask.classify` reads."""
    pos_lo: jax.Array  # min / max position of non-padding tokens (+-_LIM if none)
    pos_hi: jax.Array
    doc_lo: jax.Array  # min / max |segment id| of non-padding tokens
    doc_hi: jax.Array
    pre_any: jax.Array  # some non-padding token is a prefix token (segment id < 0)
    pre_all: jax.Array  # every non-padding token is a prefix token
    some: jax.Array  # some token is not padding
    no_pad: jax.Array  # no token is padding


def bounds(positions: jax.Array, segment_ids: jax.Array) -> Bounds:
    """`Bounds` of a block from its positions and segment ids [B, n]."""
    valid = segment_ids != 0
    pos = jnp.clip(positions, -_LIM, _LIM)
    doc = jnp.abs(segment_ids)
    pre = segment_ids < 0
    return Bounds(
        pos_lo=jnp.min(jnp.where(valid, pos, _LIM), axis=-1),
        pos_hi=jnp.max(jnp.where(valid, pos, -_LIM), axis=-1),
        doc_lo=jnp.min(jnp.where(valid, doc, _LIM), axis=-1),
        doc_hi=jnp.max(jnp.where(valid, doc, 0), axis=-1),
        pre_any=jnp.any(valid & pre, axis=-1), pre_all=jnp.all(~valid | pre, axis=-1),
        some=jnp.any(valid, axis=-1), no_pad=jnp.all(valid, axis=-1))


@dataclasses.dataclass(frozen=True)
class Reach:
    """A static bound on visible pairs: ``q_pos - kv_pos <= back`` and ``kv_pos - q_pos <=
    ahead`` (None: unbounded), and ``same_document``: visible pairs share a segment id.

    Positions are runtime data; `sequence` turns the bound into one on *sequence* distance,
    valid when positions strictly increase along the sequence within each document (packing
    gives that: 0, 1, 2, ... per document) -- then a key ``d`` tokens back in the same document
    is at least ``d`` positions back. Without ``same_document`` positions of other documents
    say nothing about their distance, so there is no sequence bound.
    """
    back: int | None = None
    ahead: int | None = None
    same_document: bool = False

    def __and__(self, other: Reach) -> Reach:
        tight = lambda a, b: b if a is None else a if b is None else min(a, b)
        return Reach(tight(self.back, other.back), tight(self.ahead, other.ahead),
                     self.same_document or other.same_document)

    def __or__(self, other: Reach) -> Reach:
        loose = lambda a, b: None if a is None or b is None else max(a, b)
        return Reach(loose(self.back, other.back), loose(self.ahead, other.ahead),
                     self.same_document and other.same_document)

    def sequence(self) -> tuple[int | None, int | None]:
        """(back, ahead) in tokens of sequence order, under the assumption above."""
        return (self.back, self.ahead) if self.same_document else (None, None)


class Mask:
    """Base of all masks: elementwise rule, block classification and the ``&``/``|`` algebra."""

    def __call__(self, q_pos, kv_pos, q_seg, kv_seg):
        raise NotImplementedError

    def reach(self) -> Reach:
        """Static bound on visible pairs (`Reach`); the default bounds nothing, always safe."""
        return Reach()

    def classify(self, q: Bounds, kv: Bounds):
        """Per-row (may, full) bools [B]; the default "partial" is always safe."""
        return jnp.ones_like(q.some), jnp.zeros_like(q.some)

    def __and__(self, other: Mask) -> Mask:
        return And(self, _check(other))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, _check(other))


def _check(other):
    if not isinstance(other, Mask):
        raise TypeError(f"masks combine with masks, got {other!r}; wrap a function in "
                        f"zoo.ops.masks.MaskFn(fn)")
    return other


@dataclasses.dataclass(frozen=True)
class And(Mask):
    a: Mask
    b: Mask

    def __call__(self, *args):
        return self.a(*args) & self.b(*args)

    def reach(self):
        return self.a.reach() & self.b.reach()

    def classify(self, q, kv):
        (ma, fa), (mb, fb) = self.a.classify(q, kv), self.b.classify(q, kv)
        return ma & mb, fa & fb


@dataclasses.dataclass(frozen=True)
class Or(Mask):
    a: Mask
    b: Mask

    def __call__(self, *args):
        return self.a(*args) | self.b(*args)

    def reach(self):
        return self.a.reach() | self.b.reach()

    def classify(self, q, kv):
        (ma, fa), (mb, fb) = self.a.classify(q, kv), self.b.classify(q, kv)
        return ma | mb, fa | fb


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    def __call__(self, q_pos, kv_pos, q_seg, kv_seg):
        return kv_pos <= q_pos

    def classify(self, q, kv):
        return kv.pos_lo <= q.pos_hi, kv.pos_hi <= q.pos_lo

    def reach(self):
        return Reach(ahead=0)


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
    window: int

    def __post_init__(self):
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"SlidingWindow(window={self.window!r}): the window must be a "
                             f"positive int (a query sees keys less than that many positions "
                             f"back)")

    def __call__(self, q_pos, kv_pos, q_seg, kv_seg):
        return q_pos - kv_pos < self.window

    def classify(self, q, kv):
        return q.pos_lo - kv.pos_hi < self.window, q.pos_hi - kv.pos_lo < self.window

    def reach(self):
        return Reach(back=self.window - 1)


@dataclasses.dataclass(frozen=True)
class Chunked(Mask):
    size: int

    def __post_init__(self):
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"Chunked(size={self.size!r}): the chunk size must be a positive "
                             f"int")

    def __call__(self, q_pos, kv_pos, q_seg, kv_seg):
        return q_pos // self.size == kv_pos // self.size

    def classify(self, q, kv):
        c = self.size
        qlo, qhi, klo, khi = q.pos_lo // c, q.pos_hi // c, kv.pos_lo // c, kv.pos_hi // c
        return (qlo <= khi) & (klo <= qhi), (qlo == qhi) & (klo == khi) & (qlo == klo)

    def reach(self):
        return Reach(back=self.size - 1, ahead=self.size - 1)


@dataclasses.dataclass(frozen=True)
class Document(Mask):
    def __call__(self, q_pos, kv_pos, q_seg, kv_seg):
        return jnp.abs(q_seg) == jnp.abs(kv_seg)

    def classify(self, q, kv):
        may = (q.doc_lo <= kv.doc_hi) & (kv.doc_lo <= q.doc_hi)
        return may, (q.doc_lo == q.doc_hi) & (kv.doc_lo == kv.doc_hi) & (q.doc_lo == kv.doc_lo)

    def reach(self):
        return Reach(same_document=True)


@dataclasses.dataclass(frozen=True)
class PrefixLM(Mask):
    """Causal, and prefix tokens (negative segment ids) see each other both ways."""

    def __call__(self, q_pos, kv_pos, q_seg, kv_seg):
        return (kv_pos <= q_pos) | ((q_seg < 0) & (kv_seg < 0))

    def classify(self, q, kv):
        may, full = Causal().classify(q, kv)
        return may | (q.pre_any & kv.pre_any), full | (q.pre_all & kv.pre_all)


@dataclasses.dataclass(frozen=True)
class MaskFn(Mask):
    """Any elementwise rule ``fn(q_pos, kv_pos, q_seg, kv_seg) -> bool``; blocks are "partial".

    ``fn`` is compared by identity (it is part of the compiled program's static key): define
    it once, not as a fresh lambda per call, to reuse compilations.
    """
    fn: Callable

    def __call__(self, q_pos, kv_pos, q_seg, kv_seg):
        return self.fn(q_pos, kv_pos, q_seg, kv_seg)


def default_mask(causal: bool | None, sliding_window: int | None,
                 mask: Mask | None) -> Mask:
    """The mask `zoo.ops.attention` applies: ``mask``, or the ``causal``/``sliding_window``
    shorthands (``causal=None`` means causal) combined with `Document`."""
    if mask is not None:
        if not isinstance(mask, Mask):
            raise TypeError(f"mask={mask!r} must be a zoo.ops.masks.Mask (Causal(), "
                            f"SlidingWindow(w), Document(), MaskFn(fn), ... combined with & |)")
        if causal is not None or sliding_window is not None:
            raise ValueError(f"mask={mask!r} is the whole mask, so causal={causal!r} and "
                             f"sliding_window={sliding_window!r} must be left unset; fold them "
                             f"into the mask, e.g. Causal() & SlidingWindow(w) & Document()")
        return mask
    m: Mask = Document()
    if causal is None or causal:
        m = Causal() & m
    if sliding_window is not None:
        m = SlidingWindow(sliding_window) & m
    return m


def evaluate(mask: Mask, q_pos, kv_pos, q_seg, kv_seg) -> jax.Array:
    """``mask`` with padding (segment 0) removed on both sides, elementwise."""
    return mask(q_pos, kv_pos, q_seg, kv_seg) & (q_seg != 0) & (kv_seg != 0)


def block_kind(mask: Mask, q: Bounds, kv: Bounds) -> jax.Array:
    """int32 scalar: EMPTY (0) if no row sees anything, FULL (1) if every pair is visible in
    every row (no padding), else PARTIAL (2)."""
    may, full = mask.classify(q, kv)
    may = jnp.any(may & q.some & kv.some)
    full = jnp.all(full & q.no_pad & kv.no_pad)
    return jnp.where(may, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)


def _expand(b: Bounds, axis: int) -> Bounds:
    return Bounds(**{f.name: jnp.expand_dims(getattr(b, f.name), axis)
                     for f in dataclasses.fields(b)})


def tile_visible(mask: Mask, q_pos, kv_pos, q_seg, kv_seg, q_tile: int,
                 kv_tile: int) -> jax.Array:
    """[L/q_tile, S/kv_tile] bool: False only where no row of the batch can see any pair of
    that (query tile, key tile) -- the per-tile form of `block_kind`'s EMPTY, for kernels that
    walk only the tiles that may be visible."""
    q, kv = tile_bounds(q_pos, kv_pos, q_seg, kv_seg, q_tile, kv_tile)
    may, _ = mask.classify(q, kv)
    return jnp.any(may & q.some & kv.some, axis=0)


def tile_bounds(q_pos, kv_pos, q_seg, kv_seg, q_tile: int, kv_tile: int):
    """`Bounds` of every query tile, [B, L/q_tile, 1], and key tile, [B, 1, S/kv_tile], of
    [B, L] / [B, S] positions and segment ids: ``mask.classify`` of the pair broadcasts to
    every (query tile, key tile) of every row."""
    B = q_pos.shape[0]
    q = _expand(bounds(q_pos.reshape(B, -1, q_tile), q_seg.reshape(B, -1, q_tile)), -1)
    kv = _expand(bounds(kv_pos.reshape(B, -1, kv_tile), kv_seg.reshape(B, -1, kv_tile)), -2)
    return q, kv


def attention_mask(q_positions: jax.Array, kv_positions: jax.Array,
                   q_segment_ids: jax.Array | None = None,
                   kv_segment_ids: jax.Array | None = None, *, causal: bool | None = None,
                   sliding_window: int | None = None, mask: Mask | None = None) -> jax.Array:
    """Dense boolean mask [B, L, S]: True where query l may attend to key s.

    ``*_segment_ids=None`` means one document with no padding (all ids 1).
    """
    m = default_mask(causal, sliding_window, mask)
    if q_segment_ids is None:
        q_segment_ids = jnp.ones(q_positions.shape, jnp.int32)
    if kv_segment_ids is None:
        kv_segment_ids = jnp.ones(kv_positions.shape, jnp.int32)
    return evaluate(m, q_positions[:, :, None], kv_positions[:, None, :],
                    q_segment_ids[:, :, None], kv_segment_ids[:, None, :])


def block_may_attend(q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
                     causal: bool | None = None, sliding_window: int | None = None,
                     mask: Mask | None = None) -> jax.Array:
    """Scalar bool: False only if the mask between the two blocks is certainly all False."""
    m = default_mask(causal, sliding_window, mask)
    kind = block_kind(m, bounds(q_positions, q_segment_ids), bounds(kv_positions, kv_segment_ids))
    return kind != EMPTY


def prefix_segment_ids(segment_ids, prefix_lengths) -> np.ndarray:
    """Mark the first ``prefix_lengths[b][i]`` tokens of document i of row b as prefix (negate
    their segment ids), for `PrefixLM`. numpy in, numpy out (a data-pipeline helper)."""
    seg = np.array(segment_ids, copy=True)
    for b, lengths in enumerate(prefix_lengths):
        for doc, n in enumerate(lengths, start=1):
            idx = np.flatnonzero(seg[b] == doc)[:n]
            seg[b, idx] = -doc
    return seg
