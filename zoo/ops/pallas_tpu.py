"""zoo's Mosaic TPU attention kernel: flash attention as Pallas TPU kernels, masks from positions.

A `zoo.ops.kernels.BlockKernel` (``"pallas_tpu"``, what ``kernel="auto"`` is on TPU meshes):
the block's attention as three Pallas calls -- forward, then dK/dV and dQ for the backward --
each one ``tpu_custom_call`` in the compiled program, where the pure-JAX `zoo.ops.flash`
kernel is a loop of HLO per way to walk a block (thousands of instructions for the TPU
compiler to optimise at DeepSeek-V3 shapes).

The mask is zoo's (`zoo.ops.masks`): it is evaluated *inside* the kernel from the tile's
positions and segment ids, ``evaluate(mask, q_pos[:, None], kv_pos[None, :], ...)``, so any
mask, token order and packing is exact -- unlike kernels whose masks are functions of array
indices (splash attention's causal mask plus segment ids assumes positions that count up with
the index). Before the call, every (query tile, key tile) pair of every row is classified from
its position/segment bounds (`zoo.ops.masks.Mask.classify`) into empty (skipped: no matmul),
full (the mask is not evaluated) or partial; the kinds reach the kernel as a scalar-prefetch
table in SMEM.

* forward: grid (batch, query heads, query tiles, key tiles), the key tiles innermost: the
  online softmax runs in VMEM scratch (running max, sum and fp32 accumulator) and the last key
  tile writes ``out`` [B,L,N,V] fp32 normalised over the block's keys and ``lse`` [B,N,L]
  (-inf, out 0, for rows that see no key).
* backward from the *global* ``lse`` and ``delta = sum(dout * out)`` (`BlockKernel.takes_delta`):
  dK/dV with grid (batch, kv heads, key tiles, query heads of the group x query tiles), the
  group's query heads summed in the accumulators (no per-query-head copy of dK/dV); dQ with
  grid (batch, query heads, query tiles, key tiles).

Lengths are padded to whole tiles with padding tokens (segment 0, hidden by every mask) and the
results sliced back. A soft cap is supported (its derivative is taken in the kernel); a
`zoo.ops.kernels.ScoreMod` is not (use ``kernel="flash"``). On a CPU mesh the kernels run in
Pallas' TPU interpret mode (slow: for tests).

Legend: B batch, L queries, S keys, N query heads, K kv heads, G = N/K, H q/k head dim,
V value head dim, bq/bk query/key tile, nq/nk tiles per block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from zoo.ops.kernels import BlockKernel, Scores, register_kernel
from zoo.ops.masks import EMPTY, FULL, PARTIAL, evaluate, tile_bounds

F32 = jnp.float32
LANES = 128  # TPU vector lanes: the softmax statistics' scratch width
TILE = 512  # default query/key tile: the MXU wants wide tiles; VMEM holds a few [512, 512] fp32
# the tile-kind table lives in SMEM (1 MiB on TPU v4 and later): keep it within half
MAX_TILE_PAIRS = 2 ** 17


@dataclasses.dataclass(frozen=True)
class PallasTpuKernel(BlockKernel):
    """Flash attention as Pallas TPU (Mosaic) kernels with zoo's masks; see the module
    docstring. ``block_q``/``block_kv``: tile lengths (multiples of 128); None: 512, or the
    block's length rounded up to 128 when shorter. ``interpret``: run the kernels in Pallas'
    TPU interpret mode (None: on CPU meshes, `for_platform`)."""
    block_q: int | None = None
    block_kv: int | None = None
    interpret: bool | None = None
    takes_delta = True  # backward gets delta = sum(dout * out), not the global out
    classifies_tiles = True  # takes whole blocks with the mask; skips empty tiles itself

    def __post_init__(self):
        for name, b in (("block_q", self.block_q), ("block_kv", self.block_kv)):
            if b is not None and (not isinstance(b, int) or b <= 0 or b % LANES):
                raise ValueError(f"PallasTpuKernel({name}={b!r}): tiles must be positive "
                                 f"multiples of {LANES} (TPU lanes), or None for the default")

    def for_platform(self, platform: str, device=None) -> PallasTpuKernel:
        interpret = self.interpret if self.interpret is not None else platform != "tpu"
        return dataclasses.replace(self, interpret=interpret)

    def _tiles(self, L: int, S: int) -> tuple[int, int]:
        def pick(n, b):
            return b if b is not None else min(TILE, -(-n // LANES) * LANES)
        return pick(L, self.block_q), pick(S, self.block_kv)

    def _interpret(self) -> bool:
        # Pallas' generic interpreter (the kernel as JAX ops): the TPU interpreter's callbacks
        # would deadlock against the ring's collectives on a multi-device CPU mesh
        return bool(self.interpret)

    def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, scores, masked):
        _check(scores)
        L, S = q.shape[1], k.shape[1]
        bq, bk = self._tiles(L, S)
        t = _Tokens.make(q_pos, kv_pos, q_seg, kv_seg, bq, bk)
        kinds = _tile_kinds(scores, masked, t, bq, bk)
        qh = _heads_major(q, t.pq)  # [B, N, Lp, H]
        kh, vh = _heads_major(k, t.pk), _heads_major(v, t.pk)
        out, lse = _forward_call(kinds, qh, kh, vh, t, scores=scores, bq=bq, bk=bk,
                                 interpret=self._interpret())
        out = jnp.swapaxes(out[:, :, :L], 1, 2)  # [B, L, N, V]
        return out, lse[:, :, :L, 0]

    def backward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, dout, *, scores,
                 masked, delta=None):
        _check(scores)
        L, S = q.shape[1], k.shape[1]
        if delta is None:  # the global out was given instead
            delta = jnp.einsum("blnv,blnv->bnl", dout.astype(F32), out.astype(F32))
        bq, bk = self._tiles(L, S)
        t = _Tokens.make(q_pos, kv_pos, q_seg, kv_seg, bq, bk)
        kinds = _tile_kinds(scores, masked, t, bq, bk)
        qh, doh = _heads_major(q, t.pq), _heads_major(dout.astype(q.dtype), t.pq)
        kh, vh = _heads_major(k, t.pk), _heads_major(v, t.pk)
        # rows that see no key anywhere have lse -inf: exp(s - 0) of their -inf logits is 0
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        rows = [jnp.pad(x.astype(F32), ((0, 0), (0, 0), (0, t.pq)))[..., None]
                for x in (lse, delta)]
        kw = dict(scores=scores, bq=bq, bk=bk, interpret=self._interpret())
        dk, dv = _dkv_call(kinds, qh, kh, vh, doh, *rows, t, **kw)
        dq = _dq_call(kinds, qh, kh, vh, doh, *rows, t, **kw)
        return (jnp.swapaxes(dq[:, :, :L], 1, 2), jnp.swapaxes(dk[:, :, :S], 1, 2),
                jnp.swapaxes(dv[:, :, :S], 1, 2))


def _check(scores: Scores) -> None:
    if scores.score_mod is not None:
        raise ValueError("kernel='pallas_tpu' does not take a ScoreMod (its VJP would have to "
                         "run inside the TPU kernel); use kernel='flash'")


def _heads_major(x, pad: int):
    """[B, n, heads, d] -> [B, heads, n + pad, d] (zero rows appended)."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x


@dataclasses.dataclass(frozen=True)
class _Tokens:
    """Positions and segment ids padded to whole tiles (padding: segment 0), in the layouts the
    kernels read: queries as columns [B, Lp, 1], keys as rows [B, 1, Sp]."""
    qp: jax.Array
    qs: jax.Array
    kp: jax.Array
    ks: jax.Array
    pq: int  # query / key padding
    pk: int

    @staticmethod
    def make(q_pos, kv_pos, q_seg, kv_seg, bq, bk):
        pq, pk = -q_pos.shape[1] % bq, -kv_pos.shape[1] % bk

        def pad(x, n):
            return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, n)))
        return _Tokens(pad(q_pos, pq)[..., None], pad(q_seg, pq)[..., None],
                       pad(kv_pos, pk)[:, None], pad(kv_seg, pk)[:, None], pq, pk)


def _tile_kinds(scores: Scores, masked, t: _Tokens, bq: int, bk: int) -> jax.Array:
    """int32 [B * nq * nk]: EMPTY / FULL / PARTIAL of every (row, query tile, key tile)."""
    B, Lp, Sp = t.qp.shape[0], t.qp.shape[1], t.kp.shape[2]
    nq, nk = Lp // bq, Sp // bk
    if B * nq * nk > MAX_TILE_PAIRS:
        raise ValueError(
            f"kernel='pallas_tpu': {B} rows x {nq} x {nk} tiles of {bq} x {bk} tokens make a "
            f"tile table of {B * nq * nk:,} entries, over the {MAX_TILE_PAIRS:,} that fit "
            f"TPU scalar memory; use larger tiles (PallasTpuKernel(block_q=, block_kv=)), "
            f"shard the sequence (context parallelism) or fewer rows per device")
    if masked is False and not (t.pq or t.pk):  # the strategy proved the block visible
        return jnp.full((B * nq * nk,), FULL, jnp.int32)
    qb, kb = tile_bounds(t.qp[..., 0], t.kp[:, 0], t.qs[..., 0], t.ks[:, 0], bq, bk)
    may, full = scores.mask.classify(qb, kb)
    may, full = may & qb.some & kb.some, full & qb.no_pad & kb.no_pad
    if masked is False:  # visible except where this kernel padded
        may = may | (qb.some & kb.some)
    kind = jnp.where(may, jnp.where(full, FULL, PARTIAL), EMPTY)
    return jnp.broadcast_to(kind, (B, nq, nk)).astype(jnp.int32).reshape(-1)


# -- the kernels -------------------------------------------------------------------------------

def _logits(scores: Scores, q, k, qp, kp, qs, ks, masked: bool):
    """[bq, bk] fp32 logits of one tile (-inf where masked) and the soft cap's tanh (or None)."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    s = s * scores.scale
    capped = None
    if scores.soft_cap is not None:
        capped = jnp.tanh(s / scores.soft_cap)
        s = scores.soft_cap * capped
    if masked:
        s = jnp.where(evaluate(scores.mask, qp, kp, qs, ks), s, -jnp.inf)
    return s, capped


def _tile_case(kind, body):
    """Run ``body(masked)`` for a full (False) or partial (True) tile; nothing for an empty."""
    from jax.experimental import pallas as pl
    pl.when(kind == FULL)(lambda: body(False))
    pl.when(kind == PARTIAL)(lambda: body(True))


def _forward_kernel(kinds, q_ref, k_ref, v_ref, qp_ref, qs_ref, kp_ref, ks_ref, o_ref, lse_ref,
                    m_sc, l_sc, acc_sc, *, scores, nq, nk):
    from jax.experimental import pallas as pl
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    def tile(masked):
        s, _ = _logits(scores, q_ref[...], k_ref[...], qp_ref[...], kp_ref[...], qs_ref[...],
                       ks_ref[...], masked)
        m_prev = m_sc[...]  # [bq, LANES], every lane the same
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet
        p = jnp.exp(s - m_safe[:, :1])
        alpha = jnp.exp(m_prev - m_safe)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        v = v_ref[...]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=F32)
        acc_sc[...] = acc_sc[...] * alpha[:, :1] + pv

    _tile_case(kinds[(b * nq + i) * nk + j], tile)

    @pl.when(j == nk - 1)
    def _():
        total, m = l_sc[...][:, :1], m_sc[...][:, :1]
        seen = total > 0.0
        total = jnp.where(seen, total, 1.0)
        o_ref[...] = jnp.where(seen, acc_sc[...] / total, 0.0)
        lse_ref[...] = jnp.where(seen, m + jnp.log(total), -jnp.inf)


def _probs_and_dlogits(scores, q, k, v, do, qp, kp, qs, ks, lse, delta, masked):
    """(p, ds) [bq, bk] fp32 of one tile: the probabilities from the global lse, and the
    gradient of q.k (through the soft cap's derivative and the scale)."""
    s, capped = _logits(scores, q, k, qp, kp, qs, ks, masked)
    p = jnp.exp(s - lse)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    ds = p * (dp - delta)
    if capped is not None:
        ds = ds * (1.0 - capped * capped)
    return p, ds * scores.scale


def _dkv_kernel(kinds, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, qs_ref, kp_ref,
                ks_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, scores, nq, nk):
    from jax.experimental import pallas as pl
    b, j, u = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    i = lax.rem(u, nq)

    @pl.when(u == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    def tile(masked):
        q, do = q_ref[...], do_ref[...]
        p, ds = _probs_and_dlogits(scores, q, k_ref[...], v_ref[...], do, qp_ref[...],
                                   kp_ref[...], qs_ref[...], ks_ref[...], lse_ref[...],
                                   delta_ref[...], masked)
        dv_sc[...] += lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                      preferred_element_type=F32)
        dk_sc[...] += lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                      preferred_element_type=F32)

    _tile_case(kinds[(b * nq + i) * nk + j], tile)

    @pl.when(u == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = dk_sc[...]
        dv_ref[...] = dv_sc[...]


def _dq_kernel(kinds, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, qs_ref, kp_ref,
               ks_ref, dq_ref, dq_sc, *, scores, nq, nk):
    from jax.experimental import pallas as pl
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    def tile(masked):
        k = k_ref[...]
        _, ds = _probs_and_dlogits(scores, q_ref[...], k, v_ref[...], do_ref[...], qp_ref[...],
                                   kp_ref[...], qs_ref[...], ks_ref[...], lse_ref[...],
                                   delta_ref[...], masked)
        dq_sc[...] += lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                      preferred_element_type=F32)

    _tile_case(kinds[(b * nq + i) * nk + j], tile)

    @pl.when(j == nk - 1)
    def _():
        dq_ref[...] = dq_sc[...]


# -- the calls ---------------------------------------------------------------------------------

def _dims(q, k, v, bq, bk):
    """(B, N, K, H, V, G, nq, nk) of heads-major q [B, N, Lp, H], k [B, K, Sp, H], v."""
    B, N, Lp, H = q.shape
    K, Sp = k.shape[1], k.shape[2]
    return B, N, K, H, v.shape[-1], N // K, Lp // bq, Sp // bk


def _per_query_head(G):
    """Index maps of a grid (b, query head n, query tile i, key tile j): q-side blocks at
    (b, n, i), k-side at (b, n's kv head, j)."""
    return (lambda b, n, i, j, kinds: (b, n, i),
            lambda b, n, i, j, kinds: (b, lax.div(n, G), j))


def _specs(bq, bk, qmap, kmap):
    """BlockSpecs of (q, k, v, do) and the token arrays for index maps ``qmap(grid) -> (b, n,
    i)`` and ``kmap(grid) -> (b, kv head, j)``."""
    from jax.experimental import pallas as pl
    sq = pl.squeezed

    def q_like(d):
        return pl.BlockSpec((sq, sq, bq, d), lambda *g: (*qmap(*g), 0))

    def k_like(d):
        return pl.BlockSpec((sq, sq, bk, d), lambda *g: (*kmap(*g), 0))
    rows = pl.BlockSpec((sq, sq, bq, 1), lambda *g: (*qmap(*g), 0))
    q_tok = pl.BlockSpec((sq, bq, 1), lambda *g: (qmap(*g)[0], qmap(*g)[2], 0))
    k_tok = pl.BlockSpec((sq, 1, bk), lambda *g: (kmap(*g)[0], 0, kmap(*g)[2]))
    return q_like, k_like, rows, q_tok, k_tok


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid,
                                               in_specs=in_specs, out_specs=out_specs,
                                               scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret)


@functools.partial(jax.named_call, name="zoo_attention_fwd")
def _forward_call(kinds, q, k, v, t, *, scores, bq, bk, interpret):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    B, N, _, H, V, G, nq, nk = _dims(q, k, v, bq, bk)
    q_like, k_like, _, q_tok, k_tok = _specs(bq, bk, *_per_query_head(G))
    kernel = functools.partial(_forward_kernel, scores=scores, nq=nq, nk=nk)
    return _call(
        kernel, (B, N, nq, nk),
        [q_like(H), k_like(H), k_like(V), q_tok, q_tok, k_tok, k_tok],
        [pl.BlockSpec((pl.squeezed, pl.squeezed, bq, V), lambda b, n, i, j, kinds: (b, n, i, 0)),
         pl.BlockSpec((pl.squeezed, pl.squeezed, bq, 1), lambda b, n, i, j, kinds: (b, n, i, 0))],
        [jax.ShapeDtypeStruct((*q.shape[:3], d), F32) for d in (V, 1)],
        [pltpu.VMEM((bq, LANES), F32), pltpu.VMEM((bq, LANES), F32), pltpu.VMEM((bq, V), F32)],
        interpret)(kinds, q, k, v, t.qp, t.qs, t.kp, t.ks)


@functools.partial(jax.named_call, name="zoo_attention_dkv")
def _dkv_call(kinds, q, k, v, do, lse, delta, t, *, scores, bq, bk, interpret):
    from jax.experimental.pallas import tpu as pltpu
    B, _, K, H, V, G, nq, nk = _dims(q, k, v, bq, bk)
    # grid (b, kv head c, key tile j, u = group head g * nq + query tile i)
    q_like, k_like, rows, q_tok, k_tok = _specs(
        bq, bk, lambda b, c, j, u, kinds: (b, c * G + lax.div(u, nq), lax.rem(u, nq)),
        lambda b, c, j, u, kinds: (b, c, j))
    kernel = functools.partial(_dkv_kernel, scores=scores, nq=nq, nk=nk)
    return _call(
        kernel, (B, K, nk, G * nq),
        [q_like(H), k_like(H), k_like(V), q_like(V), rows, rows, q_tok, q_tok, k_tok, k_tok],
        [k_like(H), k_like(V)],
        [jax.ShapeDtypeStruct((*k.shape[:3], d), F32) for d in (H, V)],
        [pltpu.VMEM((bk, H), F32), pltpu.VMEM((bk, V), F32)],
        interpret)(kinds, q, k, v, do, lse, delta, t.qp, t.qs, t.kp, t.ks)


@functools.partial(jax.named_call, name="zoo_attention_dq")
def _dq_call(kinds, q, k, v, do, lse, delta, t, *, scores, bq, bk, interpret):
    from jax.experimental.pallas import tpu as pltpu
    B, N, _, H, V, G, nq, nk = _dims(q, k, v, bq, bk)
    q_like, k_like, rows, q_tok, k_tok = _specs(bq, bk, *_per_query_head(G))
    kernel = functools.partial(_dq_kernel, scores=scores, nq=nq, nk=nk)
    return _call(
        kernel, (B, N, nq, nk),
        [q_like(H), k_like(H), k_like(V), q_like(V), rows, rows, q_tok, q_tok, k_tok, k_tok],
        [q_like(H)], [jax.ShapeDtypeStruct(q.shape, F32)],
        [pltpu.VMEM((bq, H), F32)],
        interpret)(kinds, q, k, v, do, lse, delta, t.qp, t.qs, t.kp, t.ks)[0]


register_kernel("pallas_tpu", PallasTpuKernel())
