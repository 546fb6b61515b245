"""The zoo flash kernel: tiled (flash-style) attention of one query block over one key block.

A `zoo.ops.kernels.BlockKernel` in pure JAX that runs on any platform. Both passes walk every
(``q_tile`` x ``kv_tile``) tile pair of the block with `lax.fori_loop` over *static* trip counts
and dynamic slices: no per-tile `lax.cond` (on GPU each would send its predicate to the host)
and no loop whose length is known only at run time, so one [B, N, q_tile, kv_tile] logit tile
is the largest temporary and the compiled program holds no conditional at all. Skipping is the
strategy's job, per block and sub-block (`zoo.ops.ring`): empty ones are never handed to the
kernel and fully visible ones come with ``masked=False``, so the mask is not evaluated there;
within a partial block the kernel masks elementwise.

* `FlashKernel.forward` -> (out [B,L,N,V] fp32 normalised over this block, lse [B,N,L] fp32).
* `FlashKernel.backward` from the global (out, lse): p = exp(s - lse) are the true
  probabilities and delta = sum(dout * out) the true softmax-Jacobian term, so the block's
  (dq, dk, dv) are exact on their own. Score modifiers (soft cap, `ScoreMod`) are
  differentiated with their exact VJP per tile.

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
from zoo.ops.masks import evaluate

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


def _slice(x, i, size, axis=1):
    return lax.dynamic_slice_in_dim(x, i * size, size, axis)


def _put(x, update, i, size, axis=1):
    return lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), i * size, axis)


def _bqkg(x):
    """[B,K,G,Q] -> [B,Q,K,G,1], to scale a [B,Q,K,G,V] tile per row."""
    return jnp.moveaxis(x, -1, 1)[..., None]


def _tile_logits(scores: Scores, masked, q, k, qp, kp, qs, ks, head):
    """Logits [B,K,G,Q,C] fp32 (-inf where masked) and the VJP of the score modifiers."""
    s = jnp.einsum("bqkgh,bckh->bkgqc", q, k, preferred_element_type=F32) * scores.scale
    tokens = (qp[:, None, None, :, None], kp[:, None, None, None, :],
              qs[:, None, None, :, None], ks[:, None, None, None, :])
    mod_vjp = None
    if scores.modified:
        s, mod_vjp = jax.vjp(lambda x: scores.modify(x, *tokens, head), s)
    if masked:
        s = jnp.where(evaluate(scores.mask, *tokens), s, -jnp.inf)
    return s, mod_vjp


@dataclasses.dataclass(frozen=True)
class FlashKernel(BlockKernel):
    """Pure-JAX flash kernel; ``q_tile``/``kv_tile`` default by platform (`CPU_TILES` on CPU,
    `ACCELERATOR_TILES` elsewhere), shrunk to divisors of the block lengths."""
    q_tile: int | None = None
    kv_tile: int | None = None

    def tiles(self, L: int, S: int) -> tuple[int, int]:
        dq, dk = CPU_TILES if jax.default_backend() == "cpu" else ACCELERATOR_TILES
        return tile_size(L, self.q_tile or dq), tile_size(S, self.kv_tile or dk)

    def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, scores, masked):
        B, L, N, H = q.shape
        _, S, K, V = v.shape
        G = N // K
        tq, tk = self.tiles(L, S)
        q = q.reshape(B, L, K, G, H)
        head = jnp.arange(N).reshape(1, K, G, 1, 1)

        def q_body(i, carry):
            out, lse = carry
            qi, qpi, qsi = _slice(q, i, tq), _slice(q_pos, i, tq), _slice(q_seg, i, tq)

            def kv_body(j, state):
                m, den, acc = state  # max [B,K,G,Q], denominator [B,K,G,Q], [B,Q,K,G,V]
                kj, vj, kpj, ksj = (_slice(x, j, tk) for x in (k, v, kv_pos, kv_seg))
                s, _ = _tile_logits(scores, masked, qi, kj, qpi, kpj, qsi, ksj, head)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # nothing seen yet
                alpha = jnp.exp(m - m_safe)  # 0 when m is -inf
                p = jnp.exp(s - m_safe[..., None])  # 0 on masked entries
                pv = jnp.einsum("bkgqc,bckv->bqkgv", p.astype(vj.dtype), vj,
                                preferred_element_type=F32)
                return m_new, den * alpha + jnp.sum(p, axis=-1), acc * _bqkg(alpha) + pv

            init = (jnp.full((B, K, G, tq), -jnp.inf, F32), jnp.zeros((B, K, G, tq), F32),
                    jnp.zeros((B, tq, K, G, V), F32))
            m, den, acc = lax.fori_loop(0, S // tk, kv_body, init)
            seen = den > 0
            den = jnp.where(seen, den, 1.0)
            lse_i = jnp.where(seen, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(den), -jnp.inf)
            return (_put(out, (acc / _bqkg(den)).reshape(B, tq, N, V), i, tq),
                    _put(lse, lse_i.reshape(B, N, tq), i, tq, axis=2))

        init = (jnp.zeros((B, L, N, V), F32), jnp.full((B, N, L), -jnp.inf, F32))
        return lax.fori_loop(0, L // tq, q_body, init)

    def backward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, dout, *, scores,
                 masked):
        B, L, N, H = q.shape
        _, S, K, V = v.shape
        G = N // K
        tq, tk = self.tiles(L, S)
        head = jnp.arange(N).reshape(1, K, G, 1, 1)
        # delta_i = sum_v dout * out over the *global* out: the softmax-Jacobian term
        delta = jnp.einsum("blnv,blnv->bnl", dout.astype(F32), out.astype(F32))
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing have p = 0 anyway
        q, dout = q.reshape(B, L, K, G, H), dout.astype(q.dtype).reshape(B, L, K, G, V)

        def kv_body(j, carry):
            dq, dk, dv = carry
            kj, vj, kpj, ksj = (_slice(x, j, tk) for x in (k, v, kv_pos, kv_seg))

            def q_body(i, carry):
                dq, dkj, dvj = carry
                qi, doi, qpi, qsi = (_slice(x, i, tq) for x in (q, dout, q_pos, q_seg))
                lse_i, delta_i = (_slice(x, i, tq, axis=2).reshape(B, K, G, tq, 1)
                                  for x in (lse, delta))
                s, mod_vjp = _tile_logits(scores, masked, qi, kj, qpi, kpj, qsi, ksj, head)
                p = jnp.exp(s - lse_i)  # exp(-inf) = 0 on masked entries
                dvj = dvj + jnp.einsum("bkgqc,bqkgv->bckv", p.astype(doi.dtype), doi,
                                       preferred_element_type=F32)
                dp = jnp.einsum("bqkgv,bckv->bkgqc", doi, vj, preferred_element_type=F32)
                ds = p * (dp - delta_i)
                if mod_vjp is not None:
                    ds = jnp.where(p > 0, mod_vjp(ds)[0], 0.0)
                # ds in the operands' dtype, as flash kernels do: mixing fp32 with bf16 operands
                # would let XLA hoist fp32 copies of the whole q and k out of the loops
                ds = (ds * scores.scale).astype(qi.dtype)
                dqi = jnp.einsum("bkgqc,bckh->bqkgh", ds, kj, preferred_element_type=F32)
                dkj = dkj + jnp.einsum("bkgqc,bqkgh->bckh", ds, qi, preferred_element_type=F32)
                dq = _put(dq, _slice(dq, i, tq) + dqi.reshape(B, tq, N, H), i, tq)
                return dq, dkj, dvj

            dq, dkj, dvj = lax.fori_loop(0, L // tq, q_body, (
                dq, jnp.zeros((B, tk, K, H), F32), jnp.zeros((B, tk, K, V), F32)))
            return dq, _put(dk, dkj, j, tk), _put(dv, dvj, j, tk)

        init = (jnp.zeros((B, L, N, H), F32), jnp.zeros((B, S, K, H), F32),
                jnp.zeros((B, S, K, V), F32))
        return lax.fori_loop(0, S // tk, kv_body, init)


register_kernel("flash", FlashKernel())
