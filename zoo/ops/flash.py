"""The zoo flash kernel: tiled (flash-style) attention of one query block over one key block.

A `zoo.ops.kernels.BlockKernel` in pure JAX that runs on any platform. Both passes walk a list
of (``q_tile`` x ``kv_tile``) tile pairs with one loop over a *static* trip count (`loop`: a
while loop, so nothing is stacked per tile under `jax.checkpoint`) and dynamic slices: no
per-tile `lax.cond` (on GPU each would send its predicate to the host) and no loop whose
length is known only at run time, so one [B, N, q_tile, kv_tile] logit tile is the largest
temporary and the compiled kernel holds no conditional at all.

Skipping is shared with the strategy (`zoo.ops.ring`), which classifies each sub-block: empty
ones never reach the kernel, fully visible ones come with ``masked=False`` (every tile, the
mask not evaluated), and a partially masked one with the `TilePlan` picked by `pick_plan` --
one more way the strategy's per-sub-block decision can run:

* ``TilePlan(budget)``: the tiles that may be visible (`zoo.ops.masks.tile_visible`, from
  per-tile position/segment bounds, so exact for any token order and packing) are compacted
  at run time into a list of ``budget`` entries, padding entries masked out; the plan is
  picked only when they fit. The budget is ``T/2 + d`` of ``T`` tiles (``d`` tiles per side):
  a causal diagonal block fits, so do bands (windows, chunks, short documents). One budget,
  because each plan is one more copy of the kernel in the program (compile time).
* ``TilePlan(None)``: every tile, masked elementwise (any block).

* `FlashKernel.forward` -> (out [B,L,N,V] fp32 normalised over this block, lse [B,N,L] fp32),
  or with ``into=(out, lse)`` the strategy's running arrays with the block merged in
  (``BlockKernel.accumulates``): the online softmax is kept in normalised form tile by tile
  (one rescale per row and tile), so no block-sized accumulator exists beside the result.
* `FlashKernel.backward` from the global (out, lse): p = exp(s - lse) are the true
  probabilities and delta = sum(dout * out) the true softmax-Jacobian term, so the block's
  (dq, dk, dv) are exact on their own (``into=``: added into the strategy's accumulators).
  Score modifiers (soft cap, `ScoreMod`) are differentiated with their exact VJP per tile.

Matmuls take the operands' dtype (bf16 stays bf16) and accumulate in fp32
(``preferred_element_type``); softmax statistics are fp32.

Legend: B batch, L queries, S keys, Q query tile, C key tile, K kv heads, G query heads per kv
head (N = K*G), H q/k head dim, V value head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from zoo.ops.kernels import BlockKernel, Scores, register_kernel
from zoo.ops.masks import evaluate, tile_visible

F32 = jnp.float32
# Default tiles: on CPU 64x64 was the fastest of 32..256 and keeps the per-device constant
# small next to the 1/cp-sized activations; accelerators want wide tiles to fill the
# MXU/tensor cores.
CPU_TILES = (64, 64)
ACCELERATOR_TILES = (512, 512)


def tile_size(n: int, target: int) -> int:
    """Largest divisor of n that is <= target (tiles must cover the block exactly)."""
    t = min(n, target)
    while n % t:
        t -= 1
    return t


def loop(trips: int, body, init):
    """``lax.fori_loop(0, trips, body, init)`` as a `lax.while_loop` with a static bound.

    A fori_loop with a static trip count is a `lax.scan`, and inside `jax.checkpoint` JAX
    partially evaluates a scan's body: whatever depends only on non-differentiated inputs
    (the positions, segments, hence every tile's mask and the compacted tile list) is split
    off into the forward pass and *stacked* per iteration as a residual (gigabytes of masks
    per MLA layer at DeepSeek-V3 shapes). The kernels are forward-only code inside a
    `custom_vjp`, so they never need scan's reverse-mode rule; a while loop is recomputed
    whole by the backward instead. XLA still sees a constant trip count.
    """
    def step(carry):
        t, state = carry
        return t + 1, body(t, state)

    return lax.while_loop(lambda c: c[0] < trips, step, (jnp.int32(0), init))[1]


def slice_block(x, i, size, axis=1):
    """Block `i` of `size` along `axis` (traced `i`)."""
    return lax.dynamic_slice_in_dim(x, i * size, size, axis)


def put_block(x, update, i, size, axis=1):
    """`x` with block `i` of `size` along `axis` replaced by `update` (cast to `x`'s dtype)."""
    return lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), i * size, axis)


def _add_at(x, update, start, axis=1):
    n = update.shape[axis]
    return lax.dynamic_update_slice_in_dim(
        x, lax.dynamic_slice_in_dim(x, start, n, axis) + update.astype(x.dtype), start, axis)


def _bqkg(x):
    """[B,K,G,Q] -> [B,Q,K,G,1], to scale a [B,Q,K,G,V] tile per row."""
    return jnp.moveaxis(x, -1, 1)[..., None]


def _tile_logits(scores: Scores, masked, q, k, qp, kp, qs, ks, head, ok=None):
    """Logits [B,K,G,Q,C] fp32 (-inf where masked) and the VJP of the score modifiers."""
    s = jnp.einsum("bqkgh,bckh->bkgqc", q, k, preferred_element_type=F32) * scores.scale
    tokens = (qp[:, None, None, :, None], kp[:, None, None, None, :],
              qs[:, None, None, :, None], ks[:, None, None, None, :])
    mod_vjp = None
    if scores.modified:
        s, mod_vjp = jax.vjp(lambda x: scores.modify(x, *tokens, head), s)
    if masked:
        visible = evaluate(scores.mask, *tokens)
        s = jnp.where(visible if ok is None else visible & ok, s, -jnp.inf)
    return s, mod_vjp


def _window(window, q, k, q_pos, kv_pos, q_seg, kv_seg):
    """The kernel's view of a block: (positions and segments of the window, L, S, q tile
    reader, k tile reader). ``window=(q_start, L, kv_start, S)`` (starts traced, lengths
    static): the big arrays stay whole and tiles are read at the offset, so the strategy
    never materialises a sub-block copy of q, out, dout, k or v; None: the whole arrays."""
    if window is None:
        q0, L, k0, S = 0, q.shape[1], 0, k.shape[1]
    else:
        q0, L, k0, S = window
        q_pos, q_seg = (lax.dynamic_slice_in_dim(x, q0, L, 1) for x in (q_pos, q_seg))
        kv_pos, kv_seg = (lax.dynamic_slice_in_dim(x, k0, S, 1) for x in (kv_pos, kv_seg))

    def qt(x, i, size, axis=1):
        return lax.dynamic_slice_in_dim(x, q0 + i * size, size, axis)

    def kt(x, j, size):
        return lax.dynamic_slice_in_dim(x, k0 + j * size, size, 1)

    return q_pos, kv_pos, q_seg, kv_seg, L, S, qt, kt


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How the kernel walks a partially masked block: at most ``budget`` tiles that may be
    visible, compacted at run time, or every tile (``budget=None``). See the module docstring."""
    budget: int | None = None


@dataclasses.dataclass(frozen=True)
class FlashKernel(BlockKernel):
    """Pure-JAX flash kernel; ``q_tile``/``kv_tile`` default by the mesh's platform
    (`CPU_TILES` on CPU, `ACCELERATOR_TILES` elsewhere; `for_platform`, which the attention op
    applies), shrunk to divisors of the block lengths. ``tile_budget``:
    offer the `TilePlan` budget for partially masked blocks (False: every tile, one branch
    fewer per sub-block decision, which compiles faster; see docs/attention.md)."""
    q_tile: int | None = None
    kv_tile: int | None = None
    tile_budget: bool = True
    windowed = True  # takes ``window=`` (see `BlockKernel`)
    takes_delta = True  # takes ``delta=`` instead of the global out (see `BlockKernel`)
    accumulates = True  # forward and backward take ``into=`` (see `BlockKernel`)

    def for_platform(self, platform: str, device=None) -> FlashKernel:
        dq, dk = CPU_TILES if platform == "cpu" else ACCELERATOR_TILES
        return dataclasses.replace(self, q_tile=self.q_tile or dq, kv_tile=self.kv_tile or dk)

    def tiles(self, L: int, S: int) -> tuple[int, int]:
        if self.q_tile is None or self.kv_tile is None:  # used outside the attention op
            from zoo.partitioning import mesh_platform
            return self.for_platform(mesh_platform(None)).tiles(L, S)
        return tile_size(L, self.q_tile), tile_size(S, self.kv_tile)

    def partial_plans(self, L: int, S: int) -> tuple[TilePlan, ...]:
        """Static plans for a partially masked [L, S] block: a budget of half the tiles plus
        one row (a causal diagonal block fits), then every tile (any block)."""
        tq, tk = self.tiles(L, S)
        nq, nk = L // tq, S // tk
        budget = nq * nk // 2 + max(nq, nk)
        if not self.tile_budget or budget >= nq * nk:
            return (TilePlan(None),)
        return TilePlan(budget), TilePlan(None)

    def pick_plan(self, plans, scores, q_pos, kv_pos, q_seg, kv_seg) -> jax.Array:
        """int32 index into `partial_plans`: 0 when the tiles that may be visible in this block
        fit the budget, else the last (every tile)."""
        if plans[0].budget is None:
            return jnp.int32(0)
        tq, tk = self.tiles(q_pos.shape[1], kv_pos.shape[1])
        n = jnp.sum(tile_visible(scores.mask, q_pos, kv_pos, q_seg, kv_seg, tq, tk))
        return (n > plans[0].budget).astype(jnp.int32)

    def _schedule(self, masked, scores, tokens, L, S):
        """(trip count, t -> (query tile, key tile, valid or None)) of the tile walk."""
        tq, tk = self.tiles(L, S)
        nk = S // tk
        if not isinstance(masked, TilePlan) or masked.budget is None:
            return L // tq * nk, lambda t: (t // nk, t % nk, None)
        may = tile_visible(scores.mask, *tokens, tq, tk).ravel()
        (pairs,) = jnp.nonzero(may, size=masked.budget, fill_value=0)
        count = jnp.sum(may)
        return masked.budget, lambda t: (pairs[t] // nk, pairs[t] % nk, t < count)

    def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, scores, masked, window=None,
                into=None):
        """(out, lse) of the window's queries, or with ``into=(out, lse)`` those running fp32
        arrays with the window merged in at its query offset (`BlockKernel.accumulates`). One
        walk either way: the online softmax kept in normalised form, tile by tile, so no
        block-sized accumulator exists beside the result."""
        q_pos, kv_pos, q_seg, kv_seg, L, S, qt, kt = _window(window, q, k, q_pos, kv_pos,
                                                             q_seg, kv_seg)
        B, _, N, H = q.shape
        K, V = v.shape[2:]
        G = N // K
        tq, tk = self.tiles(L, S)
        trips, pair = self._schedule(masked, scores, (q_pos, kv_pos, q_seg, kv_seg), L, S)
        q = q.reshape(*q.shape[:2], K, G, H)
        head = jnp.arange(N).reshape(1, K, G, 1, 1)
        q0 = 0 if window is None or into is None else window[0]  # rows' offset in out/lse
        if into is None:
            into = jnp.zeros((B, L, N, V), F32), jnp.full((B, N, L), -jnp.inf, F32)

        def body(t, state):
            out, lse = state  # normalised over the keys seen so far, and their log-sum-exp
            i, j, ok = pair(t)
            r0 = q0 + i * tq
            s, _ = _tile_logits(scores, masked, qt(q, i, tq), kt(k, j, tk),
                                slice_block(q_pos, i, tq), slice_block(kv_pos, j, tk),
                                slice_block(q_seg, i, tq), slice_block(kv_seg, j, tk), head, ok)
            li = lax.dynamic_slice_in_dim(lse, r0, tq, 2).reshape(B, K, G, tq)
            oi = lax.dynamic_slice_in_dim(out, r0, tq, 1).reshape(B, tq, K, G, V)
            m = jnp.maximum(li, jnp.max(s, axis=-1))
            m = jnp.where(jnp.isfinite(m), m, 0.0)  # nothing seen yet
            alpha = jnp.exp(li - m)  # the mass so far, relative to m (0 when li is -inf)
            p = jnp.exp(s - m[..., None])  # 0 on masked entries
            vj = kt(v, j, tk)
            pv = jnp.einsum("bkgqc,bckv->bqkgv", p.astype(vj.dtype), vj,
                            preferred_element_type=F32)
            den = alpha + jnp.sum(p, axis=-1)
            seen = den > 0
            den = jnp.where(seen, den, 1.0)
            o = (oi * _bqkg(alpha) + pv) / _bqkg(den)
            lse_i = jnp.where(seen, m + jnp.log(den), -jnp.inf)
            return (lax.dynamic_update_slice_in_dim(out, o.reshape(B, tq, N, V), r0, 1),
                    lax.dynamic_update_slice_in_dim(lse, lse_i.reshape(B, N, tq), r0, 2))

        return loop(trips, body, tuple(into))

    def backward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, dout, *, scores,
                 masked, window=None, delta=None, into=None):
        q_pos, kv_pos, q_seg, kv_seg, L, S, qt, kt = _window(window, q, k, q_pos, kv_pos,
                                                             q_seg, kv_seg)
        B, _, N, H = q.shape
        K, V = v.shape[2:]
        G = N // K
        tq, tk = self.tiles(L, S)
        trips, pair = self._schedule(masked, scores, (q_pos, kv_pos, q_seg, kv_seg), L, S)
        head = jnp.arange(N).reshape(1, K, G, 1, 1)
        # delta_i = sum_v dout * out over the *global* out: the softmax-Jacobian term (the
        # window's slices fuse into the reduction), or the strategy's, computed once
        delta = (jnp.einsum("blnv,blnv->bnl", qt(dout, 0, L).astype(F32),
                            qt(out, 0, L).astype(F32)) if delta is None
                 else qt(delta, 0, L, axis=2))
        lse = qt(lse, 0, L, axis=2)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing have p = 0 anyway
        q, dout = (x.reshape(*x.shape[:2], K, G, x.shape[-1]) for x in (q, dout))

        def body(t, carry):
            dq, dk, dv = carry
            i, j, ok = pair(t)
            qi, doi = qt(q, i, tq), qt(dout, i, tq).astype(q.dtype)
            qpi, qsi = slice_block(q_pos, i, tq), slice_block(q_seg, i, tq)
            lse_i, delta_i = (slice_block(x, i, tq, axis=2).reshape(B, K, G, tq, 1)
                              for x in (lse, delta))
            kj, vj = kt(k, j, tk), kt(v, j, tk)
            kpj, ksj = slice_block(kv_pos, j, tk), slice_block(kv_seg, j, tk)
            s, mod_vjp = _tile_logits(scores, masked, qi, kj, qpi, kpj, qsi, ksj, head, ok)
            p = jnp.exp(s - lse_i)  # exp(-inf) = 0 on masked entries
            dvj = jnp.einsum("bkgqc,bqkgv->bckv", p.astype(doi.dtype), doi,
                             preferred_element_type=F32)
            dp = jnp.einsum("bqkgv,bckv->bkgqc", doi, vj, preferred_element_type=F32)
            ds = p * (dp - delta_i)
            if mod_vjp is not None:
                ds = jnp.where(p > 0, mod_vjp(ds)[0], 0.0)
            # ds in the operands' dtype, as flash kernels do: mixing fp32 with bf16 operands
            # would let XLA hoist fp32 copies of the whole q and k out of the loops
            ds = (ds * scores.scale).astype(qi.dtype)
            dqi = jnp.einsum("bkgqc,bckh->bqkgh", ds, kj, preferred_element_type=F32)
            dkj = jnp.einsum("bkgqc,bqkgh->bckh", ds, qi, preferred_element_type=F32)
            return (_add_at(dq, dqi.reshape(B, tq, N, H), q0 + i * tq),
                    _add_at(dk, dkj, k0 + j * tk), _add_at(dv, dvj, k0 + j * tk))

        # the strategy's accumulators at the window's offsets, or the window's own
        q0, _, k0, _ = window if window is not None and into is not None else (0, L, 0, S)
        init = into if into is not None else (
            jnp.zeros((B, L, N, H), F32), jnp.zeros((B, S, K, H), F32),
            jnp.zeros((B, S, K, V), F32))
        return loop(trips, body, init)


register_kernel("flash", FlashKernel())
