"""Tiled (flash-style) attention of one query block against one key/value block, in pure JAX.

The building block of `zoo.ops.ring`: nothing here communicates. Both passes walk tiles of
``q_tile`` queries by ``kv_tile`` keys with `lax.fori_loop` and dynamic slices (no tiled copies
of the operands), so one [B, N, q_tile, kv_tile] logit tile is the largest temporary, and
skip tiles the mask empties (`lax.cond` on `block_may_attend`).

* `block_forward` merges this key block into a running (out, lse): ``out`` [B,L,N,V] fp32 is
  normalised over the keys seen so far and ``lse`` [B,N,L] fp32 their log-sum-exp (-inf for
  rows that have seen nothing; their ``out`` is 0). Starting from (0, -inf) it is plain
  attention; called once per ring step it is the online-softmax merge of the ring.
* `block_backward` accumulates this block's gradients into dq, dk, dv (fp32) from the *final*
  log-sum-exp and ``delta = sum(dout * out)``: p = exp(s - lse) are then the true
  probabilities, so every key block contributes independently (the flash-attention backward).

Legend: B batch, L queries, S keys, Q query tile, C key tile, K kv heads, G query heads per kv
head (N = K*G), H q/k head dim, V value head dim.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from zoo.ops.masks import attention_mask, block_may_attend

# Tile sizes, read at trace time. Small tiles keep the per-device constant (a few
# [B, N, Q, C] fp32 temporaries) small next to the 1/cp-sized activations and skip the masked
# triangle finely; on CPU 64x64 was also the fastest of 32..256. Accelerators may prefer larger.
Q_TILE = 64
KV_TILE = 64
F32 = jnp.float32


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


def _logits(q, k, qp, kp, qs, ks, cfg):
    """Masked logits [B,K,G,Q,C] in fp32 (-inf where masked) and the mask [B,1,1,Q,C]."""
    s = jnp.einsum("bqkgh,bckh->bkgqc", q, k, preferred_element_type=F32) * cfg.scale
    mask = attention_mask(qp, kp, qs, ks, causal=cfg.causal,
                          sliding_window=cfg.sliding_window)[:, None, None]
    return jnp.where(mask, s, -jnp.inf), mask


def _may(qp, kp, qs, ks, cfg):
    return block_may_attend(qp, kp, qs, ks, causal=cfg.causal, sliding_window=cfg.sliding_window)


def _bqkg(x):
    """[B,K,G,Q] -> [B,Q,K,G,1], to scale a [B,Q,K,G,V] tile per row."""
    return jnp.moveaxis(x, -1, 1)[..., None]


def block_forward(q, k, v, qp, kp, qs, ks, out, lse, cfg, active=True):
    """Merge attention of q [B,L,N,H] over k [B,S,K,H], v [B,S,K,V] into (out, lse).

    ``active=False`` (a traced bool) leaves (out, lse) as they are: the tile loop runs zero
    times, which skips a block without the copies a `lax.cond` around the loop would make.
    """
    B, L, N, H = q.shape
    _, S, K, V = v.shape
    G = N // K
    tq, tk = tile_size(L, cfg.q_tile), tile_size(S, cfg.kv_tile)
    q = q.reshape(B, L, K, G, H)

    def q_body(i, carry):
        out, lse = carry
        qi, qpi, qsi = _slice(q, i, tq), _slice(qp, i, tq), _slice(qs, i, tq)
        lse_i = _slice(lse, i, tq, axis=2).reshape(B, K, G, tq)
        # the running (out, lse) is the online-softmax state (acc=out, m=lse, den=1) in disguise
        seen = jnp.isfinite(lse_i)
        state = (lse_i, seen.astype(F32), _slice(out, i, tq).reshape(B, tq, K, G, V))

        def kv_body(j, state):
            kj, vj, kpj, ksj = (_slice(x, j, tk) for x in (k, v, kp, ks))

            def update(state):
                m, den, acc = state  # max [B,K,G,Q], denominator [B,K,G,Q], [B,Q,K,G,V]
                s, _ = _logits(qi, kj, qpi, kpj, qsi, ksj, cfg)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # nothing seen yet
                alpha = jnp.exp(m - m_safe)  # 0 when m is -inf
                p = jnp.exp(s - m_safe[..., None])  # 0 on masked entries
                pv = jnp.einsum("bkgqc,bckv->bqkgv", p.astype(vj.dtype), vj,
                                preferred_element_type=F32)
                return m_new, den * alpha + jnp.sum(p, axis=-1), acc * _bqkg(alpha) + pv

            return lax.cond(_may(qpi, kpj, qsi, ksj, cfg), update, lambda s: s, state)

        m, den, acc = lax.fori_loop(0, S // tk, kv_body, state)
        seen = den > 0
        den = jnp.where(seen, den, 1.0)
        acc = acc / _bqkg(den)
        lse_i = jnp.where(seen, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(den), -jnp.inf)
        return (_put(out, acc.reshape(B, tq, N, V), i, tq),
                _put(lse, lse_i.reshape(B, N, tq), i, tq, axis=2))

    return lax.fori_loop(0, jnp.where(active, L // tq, 0), q_body, (out, lse))


def block_backward(q, k, v, qp, kp, qs, ks, dout, lse, delta, dq, dk, dv, cfg, active=True):
    """Accumulate this block pair's gradients into dq [B,L,N,H], dk [B,S,K,H], dv [B,S,K,V].

    ``lse`` [B,N,L] is the final log-sum-exp over *all* keys and ``delta`` [B,N,L] is
    sum(dout * out) over V. Accumulators are fp32. ``active`` as in `block_forward`.
    """
    B, L, N, H = q.shape
    _, S, K, V = v.shape
    G = N // K
    tq, tk = tile_size(L, cfg.q_tile), tile_size(S, cfg.kv_tile)
    q, dout = q.reshape(B, L, K, G, H), dout.reshape(B, L, K, G, V)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing have p = 0 anyway

    def kv_body(j, carry):
        dq, dk, dv = carry
        kj, vj, kpj, ksj = (_slice(x, j, tk) for x in (k, v, kp, ks))

        def q_body(i, carry):
            dq, dkj, dvj = carry
            qi, doi, qpi, qsi = (_slice(x, i, tq) for x in (q, dout, qp, qs))
            lse_i, delta_i = (_slice(x, i, tq, axis=2).reshape(B, K, G, tq, 1)
                              for x in (lse, delta))

            def update(args):
                dqi, dkj, dvj = args
                s, mask = _logits(qi, kj, qpi, kpj, qsi, ksj, cfg)
                p = jnp.where(mask, jnp.exp(s - lse_i), 0.0)
                dvj = dvj + jnp.einsum("bkgqc,bqkgv->bckv", p.astype(doi.dtype), doi,
                                       preferred_element_type=F32)
                dp = jnp.einsum("bqkgv,bckv->bkgqc", doi, vj, preferred_element_type=F32)
                # ds in the operands' dtype, as flash kernels do: mixing fp32 with bf16 operands
                # would let XLA hoist fp32 copies of the whole q and k out of the loops
                ds = (p * (dp - delta_i) * cfg.scale).astype(qi.dtype)
                dqi = dqi + jnp.einsum("bkgqc,bckh->bqkgh", ds, kj,
                                       preferred_element_type=F32).reshape(dqi.shape)
                dkj = dkj + jnp.einsum("bkgqc,bqkgh->bckh", ds, qi, preferred_element_type=F32)
                return dqi, dkj, dvj

            dqi, dkj, dvj = lax.cond(_may(qpi, kpj, qsi, ksj, cfg), update, lambda a: a,
                                     (_slice(dq, i, tq), dkj, dvj))
            return _put(dq, dqi, i, tq), dkj, dvj

        dq, dkj, dvj = lax.fori_loop(0, L // tq, q_body, (dq, _slice(dk, j, tk),
                                                          _slice(dv, j, tk)))
        return dq, _put(dk, dkj, j, tk), _put(dv, dvj, j, tk)

    return lax.fori_loop(0, jnp.where(active, S // tk, 0), kv_body, (dq, dk, dv))
