"""Blockwise-scaled FP8 matrix products, as DeepSeek-V3 trains them.

* `quantize(x, block=(br, bc))` cuts the last two dims of `x` into ``br x bc`` blocks (partial
  blocks at the edges) and gives each block one float32 scale, the dequantisation factor: ``x ≈
  q * scale`` with the scale broadcast over its block. Activations and gradients use 1x128
  tiles, weights 128x128 blocks.
* `dot(x, w)` quantises an unquantised ``x [..., K]`` per 1x128 tile (along K) and ``w [K, N]``
  per 128x128 block, multiplies the float8 operands one 128-wide K block at a time with float32
  accumulation, scales each partial product by its two scales and sums the blocks in float32
  (DeepSeek's promotion every 128 elements of K). Its VJP quantises the output gradient and runs
  both backward products in FP8 as well (see `dot`).
* `ragged_dot(x, w, group_sizes)` is the same for the MoE's grouped matmul (`jax.lax.ragged_dot`
  per 128-block of K, one 128x128-blocked weight per group).

Scales: ``scale = amax / fmax`` per block (``fmax`` = 448 for E4M3, 57344 for E5M2),
DeepSeek-V3's choice, by default; ``power_of_two=True`` rounds it up to a power of two, so that
applying it is exact, with ``scale ≤ 2·amax/fmax``. Both divisions are written as XLA computes
them, ``amax * float32(1/fmax)`` and ``q = x * (1/scale)``, so every backend and a NumPy
reference round alike. ``|x / scale| ≤ fmax`` in every block (quotients are clipped to ``±fmax``
before the cast, so float32 rounding never makes a NaN). A block whose scaled values would all
underflow (an all-zero block, or ``amax/fmax`` below the smallest normal float32) gets
``scale = 1``: zeros stay exact and nothing divides by zero.

On CPU, XLA upcasts float8 dots to float32; the lowered program still holds the float8 operands,
so the numerics are the accelerators'.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ACTIVATION_BLOCK", "FP8_DTYPES", "MODES", "WEIGHT_BLOCK", "check_mode", "dot",
           "quantize", "ragged_dot", "scaled_matmul"]

ACTIVATION_BLOCK = (1, 128)
WEIGHT_BLOCK = (128, 128)
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_TILE = 128  # the K block of every product (the scale granularity along contractions)
MODES = (None, "off", "blockwise")  # the layers' ``fp8=`` values (None and "off": no FP8)


def check_mode(mode: str | None, *, what: str = "fp8") -> str | None:
    """`mode` as the layers read it: None (no FP8; also for ``"off"``) or ``"blockwise"``."""
    if mode not in MODES:
        raise ValueError(f"{what}={mode!r} is not an FP8 mode; use None/'off' (no FP8) or "
                         f"'blockwise' (1x128 activation tiles, 128x128 weight blocks)")
    return None if mode == "off" else mode


def _check_dtype(dtype) -> None:
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in FP8_DTYPES]:
        raise ValueError(f"fp8 dtype {jnp.dtype(dtype).name} is not supported; use "
                         f"jnp.float8_e4m3fn or jnp.float8_e5m2")


def quantize(x: jax.Array, *, block: tuple[int, int] = ACTIVATION_BLOCK,
             dtype=jnp.float8_e4m3fn, power_of_two: bool = False
             ) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)`` with ``x ≈ q * scale`` per ``block`` of the last two dims of `x`.

    Args:
      x: ``[..., rows, cols]``, any float dtype; leading dims are batch dims (blocks never span
        them).
      block: ``(br, bc)``; edge blocks are partial.
      dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.
      power_of_two: round each scale up to a power of two (default False: ``amax / fmax``).

    Returns:
      q: `dtype`, the shape of `x`; scale: float32 ``[..., ceil(rows/br), ceil(cols/bc)]``.
    """
    _check_dtype(dtype)
    if x.ndim < 2:
        raise ValueError(f"quantize needs x with at least 2 dims (rows, cols), got shape "
                         f"{x.shape}; add a leading axis (x[None]) for a vector")
    br, bc = (int(b) for b in block)
    if br < 1 or bc < 1:
        raise ValueError(f"block {tuple(block)} must be two positive ints, e.g. (1, 128)")
    fmax = float(jnp.finfo(dtype).max)
    *lead, rows, cols = x.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    x = x.astype(jnp.float32)
    pad = [(0, 0)] * len(lead) + [(0, nr * br - rows), (0, nc * bc - cols)]
    xb = jnp.pad(x, pad).reshape(*lead, nr, br, nc, bc)
    amax = jnp.max(jnp.abs(xb), axis=(-3, -1))                      # [..., nr, nc]
    scale = amax * jnp.float32(1 / fmax)  # what XLA makes of amax / fmax, written out
    if power_of_two:
        mant, exp = jnp.frexp(scale)                                  # scale = mant * 2**exp
        scale = jnp.ldexp(jnp.ones_like(scale), jnp.where(mant == 0.5, exp - 1, exp))
    scale = jnp.where(scale >= jnp.finfo(jnp.float32).tiny, scale, jnp.float32(1))
    # x * (1/scale): what XLA makes of x / broadcast(scale), written out so every backend and
    # the tests' NumPy reference round alike
    q = jnp.clip(xb * (1 / scale)[..., :, None, :, None], -fmax, fmax).astype(dtype)
    q = q.reshape(*lead, nr * br, nc * bc)[..., :rows, :cols]
    return q, scale


def scaled_matmul(qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array) -> jax.Array:
    """``sum_k (qa_k @ qb_k) * sa[:, k, None] * sb[k, None, :]`` in float32, k over 128-blocks.

    ``qa [M, K]`` carries one scale per row and K block (``sa [M, ceil(K/128)]``), ``qb [K, N]``
    one per K block and column (``sb [ceil(K/128), N]``). Each block's product takes the float8
    operands with float32 accumulation; the scaled partial products are summed in float32 one
    block after another (a scan, so the live memory is one ``[M, N]`` accumulator).
    """
    (m, k), n = qa.shape, qb.shape[1]
    kb = -(-k // _TILE)
    if sa.shape != (m, kb) or sb.shape != (kb, n) or qb.shape[0] != k:
        raise ValueError(f"scaled_matmul shapes qa {qa.shape}, sa {sa.shape}, qb {qb.shape}, "
                         f"sb {sb.shape} do not agree; want sa [M, ceil(K/128)] and sb "
                         f"[ceil(K/128), N]")
    pad = kb * _TILE - k
    qa = jnp.pad(qa, ((0, 0), (0, pad))).reshape(m, kb, _TILE).transpose(1, 0, 2)  # [kb, M, T]
    qb = jnp.pad(qb, ((0, pad), (0, 0))).reshape(kb, _TILE, n)                     # [kb, T, N]

    def block(acc, args):
        a, b, s_a, s_b = args
        part = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return acc + part * s_a[:, None] * s_b[None, :], None

    acc, _ = jax.lax.scan(block, _zeros((m, n), qa, qb, sa, sb), (qa, qb, sa.T, sb))
    return acc


def _zeros(shape, *like: jax.Array) -> jax.Array:
    """float32 zeros varying over the `jax.shard_map` axes any of `like` varies over (a scan's
    accumulator must have its body's type)."""
    return _same_varying(jnp.zeros(shape, jnp.float32), *like)[0]


def _same_varying(*arrays: jax.Array) -> list[jax.Array]:
    """`arrays` marked as varying over the union of the `jax.shard_map` axes any of them varies
    over (a no-op outside a shard_map): the custom VJPs then return cotangents of their
    inputs' types, and the marks' own transposes sum what the broadcast operands need."""
    axes = set().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
    out = []
    for a in arrays:
        missing = tuple(sorted(axes - set(jax.typeof(a).manual_axis_type.varying)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def _expand_cols(scale: jax.Array, block: int, n: int) -> jax.Array:
    """``[R, ceil(n/block)]`` scales repeated to one per column: ``[R, n]``."""
    return jnp.repeat(scale, block, axis=1)[:, :n]


def _forward(x, w, power_of_two):
    qx, sx = quantize(x, block=ACTIVATION_BLOCK, power_of_two=power_of_two)
    qw, sw = quantize(w, block=WEIGHT_BLOCK, power_of_two=power_of_two)
    return scaled_matmul(qx, sx, qw, _expand_cols(sw, WEIGHT_BLOCK[1], w.shape[1])), (qw, sw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dot2d(x, w, options):
    """`options`: (grad_dtype, power_of_two, x dtype, w dtype), static."""
    return _forward(x, w, options[1])[0]


def _dot2d_fwd(x, w, options):
    y, (qw, sw) = _forward(x, w, options[1])
    # wgrad contracts over M: x^T is requantised per 1x128 tile along M (DeepSeek caches it so)
    qxt, sxt = quantize(x.T, block=ACTIVATION_BLOCK, power_of_two=options[1])
    return y, (qxt, sxt, qw, sw)


def _dot2d_bwd(options, res, dy):
    grad_dtype, power_of_two, x_dtype, w_dtype = options
    qxt, sxt, qw, sw = res
    k = qw.shape[0]
    # dgrad = dy @ w^T: dy per 1x128 tile along N; w^T's 128x128 blocks are w's, transposed
    qdy, sdy = quantize(dy, block=ACTIVATION_BLOCK, dtype=grad_dtype, power_of_two=power_of_two)
    dx = scaled_matmul(qdy, sdy, qw.T, _expand_cols(sw.T, WEIGHT_BLOCK[0], k))
    # wgrad = x^T @ dy: both operands per 128-tile along the contraction (M)
    qdyc, sdyc = quantize(dy, block=(_TILE, 1), dtype=grad_dtype, power_of_two=power_of_two)
    dw = scaled_matmul(qxt, sxt, qdyc, sdyc)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_dot2d.defvjp(_dot2d_fwd, _dot2d_bwd)


def dot(x: jax.Array, w: jax.Array, *, grad_dtype=jnp.float8_e4m3fn,
        power_of_two: bool = False) -> jax.Array:
    """float32 ``x @ w`` from blockwise-quantised FP8 operands, with an FP8 backward.

    Args:
      x: ``[..., K]`` unquantised; leading dims are flattened into rows (1x128 tiles never span
        rows, so this equals quantising each row separately).
      w: ``[K, N]`` unquantised.
      grad_dtype: the output gradient's fp8 dtype: ``jnp.float8_e4m3fn`` (DeepSeek-V3's choice,
        default) or ``jnp.float8_e5m2`` (wider range, 2 mantissa bits).
      power_of_two: power-of-two scales everywhere (see `quantize`).

    Forward: ``x`` per 1x128 tile, ``w`` per 128x128 block, `scaled_matmul`. Backward: ``dy``
    per 1x128 tile for ``dx = dy @ w^T`` (w's FP8 blocks reused, transposed); ``x^T`` per 1x128
    tile along M and ``dy`` per 128x1 tile for ``dw = x^T @ dy``. Gradients come back in the
    dtypes of `x` and `w`.

    Returns:
      float32 ``[..., N]``.
    """
    _check_dtype(grad_dtype)
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8.dot wants x [..., K] and w [K, N]; got x {x.shape}, w {w.shape}")
    lead = x.shape[:-1]
    options = (np.dtype(grad_dtype), bool(power_of_two), np.dtype(x.dtype), np.dtype(w.dtype))
    x, w = _same_varying(x.reshape(math.prod(lead), x.shape[-1]), w)
    y = _dot2d(x, w, options)
    return y.reshape(*lead, w.shape[1])


# -- the grouped (MoE) product ---------------------------------------------------------------

def _scaled_ragged(qa, sa, qb, sb, bn, group_sizes):
    """``qa [M, K]`` (scales ``sa [M, ceil(K/128)]``) times its row's group of ``qb [G, K, N]``
    (scales ``sb [G, ceil(K/128), ceil(N/bn)]``, one per K block and ``bn`` columns): a
    `jax.lax.ragged_dot` of float8 operands per 128-block of K, scaled and summed in float32."""
    (m, k), (g, _, n) = qa.shape, qb.shape
    kb = -(-k // _TILE)
    pad = kb * _TILE - k
    qa = jnp.pad(qa, ((0, 0), (0, pad))).reshape(m, kb, _TILE).transpose(1, 0, 2)
    qb = jnp.pad(qb, ((0, 0), (0, pad), (0, 0))).reshape(g, kb, _TILE, n).transpose(1, 0, 2, 3)
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right"), g - 1)

    def block(acc, args):
        a, b, s_a, s_b = args  # s_b [G, ceil(N/bn)]: to one scale per row and column
        part = jax.lax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32)
        s_b = jnp.repeat(s_b[row_group], bn, axis=-1)[:, :n]
        return acc + part * s_a[:, None] * s_b, None

    acc, _ = jax.lax.scan(block, _zeros((m, n), qa, qb, sa, sb, group_sizes),
                          (qa, qb, sa.T, sb.transpose(1, 0, 2)))
    return acc


def _scaled_ragged_wgrad(qat, sat, qd, sd, group_sizes, num_groups):
    """``dw[g] = sum over g's rows r of a[r]^T d[r]`` from ``qat [K, M]`` (scales ``sat
    [K, ceil(M/128)]``, 1x128 tiles along M) and ``qd [M, N]`` (scales ``sd [ceil(M/128), N]``,
    128x1 tiles): one ragged-contraction product of float8 operands per 128 rows (the group
    sizes cut to those rows), scaled and summed in float32 -> ``[G, K, N]``."""
    (k, m), n = qat.shape, qd.shape[1]
    mb = -(-m // _TILE)
    pad = mb * _TILE - m
    qat = jnp.pad(qat, ((0, 0), (0, pad))).reshape(k, mb, _TILE).transpose(1, 0, 2)  # [mb,K,T]
    qd = jnp.pad(qd, ((0, pad), (0, 0))).reshape(mb, _TILE, n)                       # [mb,T,N]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    lo = jnp.arange(mb)[:, None] * _TILE
    sizes = (jnp.clip(ends[None] - lo, 0, _TILE) - jnp.clip(starts[None] - lo, 0, _TILE))
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[])

    def block(acc, args):
        a, d, s_a, s_d, gs = args
        part = jax.lax.ragged_dot_general(a, d, gs.astype(group_sizes.dtype), dims,
                                          preferred_element_type=jnp.float32)  # [G, K, N]
        return acc + part * s_a[None, :, None] * s_d[None, None, :], None

    acc, _ = jax.lax.scan(block, _zeros((num_groups, k, n), qat, qd, sat, sd, sizes),
                          (qat, qd, sat.T, sd, sizes))
    return acc


def _ragged_forward(x, w, group_sizes, power_of_two):
    qx, sx = quantize(x, block=ACTIVATION_BLOCK, power_of_two=power_of_two)
    qw, sw = quantize(w, block=WEIGHT_BLOCK, power_of_two=power_of_two)
    return _scaled_ragged(qx, sx, qw, sw, WEIGHT_BLOCK[1], group_sizes), (qw, sw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged(x, w, group_sizes, options):
    return _ragged_forward(x, w, group_sizes, options[1])[0]


def _ragged_fwd(x, w, group_sizes, options):
    y, (qw, sw) = _ragged_forward(x, w, group_sizes, options[1])
    qxt, sxt = quantize(x.T, block=ACTIVATION_BLOCK, power_of_two=options[1])
    return y, (qxt, sxt, qw, sw, group_sizes)


def _ragged_bwd(options, res, dy):
    grad_dtype, power_of_two, x_dtype, w_dtype = options
    qxt, sxt, qw, sw, group_sizes = res
    qdy, sdy = quantize(dy, block=ACTIVATION_BLOCK, dtype=grad_dtype, power_of_two=power_of_two)
    dx = _scaled_ragged(qdy, sdy, qw.transpose(0, 2, 1), sw.transpose(0, 2, 1), WEIGHT_BLOCK[0],
                        group_sizes)
    qdyc, sdyc = quantize(dy, block=(_TILE, 1), dtype=grad_dtype, power_of_two=power_of_two)
    dw = _scaled_ragged_wgrad(qxt, sxt, qdyc, sdyc, group_sizes, qw.shape[0])
    return dx.astype(x_dtype), dw.astype(w_dtype), None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
               grad_dtype=jnp.float8_e4m3fn, power_of_two: bool = False) -> jax.Array:
    """float32 `jax.lax.ragged_dot` ``(x, w, group_sizes)`` from blockwise-quantised FP8
    operands: the MoE's grouped matmul.

    ``x [M, K]`` holds rows sorted by group (``group_sizes [G]``; rows past their sum give
    zeros), ``w [G, K, N]`` one weight per group (expert). ``x`` is quantised per 1x128 tile,
    each ``w[g]`` per 128x128 block; the backward as in `dot`, with ``dw[g] = x_g^T dy_g`` over
    128-row tiles of ``x^T`` and ``dy`` (a tile may span two groups: it shares their scale).
    """
    _check_dtype(grad_dtype)
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != w.shape[:1]:
        raise ValueError(f"fp8.ragged_dot wants x [M, K], w [G, K, N], group_sizes [G]; got "
                         f"x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}")
    options = (np.dtype(grad_dtype), bool(power_of_two), np.dtype(x.dtype), np.dtype(w.dtype))
    return _ragged(*_same_varying(x, w, group_sizes), options)
