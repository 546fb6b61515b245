"""Context-parallel attention inside one shard: all-gather and ring, with an exact `custom_vjp`.

`attend_shard` runs under `shard_map` (or unsharded, with ``axes=()``). Each device holds
``L/cp`` queries and ``S/cp`` tokens of the *wire payload* -- what crosses the network -- with
their positions and segment ids. For ordinary attention the payload is (k, v); for MLA it is
the compressed latent and the shared rotary key, and ``expand(params, payload) -> (k, v)``
builds the per-head K/V on each shard after the transfer (its VJP sends the latent's gradient
back the same way, and the parameters' gradients stay local; `shard_map` sums them).

* ``"all_gather"``: gather the payload (+ positions, segments) over the sequence axes -- in
  one piece when the expanded K/V are no larger than the local queries, else in slices
  (`gather_slices`) -- and attend with the local queries. Backward re-gathers and
  reduce-scatters the payload's gradient.
* ``"ring"``: ``rounds`` rounds of ``cp`` steps (`ring_rounds`). Round h streams key piece h
  of ``rounds`` equal pieces of every shard's payload; at its step t device r holds that piece
  of shard r - t. Each step first *sends* the piece on (`ppermute`, independent of this step's
  compute, so XLA may overlap them), then attends to it and merges into the fp32 online
  softmax. Backward walks the same rounds; the gradient accumulator of a piece travels with
  it, and each step's piece gradients are computed before the accumulator that just arrived
  is touched, so its transfer overlaps the compute. The ring's own buffers (the piece computed
  on and the one arriving, the accumulator arriving and the one leaving, the step's fresh
  gradients) are piece-sized, so more rounds hold less for the same bytes on the wire.

Skipping: a block is split into ``split`` x ``split`` sub-blocks (per gathered shard for
all-gather; on the key side of a ring piece into ``max(1, split // rounds)``); each is
classified from position/segment bounds (`zoo.ops.masks.block_kind`) into "skip" (empty), the
kernel with ``masked=False`` (full) or with the mask (partial) -- for kernels with several
static ways to walk a partial block (the flash kernel's tile budgets,
`zoo.ops.flash.TilePlan`), the one the kernel picks from the data. One decision per
sub-block, none per tile: the count does not grow with the sequence length. For a kernel that
adds into the strategy's accumulators in place (`BlockKernel.accumulates`, the flash kernel:
forward into the running (out, lse), backward into (dq, dk, dv)) each way to run is a
`lax.while_loop` of 0 or 1 trips over the accumulators (`_run_if`): XLA keeps them in place
there, where a `conditional` copies its operands into every branch's loop. Other kernels
return a sub-block's results and one `lax.switch` picks the way. ``split=2`` matches the
load-balanced layout (each shard holds two chunks), so causal blocks are classified exactly
at chunk granularity. A kernel that classifies its own tiles
(`BlockKernel.classifies_tiles`, `zoo.ops.pallas_tpu`) gets each block pair whole instead:
no sub-blocks, no classification here, no branch.

Hop plan (``Config.hops``): when the mask bounds how far back/ahead in the sequence a query
sees (`zoo.ops.masks.Reach`) and the caller states how tokens lie across the shards
(``layout``), `hop_plan` lists the only shard offsets d (keys of shard r - d) that can hold a
visible key. The ring then fetches exactly those blocks, each straight from its home shard
(one `ppermute` by d, sent before the previous block's compute), and sends each block's dK/dV
straight home (one `ppermute` by -d, overlapping the next block's compute): nothing is moved
for the other hops, forward or backward. The plan is valid only if positions strictly increase
along the sequence within every document; `sequence_order_ok` checks that (and that queries
and keys are the same tokens) on the global positions and segment ids -- a few int compares
per token and one scalar all-reduce -- and a `lax.cond` falls back to the full ring when it
fails, so the result is exact for every input.

Memory: the backward computes ``delta = sum(dout * out)`` once; a kernel that takes it
(`BlockKernel.takes_delta`, the flash kernel) never sees ``out``, so the q-sized output is not
held through the backward's loop, and the dq accumulator is zero-filled from delta
(`_zeros_from`), so it does not exist during the forward. With an accumulating kernel no
sub-block result exists either (above), and the ring's buffers shrink with its rounds.

Sinks (``[N]`` logits with no value) join each row's softmax after the merge; their gradient is
``-sum(exp(sink - lse) * delta)``.

Legend: B batch, L local query length, S local kv length, N query heads, K kv heads,
H head dim, V value head dim; cp the number of sequence shards.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from zoo.ops.flash import loop, put_block, slice_block
from zoo.ops.kernels import BlockKernel, Scores
from zoo.ops.masks import PARTIAL, block_kind, bounds

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    strategy: str  # "ring" | "all_gather"
    axes: tuple[str, ...]  # mesh axes sharding the sequence (empty: unsharded)
    scores: Scores
    kernel: BlockKernel
    expand: Callable | None = None  # (params, payload) -> (k, v); None: payload is (k, v)
    split: int = 2
    sinks: bool = False
    hops: tuple[int, ...] | None = None  # `hop_plan`'s shard offsets; None: the full ring
    rounds: int | None = None  # the full ring's rounds (`ring_rounds`); None: by memory
    platform: str = "cpu"  # the mesh's (`zoo.partitioning.mesh_platform`): ring piece floor


LAYOUTS = (None, "contiguous", "balanced")


def _chunks(layout: str, cp: int) -> list[int]:
    """Shard of each equal chunk of the sequence, in sequence order."""
    if layout == "contiguous":
        return list(range(cp))
    return list(range(cp)) + list(range(cp - 1, -1, -1))  # shard r: chunks r and 2cp-1-r


def hop_plan(reach, layout: str | None, cp: int, length: int) -> tuple[int, ...] | None:
    """Shard offsets d in 1..cp-1 whose keys (shard r - d) some query of shard r may see, or
    None when that is every offset (the full ring) or nothing is known statically.

    ``reach`` is the mask's `zoo.ops.masks.Reach`, ``layout`` how the sequence lies on the
    shards: ``"contiguous"`` (shard r holds tokens [r*n, (r+1)*n)), ``"balanced"`` (2*cp
    chunks, shard r holds chunks r and 2*cp-1-r) or None (unknown: no plan). A query in chunk x
    of c tokens sees chunks x - ceil(back/c) .. x + ceil(ahead/c).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; valid values are {LAYOUTS} (how the sequence "
                         f"lies on the context shards; None: not known statically)")
    back, ahead = reach.sequence()
    if layout is None or cp == 1 or (back is None and ahead is None):
        return None
    shards = _chunks(layout, cp)
    c = length // len(shards)
    lo = len(shards) if back is None else -(-back // c)
    hi = len(shards) if ahead is None else -(-ahead // c)
    hops = {(shards[x] - shards[y]) % cp for x in range(len(shards))
            for y in range(max(0, x - lo), min(len(shards), x + hi + 1))}
    hops.discard(0)
    return None if len(hops) == cp - 1 else tuple(sorted(hops))


def _sequence_order(layout: str, cp: int, x):
    """[B, L] in the layout's order -> sequence order (static slices, a few int copies)."""
    if layout == "contiguous":
        return x
    B, L = x.shape
    halves = x.reshape(B, cp, 2, L // (2 * cp))
    return jnp.concatenate([halves[:, :, 0].reshape(B, -1),
                            halves[:, ::-1, 1].reshape(B, -1)], axis=1)


def sequence_order_ok(layout: str, cp: int, qpos, kpos, qseg, kseg) -> jax.Array:
    """Scalar bool: the hop plan's assumption holds for this batch (global [B, L] arrays).

    Sufficient, cheap: queries and keys are the same tokens; in sequence order no token
    follows padding; and each token after the first has a larger |segment id| than the one
    before, or the same one and a larger position. Then every document's positions strictly
    increase along the sequence, so sequence distance within a document is at most position
    distance. The data pipeline's packed rows (`zoo.data`, no reordering or the ``"row"``
    reordering) pass; anything else runs the full ring.
    """
    if qpos.shape != kpos.shape:
        return jnp.asarray(False)
    pos, seg = (_sequence_order(layout, cp, x) for x in (qpos, qseg))
    doc, valid = jnp.abs(seg), seg != 0
    prev, cur = (slice(None), slice(None, -1)), (slice(None), slice(1, None))
    step = (doc[cur] > doc[prev]) | ((doc[cur] == doc[prev]) & (pos[cur] > pos[prev]))
    return (jnp.all(qpos == kpos) & jnp.all(qseg == kseg)
            & jnp.all(~valid[cur] | (valid[prev] & step)))


def attend_shard(q, payload, params, sinks, ok, qpos, kpos, qseg, kseg, *, cfg: Config):
    """One shard's attention output [B, L, N, V] in q's dtype (see module docstring). ``ok``:
    scalar bool, `sequence_order_ok` of the whole batch (read only with ``cfg.hops``)."""
    if cfg.strategy not in ("ring", "all_gather"):
        raise ValueError(f"strategy {cfg.strategy!r} must be 'ring' or 'all_gather'")
    return _attend(cfg, q, tuple(payload), tuple(params), sinks, ok, qpos, kpos, qseg, kseg)


def _cp(cfg: Config) -> int:
    return lax.axis_size(cfg.axes) if cfg.axes else 1


def _expand(cfg, params, payload):
    return tuple(payload) if cfg.expand is None else tuple(cfg.expand(params, payload))


def ring_perm(axes, offset):
    """(axes in mesh order, ppermute pairs) that send shard r to shard r + offset, r being
    ``axis_index(axes)`` -- the sequence order, major axis first as ``axes`` names them.

    `lax.ppermute` over several axes numbers its group in the *mesh's* axis order: jax 0.10
    silently sorted a group given in another order (``("context", "expert")`` on a mesh that
    declares ``expert`` first sent r -> r + 1 in the wrong order), and jax 0.12 refuses it.
    So name the axes in mesh order and translate each shard index into that numbering."""
    n = lax.axis_size(axes)
    pairs = [(i, (i + offset) % n) for i in range(n)]
    mesh_names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    if len(axes) < 2 or not set(axes) <= set(mesh_names):
        return axes, pairs
    in_mesh = tuple(sorted(axes, key=mesh_names.index))
    if in_mesh == tuple(axes):
        return axes, pairs
    sizes = {a: lax.axis_size(a) for a in axes}

    def renumber(r):
        coords = {}
        for a in reversed(axes):  # unravel r over `axes`, the last one minor
            r, coords[a] = divmod(r, sizes[a])
        m = 0
        for a in in_mesh:  # ravel over the mesh's order
            m = m * sizes[a] + coords[a]
        return m

    return in_mesh, [(renumber(i), renumber(j)) for i, j in pairs]


def _shift(xs, cfg, offset=1):
    """Send every array in xs `offset` shards on (r -> r + offset): shard r gets shard r - d's."""
    if not cfg.axes:
        return xs
    axes, perm = ring_perm(tuple(cfg.axes), offset)
    return jax.tree.map(lambda x: lax.ppermute(x, axes, perm), xs)


def _gather(x, cfg):
    return lax.all_gather(x, cfg.axes, axis=1, tiled=True) if cfg.axes else x


# keys per ring step at least: a smaller step costs more in per-step latency (and, on GPU,
# the host reads of its sub-block decisions) than its memory saves; wider on accelerators,
# whose kernels want wide tiles (`zoo.ops.flash.ACCELERATOR_TILES`); a floor to check there
# with benchmarks/accel_attention.py
MIN_RING_PIECE = {"cpu": 256, "accelerator": 1024}


def gather_slices(cp, q_shape, k_shape, v_shape, min_piece=None, platform="cpu"):
    """(number of gather steps m, keys per shard per step) for the all-gather strategy, from
    local shapes [B, L/cp, N, H], [B, S/cp, K, H], [B, S/cp, K, V] of the *expanded* K/V.

    One gather (m=1, Llama-3 style) when the whole K/V is no larger than the local queries.
    Otherwise m slices -- slice t is keys [t*c, (t+1)*c) of every shard -- with m the smallest
    divisor of the local kv length that keeps a gathered slice within a quarter of that size,
    so per-device memory stays ~1/cp (a quarter, not all of it: the gathered slice, its layout
    copies and the backward's per-slice dK/dV are all that size), as long as a gathered slice
    keeps at least ``min_piece`` keys (default `MIN_RING_PIECE` of `platform`, the ring's
    floor: narrower steps cost more in per-step latency than their memory saves, so memory
    then gives way). Either way the bytes moved equal one gather (and one reduce-scatter).
    """
    s_local = k_shape[1]
    if cp == 1:
        return 1, s_local
    if min_piece is None:
        min_piece = MIN_RING_PIECE["cpu" if platform == "cpu" else "accelerator"]
    need = cp * s_local * k_shape[2] * (k_shape[3] + v_shape[3])
    budget = q_shape[1] * q_shape[2] * q_shape[3]
    if need > budget:
        budget //= 4
    m = min(-(-need // budget), s_local)
    while s_local % m:
        m += 1
    while m > 1 and cp * (s_local // m) < min_piece:  # widen to the floor (a divisor still)
        m -= 1
        while s_local % m:
            m -= 1
    return m, s_local // m


# -- visiting the sub-blocks of one block pair ------------------------------------------------

def _pieces(cfg, L, S, kv_groups, kv_split=None):
    """(query piece length, number, key piece length, number): ``split`` pieces per side (on
    the key side ``kv_split`` if given), and per gathered shard (``kv_groups``) on the key
    side."""
    lq = L // cfg.split if L % cfg.split == 0 else L
    per, ks = S // kv_groups, cfg.split if kv_split is None else kv_split
    lk = per // ks if per % ks == 0 else per
    return lq, L // lq, lk, S // lk



def ring_rounds(cp, q_shape, k_shape, v_shape, min_piece=None, platform="cpu") -> int:
    """Rounds n of the full ring, from local shapes [B, L/cp, N, H], [B, S/cp, K, H],
    [B, S/cp, K, V] of the *expanded* K/V: each round streams one of n equal key pieces of
    every shard around the ring, so the ring's own buffers -- the piece computed on, the one
    arriving, and their two dK/dV accumulators -- shrink with n (the bytes moved do not).

    The smallest power of two n that brings one piece's K and V within 1/16 of the local
    queries (the four buffers within a quarter), as long as n divides the local kv length and
    a piece keeps at least ``min_piece`` keys (default `MIN_RING_PIECE` of `platform`); 1 at
    cp=1. At the benchmark's 16k, cp=8 shape (2,048 local tokens, 8 heads, 2 kv heads) that is
    8 rounds of 256 keys on CPU (2 of 1,024 on an accelerator).
    """
    s_local = k_shape[1]
    if cp == 1:
        return 1
    if min_piece is None:
        min_piece = MIN_RING_PIECE["cpu" if platform == "cpu" else "accelerator"]
    kv = s_local * k_shape[2] * (k_shape[3] + v_shape[3])
    budget = q_shape[1] * q_shape[2] * q_shape[3] / 16
    n = 1
    while kv / n > budget and s_local % (2 * n) == 0 and s_local // (2 * n) >= min_piece:
        n *= 2
    return n


def _rounds(cfg, q, params, payload) -> tuple[int, int]:
    """(rounds of the full ring, key sub-blocks per piece): ``cfg.rounds`` or `ring_rounds`;
    a piece is split so that key sub-blocks are never coarser than ``split`` per block."""
    k, v = jax.eval_shape(lambda: _expand(cfg, params, payload))
    n = cfg.rounds or ring_rounds(_cp(cfg), q.shape, k.shape, v.shape, platform=cfg.platform)
    per = k.shape[1] // n
    ks = max(1, cfg.split // n)
    return n, ks if per % ks == 0 else 1


def _piece(xs, h, n):
    """Piece h (traced) of n equal pieces along axis 1 of every array in the tree xs."""
    return jax.tree.map(lambda x: slice_block(x, h, x.shape[1] // n), xs)


def _merge(out, lse, o, o_lse):
    """Online-softmax merge of (o, o_lse) into the running (out [B,L,N,V], lse [B,N,L])."""
    new = jnp.logaddexp(lse, o_lse)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    w1, w2 = (jnp.moveaxis(jnp.exp(x - safe), 1, 2)[..., None] for x in (lse, o_lse))
    return out * w1 + o * w2, new


def _whole(cfg) -> bool:
    """The kernel classifies its own tiles (`BlockKernel.classifies_tiles`): each block pair
    goes to it whole, with the mask, and the strategy neither splits nor classifies it."""
    return getattr(cfg.kernel, "classifies_tiles", False)


def _plans(kernel, L, S):
    """The kernel's static ways to walk a partial [L, S] sub-block (`BlockKernel`)."""
    plans = getattr(kernel, "partial_plans", None)
    return tuple(plans(L, S)) if plans is not None else (True,)


def _branch(cfg, kind, plans, q_pos, kv_pos, q_seg, kv_seg):
    """Switch index: skip (EMPTY), full (FULL) or PARTIAL + the kernel's plan for the block."""
    if len(plans) == 1:
        return kind
    plan = cfg.kernel.pick_plan(plans, cfg.scores, q_pos, kv_pos, q_seg, kv_seg)
    return jnp.where(kind == PARTIAL, PARTIAL + plan, kind)


def _forward_block(cfg, q, qp, qs, k, v, kp, ks, state, kv_groups=1, kv_split=None):
    """Merge attention of q over one (k, v) block into the running (out, lse)."""
    B, L, N, _ = q.shape
    S, V = k.shape[1], v.shape[-1]
    whole = _whole(cfg)
    lq, nq, lk, nk = (L, 1, S, 1) if whole else _pieces(cfg, L, S, kv_groups, kv_split)
    plans = _plans(cfg.kernel, lq, lk)
    windowed = getattr(cfg.kernel, "windowed", False)
    into = windowed and getattr(cfg.kernel, "accumulates", False)

    def pair(idx, state):
        a, b = idx // nk, idx % nk
        qpa, qsa = slice_block(qp, a, lq), slice_block(qs, a, lq)
        kpb, ksb = slice_block(kp, b, lk), slice_block(ks, b, lk)
        kind = block_kind(cfg.scores.mask, bounds(qpa, qsa), bounds(kpb, ksb))
        branch = _branch(cfg, kind, plans, qpa, kpb, qsa, ksb)
        if into:  # the kernel merges into the running (out, lse) in place
            def run_into(masked):
                return lambda st: cfg.kernel.forward(q, k, v, qp, kp, qs, ks, scores=cfg.scores,
                                                     masked=masked, into=st,
                                                     window=(a * lq, lq, b * lk, lk))
            return _one_of(branch, (run_into(False), *map(run_into, plans)), state)

        def kv():
            return slice_block(k, b, lk), slice_block(v, b, lk)

        def run(masked):
            if windowed:  # whole arrays, no sub-block copies (see `BlockKernel`)
                return lambda: cfg.kernel.forward(q, k, v, qp, kp, qs, ks, scores=cfg.scores,
                                                  masked=masked, window=(a * lq, lq, b * lk, lk))
            return lambda: cfg.kernel.forward(slice_block(q, a, lq), *kv(), qpa, kpb, qsa, ksb,
                                              scores=cfg.scores, masked=masked)

        def skip():
            return jnp.zeros((B, lq, N, V), F32), jnp.full((B, N, lq), -jnp.inf, F32)

        o, o_lse = (run(True)() if whole
                    else lax.switch(branch, (skip, run(False), *map(run, plans))))
        out, lse = state
        oa, la = _merge(slice_block(out, a, lq), slice_block(lse, a, lq, axis=2), o, o_lse)
        return put_block(out, oa, a, lq), put_block(lse, la, a, lq, axis=2)

    return pair(jnp.int32(0), state) if whole else loop(nq * nk, pair, state)


def _backward_block(cfg, q, qp, qs, out, lse, dout, dq, k, v, kp, ks, kv_groups=1,
                    delta=None, kv_split=None):
    """(dq + this block's dq, dk, dv) fp32 of one block pair from the global (out, lse), or
    (out=None) from (delta, lse) for kernels that take delta (`BlockKernel.takes_delta`)."""
    rows = {} if delta is None else dict(delta=delta)
    L, S = q.shape[1], k.shape[1]
    whole = _whole(cfg)
    lq, nq, lk, nk = (L, 1, S, 1) if whole else _pieces(cfg, L, S, kv_groups, kv_split)
    plans = _plans(cfg.kernel, lq, lk)
    windowed = getattr(cfg.kernel, "windowed", False)
    into = windowed and getattr(cfg.kernel, "accumulates", False)

    def pair(idx, acc):
        a, b = idx // nk, idx % nk
        qpa, qsa = slice_block(qp, a, lq), slice_block(qs, a, lq)
        kpb, ksb = slice_block(kp, b, lk), slice_block(ks, b, lk)
        kind = block_kind(cfg.scores.mask, bounds(qpa, qsa), bounds(kpb, ksb))
        branch = _branch(cfg, kind, plans, qpa, kpb, qsa, ksb)
        if into:  # the kernel adds into the accumulators in place, one loop per way to run
            def run_into(masked):
                return lambda acc: cfg.kernel.backward(
                    q, k, v, qp, kp, qs, ks, out, lse, dout, scores=cfg.scores, masked=masked,
                    window=(a * lq, lq, b * lk, lk), into=acc, **rows)
            return _one_of(branch, (run_into(False), *map(run_into, plans)), acc)

        def run(masked):
            if windowed:  # whole arrays, no sub-block copies (see `BlockKernel`)
                return lambda: cfg.kernel.backward(
                    q, k, v, qp, kp, qs, ks, out, lse, dout, scores=cfg.scores, masked=masked,
                    window=(a * lq, lq, b * lk, lk), **rows)
            sub = {n: slice_block(x, a, lq, axis=2) for n, x in rows.items()}
            return lambda: cfg.kernel.backward(
                slice_block(q, a, lq), slice_block(k, b, lk), slice_block(v, b, lk),
                qpa, kpb, qsa, ksb,
                None if out is None else slice_block(out, a, lq), slice_block(lse, a, lq, axis=2),
                slice_block(dout, a, lq), scores=cfg.scores, masked=masked, **sub)

        def skip():
            return (jnp.zeros((*q.shape[:1], lq, *q.shape[2:]), F32),
                    jnp.zeros((*k.shape[:1], lk, *k.shape[2:]), F32),
                    jnp.zeros((*v.shape[:1], lk, *v.shape[2:]), F32))

        gq, gk, gv = (run(True)() if whole
                      else lax.switch(branch, (skip, run(False), *map(run, plans))))
        dq, dk, dv = acc
        return (put_block(dq, slice_block(dq, a, lq) + gq, a, lq),
                put_block(dk, slice_block(dk, b, lk) + gk, b, lk),
                put_block(dv, slice_block(dv, b, lk) + gv, b, lk))

    # plain zeros: inside the backward's loops they cannot be hoisted into the forward
    init = (dq, jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    return pair(jnp.int32(0), init) if whole else loop(nq * nk, pair, init)


ONE_OF = "zoo_one_of"  # named scope of `_one_of`'s loops: XLA's static counts take one


def _one_of(branch, fns, x):
    """``fns[branch - 1](x)``, or x for branch 0, as one `_run_if` loop per function (their
    ``op_name`` carries `ONE_OF`, so `zoo.ops.hlo.hlo_stats` counts the costliest one
    alone, as it does a conditional's branches)."""
    with jax.named_scope(ONE_OF):
        for i, fn in enumerate(fns, 1):
            x = _run_if(branch == i, fn, x)
    return x


def _run_if(pred, fn, x):
    """``fn(x) if pred else x`` as a while loop of 0 or 1 trips: XLA keeps the carried
    accumulators in place through it, where a conditional copies them into every branch's
    loop (and separate per-branch results would cost a sub-block's fp32 outputs)."""
    return lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32),
                          lambda c: (c[0] + 1, fn(c[1])), (jnp.int32(0), x))[1]


def _zeros_after(x, shape):
    """fp32 zeros of `shape` that XLA can only materialise once `x` (a backward value) exists.

    Plain `jnp.zeros` accumulators have no inputs: XLA's scheduler may fill them at the start
    of the program and keep them alive through the whole forward, adding q + k + v sized fp32
    buffers to the peak. An optimization barrier over (zeros, x) makes them available only
    together with `x`, without arithmetic on it.
    """
    zeros, _ = lax.optimization_barrier((jnp.zeros(shape, F32), x))
    return zeros


def _zeros_from(x, shape):
    """fp32 zeros of `shape` computed from `x`, so they cannot exist before `x` does.

    XLA:CPU expands optimization barriers before it schedules, so `_zeros_after`'s zeros can
    still be filled at the program's start, keeping the q-sized dq accumulator alive through
    the whole forward (ring and all-gather).
    A broadcast of ``0 * x[0]`` (0 where that is not finite) is exactly zero (or -0.0, which
    adds exactly) for every input.
    """
    first = x.reshape(-1)[0].astype(F32)
    return jnp.broadcast_to(jnp.where(jnp.isfinite(first), first * 0.0, 0.0), shape)


# -- the custom_vjp ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg, q, payload, params, sinks, ok, qpos, kpos, qseg, kseg):
    out, _ = _forward(cfg, q, payload, params, sinks, ok, qpos, kpos, qseg, kseg)
    return out


def _planned(cfg, ok, planned, full, *operands):
    """`planned` when there is a hop plan and the batch satisfies it, else `full`."""
    if cfg.hops is None:
        return full(*operands)
    return lax.cond(ok, planned, full, *operands)


def _blocks(cfg, home):
    """Yield (offset, block): the local block (offset 0), then the plan's hops, each fetched
    from its home shard one step ahead -- the send for the next block is issued before the
    caller computes on the current one, and depends on no compute."""
    nxt = _shift(home, cfg, cfg.hops[0])
    yield 0, home
    for i, d in enumerate(cfg.hops):
        cur = nxt
        if i + 1 < len(cfg.hops):
            nxt = _shift(home, cfg, cfg.hops[i + 1])
        yield d, cur


def _gathered(cfg, t, c, xs):
    """Slice t of every shard's arrays, gathered: [B, cp*c, ...] in shard order."""
    return tuple(_gather(slice_block(x, t, c), cfg) for x in xs)


def _slices(cfg, q, params, payload):
    k, v = jax.eval_shape(lambda: _expand(cfg, params, payload))
    return gather_slices(_cp(cfg), q.shape, k.shape, v.shape, platform=cfg.platform)


def _forward(cfg, q, payload, params, sinks, ok, qpos, kpos, qseg, kseg):
    """(out in q's dtype, lse [B,N,L] fp32), sinks included."""
    B, L, N, _ = q.shape
    _, v0 = jax.eval_shape(lambda: _expand(cfg, params, payload))
    state = (jnp.zeros((B, L, N, v0.shape[-1]), F32), jnp.full((B, N, L), -jnp.inf, F32))

    def attend(pl, kpb, ksb, state, groups, kv_split=None):
        k, v = _expand(cfg, params, pl)
        return _forward_block(cfg, q, qpos, qseg, k, v, kpb, ksb, state, groups, kv_split)

    if cfg.strategy == "all_gather" or _cp(cfg) == 1:
        m, c = _slices(cfg, q, params, payload)

        def gather_step(t, state):
            with jax.named_scope("all_gather_kv"):
                *pl, kpb, ksb = _gathered(cfg, t, c, (*payload, kpos, kseg))
            return attend(tuple(pl), kpb, ksb, state, _cp(cfg))

        out, lse = loop(m, gather_step, state)
    else:
        n, ks = _rounds(cfg, q, params, payload)

        def ring_step(carry, _):
            pl, kpb, ksb, state = carry
            nxt = _shift((pl, kpb, ksb), cfg)  # sent before (and independent of) the compute
            with jax.named_scope("ring_block"):
                state = attend(pl, kpb, ksb, state, 1, kv_split=ks)
            return (*nxt, state), None

        def ring_round(h, state):
            pl, kpb, ksb = _piece((payload, kpos, kseg), h, n)
            (*_, state), _ = lax.scan(ring_step, (pl, kpb, ksb, state), None, length=_cp(cfg))
            return state

        def full(state):
            return loop(n, ring_round, state)

        def planned(state):
            for _, (pl, kpb, ksb) in _blocks(cfg, (payload, kpos, kseg)):
                with jax.named_scope("ring_hop"):
                    state = attend(pl, kpb, ksb, state, 1)
            return state

        out, lse = _planned(cfg, ok, planned, full, state)
    if cfg.sinks:  # a sink is one more logit per head in every row's softmax, with no value
        total = jnp.logaddexp(lse, sinks.astype(F32)[None, :, None])
        out = out * jnp.moveaxis(jnp.exp(lse - total), 1, 2)[..., None]
        lse = total
    return out.astype(q.dtype), lse


def _attend_fwd(cfg, q, payload, params, sinks, ok, qpos, kpos, qseg, kseg):
    out, lse = _forward(cfg, q, payload, params, sinks, ok, qpos, kpos, qseg, kseg)
    return out, (q, payload, params, sinks, ok, qpos, kpos, qseg, kseg, out, lse)


def _payload_vjp(cfg, params, pl):
    """((k, v), vjp) of the expansion; the cotangents come back in fp32."""
    if cfg.expand is None:
        return tuple(pl), lambda g: (jax.tree.map(jnp.zeros_like, params), tuple(g))

    def f(params, pl):
        return tuple(x.astype(F32) for x in _expand(cfg, params, pl))

    kv32, vjp = jax.vjp(f, params, tuple(pl))
    shapes = jax.eval_shape(lambda: _expand(cfg, params, pl))
    k, v = (y.astype(s.dtype) for y, s in zip(kv32, shapes))

    def back(g):
        dparams, dpl = vjp(tuple(g))  # fp32 too (float8 cotangents of an FP8 copy: zeros)
        return jax.tree.map(lambda x: x.astype(F32), dparams), tuple(x.astype(F32) for x in dpl)

    return (k, v), back


def _attend_bwd(cfg, res, dout):
    q, payload, params, sinks, ok, qpos, kpos, qseg, kseg, out, lse = res

    # delta = sum(dout * out), once: with a kernel that takes it, `out` is dead from here on
    delta = jnp.einsum("blnv,blnv->bnl", dout.astype(F32), out.astype(F32))
    takes = getattr(cfg.kernel, "takes_delta", False)
    out_k, delta_k = (None, delta) if takes else (out, None)

    def grads(pl, kpb, ksb, dq, groups, kv_split=None):
        (k, v), back = _payload_vjp(cfg, params, pl)
        dq, dk, dv = _backward_block(cfg, q, qpos, qseg, out_k, lse, dout, dq, k, v, kpb, ksb,
                                     groups, delta_k, kv_split)
        dparams, dpl = back((dk, dv))
        return dq, dparams, dpl

    # accumulators zero-filled only once the backward starts (see `_zeros_after`)
    zeros = functools.partial(jax.tree.map, lambda x: _zeros_after(dout, x.shape))
    gather = cfg.strategy == "all_gather" or _cp(cfg) == 1
    # delta exists only once the forward is done (dout may be a constant of the program)
    dq = _zeros_from(delta, q.shape)
    dparams = zeros(params)
    if gather:
        m, c = _slices(cfg, q, params, payload)

        def gather_step(t, carry):
            dq, dparams, dpayload = carry
            with jax.named_scope("all_gather_kv"):
                *pl, kpb, ksb = _gathered(cfg, t, c, (*payload, kpos, kseg))
            dq, dparams_b, dpl = grads(tuple(pl), kpb, ksb, dq, _cp(cfg))
            if cfg.axes:
                with jax.named_scope("reduce_scatter_dkv"):
                    dpl = tuple(lax.psum_scatter(x, cfg.axes, scatter_dimension=1, tiled=True)
                                for x in dpl)
            dpayload = tuple(put_block(d, x, t, c) for d, x in zip(dpayload, dpl))
            return dq, jax.tree.map(jnp.add, dparams, dparams_b), dpayload

        dq, dparams, dpayload = loop(m, gather_step, (dq, dparams, zeros(payload)))
    else:
        n, ks = _rounds(cfg, q, params, payload)

        def ring_step(carry, _):
            pl, kpb, ksb, acc, dq, dparams = carry
            nxt = _shift((pl, kpb, ksb), cfg)
            with jax.named_scope("ring_block_grad"):
                dq, dparams_b, dpl = grads(pl, kpb, ksb, dq, 1, kv_split=ks)  # not `acc`
            # the accumulator that arrived last step is used only now, so its transfer
            # overlaps the block's compute; it travels on with its piece, home after cp hops
            acc = _shift(tuple(a + d for a, d in zip(acc, dpl)), cfg)
            return (*nxt, acc, dq, jax.tree.map(jnp.add, dparams, dparams_b)), None

        def ring_round(h, carry):
            dq, dparams, dpayload = carry
            pl, kpb, ksb = _piece((payload, kpos, kseg), h, n)
            init = (pl, kpb, ksb, zeros(pl), dq, dparams)
            (*_, acc, dq, dparams), _ = lax.scan(ring_step, init, None, length=_cp(cfg))
            c = kpos.shape[1] // n
            return dq, dparams, tuple(put_block(d, a, h, c) for d, a in zip(dpayload, acc))

        def full(dq, dparams):
            return loop(n, ring_round, (dq, dparams, zeros(payload)))

        def planned(dq, dparams):
            dpayload = home = None
            for d, (pl, kpb, ksb) in _blocks(cfg, (payload, kpos, kseg)):
                with jax.named_scope("ring_hop_grad"):
                    dq, dparams_b, dpl = grads(pl, kpb, ksb, dq, 1)
                dparams = jax.tree.map(jnp.add, dparams, dparams_b)
                if d == 0:  # the local block's dK/dV stay home
                    dpayload = dpl
                    continue
                if home is not None:  # the previous hop's dK/dV, sent during this compute
                    dpayload = tuple(map(jnp.add, dpayload, home))
                home = _shift(dpl, cfg, -d)  # straight back to shard r - d, whose keys they are
            return dq, dparams, tuple(map(jnp.add, dpayload, home))

        dq, dparams, dpayload = _planned(cfg, ok, planned, full, dq, dparams)
    dsinks = None
    if cfg.sinks:  # d lse_total / d sink = p_sink; d loss / d lse_total = -delta
        p_sink = jnp.exp(sinks.astype(F32)[None, :, None] - jnp.where(jnp.isfinite(lse), lse,
                                                                      jnp.inf))
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    else:
        dsinks = jnp.zeros_like(sinks)
    cast = lambda ds, xs: tuple(d.astype(x.dtype) for d, x in zip(ds, xs))
    return (dq.astype(q.dtype), cast(dpayload, payload),
            jax.tree.map(lambda d, p: d.astype(p.dtype), dparams, params), dsinks,
            None, None, None, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)
