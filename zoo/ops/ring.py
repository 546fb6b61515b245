"""Context-parallel attention inside one shard: all-gather and ring, with a flash `custom_vjp`.

`attend_shard` runs under `shard_map` (or unsharded, with ``axes=()``). Each device holds
``L/cp`` queries and ``S/cp`` keys/values with their positions and segment ids.

* ``"all_gather"``: gather K/V (+ positions, segments) over the sequence axes -- in one piece
  when it is no larger than the local queries, else in slices (`_gather_chunks`) -- and attend
  with the local queries (`zoo.ops.flash` tiles, empty tiles skipped). Backward re-gathers K/V
  (the forward's gathered copy is not kept) and reduce-scatters dK/dV.
* ``"ring"``: ``cp`` steps; at step t device r holds the K/V block of shard r - t, attends to it
  unless `block_may_attend` says the mask empties it (the tile loop then runs zero times),
  merges it into the running fp32 online softmax (`flash.block_forward`), and passes the block
  on with `ppermute`. Backward walks the same ring
  from the saved log-sum-exp; dK/dV travel with their block and arrive home after ``cp`` hops.

The forward keeps only (q, k, v, positions, segments, out, lse) for the backward, so per-device
memory is O(local activations + one K/V block): 1/cp of the unsharded program plus small
constants (see benchmarks/context_parallel.py).

Legend: B batch, L local query length, S local kv length, N query heads, K kv heads,
H head dim, V value head dim; cp the number of sequence shards.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from zoo.ops import flash
from zoo.ops.masks import block_may_attend

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    strategy: str  # "ring" | "all_gather"
    axes: tuple[str, ...]  # mesh axes sharding the sequence (empty: unsharded)
    causal: bool
    sliding_window: int | None
    scale: float
    q_tile: int
    kv_tile: int


def attend_shard(q, k, v, qpos, kpos, qseg, kseg, *, strategy, axes, causal, sliding_window,
                 scale, q_tile=None, kv_tile=None):
    """One shard's attention output [B, L, N, V] in q's dtype (see module docstring).

    Tile sizes default to `flash.Q_TILE` / `flash.KV_TILE`, read at trace time.
    """
    if strategy not in ("ring", "all_gather"):
        raise ValueError(f"strategy {strategy!r} must be 'ring' or 'all_gather'")
    cfg = Config(strategy, tuple(axes), causal, sliding_window, scale,
                 q_tile or flash.Q_TILE, kv_tile or flash.KV_TILE)
    return _attend(cfg, q, k, v, qpos, kpos, qseg, kseg)


def _cp(cfg: Config) -> int:
    return lax.axis_size(cfg.axes) if cfg.axes else 1


def _gather(x, cfg):
    return lax.all_gather(x, cfg.axes, axis=1, tiled=True) if cfg.axes else x


def _shift(xs, cfg):
    """Send every array in xs to the next shard of the ring (r -> r + 1)."""
    if not cfg.axes:
        return xs
    n = _cp(cfg)
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, cfg.axes, perm), xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg, q, k, v, qpos, kpos, qseg, kseg):
    out, _ = _forward(cfg, q, k, v, qpos, kpos, qseg, kseg)
    return out


def _gather_chunks(cfg, q, k, v):
    """(number of gather steps m, keys per shard per step) for the all-gather strategy.

    One gather (m=1, Llama-3 style) when the whole K/V is no larger than the local queries
    (``S*K*(H+V) <= L/cp * N * H``: GQA/MQA with few kv heads, small cp). Otherwise K/V are
    gathered in m slices -- slice t is keys [t*c, (t+1)*c) of every shard -- with m the smallest
    divisor of the local kv length that keeps a gathered slice within that size, so per-device
    memory stays ~1/cp; the backward reduce-scatters dK/dV slice by slice. Either way the bytes
    moved equal one gather (and one reduce-scatter).
    """
    return gather_slices(_cp(cfg), q.shape, k.shape, v.shape)


def gather_slices(cp, q_shape, k_shape, v_shape):
    """`_gather_chunks` on local shapes [B, L/cp, N, H], [B, S/cp, K, H], [B, S/cp, K, V]."""
    s_local = k_shape[1]
    if cp == 1:
        return 1, s_local
    need = cp * s_local * k_shape[2] * (k_shape[3] + v_shape[3])
    budget = q_shape[1] * q_shape[2] * q_shape[3]
    m = min(-(-need // budget), s_local)
    while s_local % m:
        m += 1
    return m, s_local // m


def _gathered(cfg, t, c, xs):
    """Slice t of every shard's arrays, gathered: [B, cp*c, ...] in shard order."""
    return tuple(_gather(flash._slice(x, t, c), cfg) for x in xs)


def _may(cfg, qpos, kpos, qseg, kseg):
    return block_may_attend(qpos, kpos, qseg, kseg, causal=cfg.causal,
                            sliding_window=cfg.sliding_window)


def _forward(cfg, q, k, v, qpos, kpos, qseg, kseg):
    """(out in q's dtype, lse [B,N,L] fp32)."""
    B, L, N, _ = q.shape
    state = (jnp.zeros((B, L, N, v.shape[-1]), F32), jnp.full((B, N, L), -jnp.inf, F32))

    def attend(kb, vb, kpb, ksb, state):
        # blocks the mask empties are skipped (the tile loop runs 0 times); collectives stay
        # outside any data-dependent control flow: every device must take part in them
        return flash.block_forward(q, kb, vb, qpos, kpb, qseg, ksb, *state, cfg,
                                   active=_may(cfg, qpos, kpb, qseg, ksb))

    if cfg.strategy == "all_gather" or _cp(cfg) == 1:
        m, c = _gather_chunks(cfg, q, k, v)

        def gather_step(t, state):
            with jax.named_scope("all_gather_kv"):
                kb, vb, kpb, ksb = _gathered(cfg, t, c, (k, v, kpos, kseg))
            return attend(kb, vb, kpb, ksb, state)

        out, lse = lax.fori_loop(0, m, gather_step, state)
        return out.astype(q.dtype), lse

    def ring_step(carry, _):
        kb, vb, kpb, ksb, state = carry
        with jax.named_scope("ring_block"):
            state = attend(kb, vb, kpb, ksb, state)
        # the last hop brings each block home again; it is not needed, but keeping the scan
        # body uniform compiles the block kernel once instead of twice
        kb, vb, kpb, ksb = _shift((kb, vb, kpb, ksb), cfg)
        return (kb, vb, kpb, ksb, state), None

    (*_, (out, lse)), _ = lax.scan(ring_step, (k, v, kpos, kseg, state), None, length=_cp(cfg))
    return out.astype(q.dtype), lse


def _attend_fwd(cfg, q, k, v, qpos, kpos, qseg, kseg):
    out, lse = _forward(cfg, q, k, v, qpos, kpos, qseg, kseg)
    return out, (q, k, v, qpos, kpos, qseg, kseg, out, lse)


def _zeros_after(x, shape):
    """fp32 zeros of `shape` that XLA can only materialise once `x` exists.

    Plain `jnp.zeros` accumulators are constants: XLA's scheduler fills them at the start of
    the program and keeps them alive through the whole forward ring (and CSE may share them
    with the forward's zero-filled state), adding q + k + v sized fp32 buffers to the forward's
    peak. Multiplying by one (finite) element of `x` ties them to the backward; XLA does not
    fold ``y * 0`` for floats; the select keeps an inf/NaN in `x` out of the gradients and
    `abs` makes the zero +0.0 (untouched gradient entries stay exactly +0.0).
    """
    if x.size == 0:
        return jnp.zeros(shape, F32)
    anchor = x.ravel()[0]
    return jnp.full(shape, jnp.where(jnp.isfinite(anchor), jnp.abs(anchor), 0.0) * 0.0, F32)


def _attend_bwd(cfg, res, dout):
    q, k, v, qpos, kpos, qseg, kseg, out, lse = res
    # delta_i = sum_v dout * out: the softmax-Jacobian term of the flash backward
    delta = jnp.einsum("blnv,blnv->bnl", dout.astype(F32), out.astype(F32))

    def grads(kb, vb, kpb, ksb, acc):
        return flash.block_backward(q, kb, vb, qpos, kpb, qseg, ksb, dout, lse, delta, *acc,
                                    cfg, active=_may(cfg, qpos, kpb, qseg, ksb))

    if cfg.strategy == "all_gather" or _cp(cfg) == 1:
        m, c = _gather_chunks(cfg, q, k, v)

        def gather_step(t, carry):
            dq, dk, dv = carry
            with jax.named_scope("all_gather_kv"):
                kb, vb, kpb, ksb = _gathered(cfg, t, c, (k, v, kpos, kseg))
            dq, dkb, dvb = grads(kb, vb, kpb, ksb, (dq, jnp.zeros(kb.shape, F32),
                                                    jnp.zeros(vb.shape, F32)))
            if cfg.axes:
                with jax.named_scope("reduce_scatter_dkv"):
                    dkb = lax.psum_scatter(dkb, cfg.axes, scatter_dimension=1, tiled=True)
                    dvb = lax.psum_scatter(dvb, cfg.axes, scatter_dimension=1, tiled=True)
            return dq, flash._put(dk, dkb, t, c), flash._put(dv, dvb, t, c)

        # (plain zeros here: `_zeros_after` measured worse for this path, +0.8 MiB at cp=1)
        dq, dk, dv = lax.fori_loop(0, m, gather_step, (jnp.zeros(q.shape, F32),
                                                       jnp.zeros(k.shape, F32),
                                                       jnp.zeros(v.shape, F32)))
    else:
        def ring_step(carry, _):
            kb, vb, kpb, ksb, dkb, dvb, dq = carry
            with jax.named_scope("ring_block_grad"):
                dq, dkb, dvb = grads(kb, vb, kpb, ksb, (dq, dkb, dvb))
            # dK/dV travel with their block; after cp hops both are back at their owner
            kb, vb, kpb, ksb, dkb, dvb = _shift((kb, vb, kpb, ksb, dkb, dvb), cfg)
            return (kb, vb, kpb, ksb, dkb, dvb, dq), None

        # accumulators zero-filled only once the backward starts (see `_zeros_after`)
        zeros = functools.partial(_zeros_after, delta)
        init = (k, v, kpos, kseg, zeros(k.shape), zeros(v.shape), zeros(q.shape))
        (*_, dk, dv, dq), _ = lax.scan(ring_step, init, None, length=_cp(cfg))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)
