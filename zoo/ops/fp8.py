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
* `prequantize(w)` makes a weight's FP8 copy once (`QuantizedWeight`: the weight, its float8
  values, scales and `quantize_stats` counts; leading dims are batch dims, e.g. a stack's
  layers); `dot` takes it in place of the weight, with the same values forward and backward.
* `ragged_dot(x, w, group_sizes)` is the same for the MoE's grouped matmul (`jax.lax.ragged_dot`
  per 128-block of K, one 128x128-blocked weight per group); it takes a `QuantizedWeight` of
  ``[G, K, N]`` in place of the weight as `dot` does.
* `sharded_dot(x, w, mesh=, x_spec=, w_spec=)`: `dot` on a mesh as one `jax.shard_map` (the
  weight, or its FP8 copy, gathered once; its gradient reduce-scattered). Left to XLA's
  partitioner, `dot`'s loops over 128-blocks slice sharded axes and XLA gathers a whole
  operand in every iteration.
* `Tiles` (`quantize_tiles`): rows quantised per 1x128 tile in a form that moves like the rows,
  with a straight-through gradient; `pack_tiles` / `unpack_tiles` put them on a wire as
  ``K + 4 * ceil(K/128)`` bytes a row, and `ragged_dot` takes them without quantising again
  (the MoE's FP8 dispatch, `zoo.ops.moe.all_to_all_experts`).

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
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zoo.partitioning import mesh_platform

__all__ = ["ACTIVATION_BLOCK", "FP8_DTYPES", "Fp8EmulatedWarning", "MODES", "STATS",
           "TPU_FP8_KINDS", "WEIGHT_BLOCK", "check_mode", "check_target",
           "dot", "pack_tiles", "prequantize", "QuantizedWeight", "quantize",
           "quantize_stats", "quantize_tiles", "ragged_dot", "scaled_matmul",
           "sharded_dot", "Tiles",
           "unpack_tiles", "whole_blocks"]

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
    return _quantize_parts(x, (br, bc), dtype, power_of_two)[:2]


def _quantize_parts(x, block, dtype, power_of_two):
    """`quantize`'s ``(q, scale)`` and its intermediates ``(|x| in blocks [..., nr, br, nc,
    bc] float32, amax [..., nr, nc])``, which `quantize_stats` reuses (one amax per block)."""
    br, bc = block
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
    return q, scale, xb, amax


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


def _weight_copy(w: jax.Array, power_of_two: bool) -> tuple[jax.Array, jax.Array]:
    """``w [..., K, N]``'s FP8 values and 128x128-block scales for one product (no gradient:
    the products' VJPs give ``w`` its gradient), when no `prequantize` copy was passed."""
    return jax.lax.stop_gradient(quantize(w, block=WEIGHT_BLOCK, power_of_two=power_of_two))


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


def dot(x: jax.Array, w: jax.Array | QuantizedWeight, *, grad_dtype=jnp.float8_e4m3fn,
        power_of_two: bool = False) -> jax.Array:
    """float32 ``x @ w`` from blockwise-quantised FP8 operands, with an FP8 backward.

    Args:
      x: ``[..., K]`` unquantised; leading dims are flattened into rows (1x128 tiles never span
        rows, so this equals quantising each row separately).
      w: ``[K, N]`` unquantised, or its `prequantize` (`QuantizedWeight`): the product then
        takes that FP8 copy instead of quantising ``w`` again (the same values, forward and
        backward; ``w`` takes the gradient).
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
    pre = w if isinstance(w, QuantizedWeight) else None
    w = w.w if pre is not None else w
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8.dot wants x [..., K] and w [K, N]; got x {x.shape}, w {w.shape}")
    lead = x.shape[:-1]
    options = (np.dtype(grad_dtype), bool(power_of_two), np.dtype(x.dtype), np.dtype(w.dtype))
    x = x.reshape(math.prod(lead), x.shape[-1])
    if pre is not None:
        pre.check(power_of_two)
    qw, sw = (pre.q, pre.scale) if pre is not None else _weight_copy(w, power_of_two)
    y = _dot2d(*_same_varying(x, w, qw, sw), options)
    return y.reshape(*lead, w.shape[1])


# -- weights quantised once per step --------------------------------------------------------

class QuantizedWeight(NamedTuple):
    """A weight with its FP8 copy (`prequantize`): made once, used by every `dot` or
    `ragged_dot` that takes it in place of the weight. ``w [..., K, N]`` is the weight (the
    gradient's target), ``q`` its float8 E4M3 values and ``scale [..., ceil(K/128),
    ceil(N/128)]`` float32 their 128x128 blocks' scales, ``stats [..., 4]`` float32
    `quantize_stats` counts of each ``[K, N]``; leading dims are batch dims (a stack's layers,
    a MoE's experts), sliced alike by `jax.lax.scan` or a `jax.shard_map`. ``q``, ``scale``
    and ``stats`` carry no gradient. Its scales are ``amax / 448`` (products that take it
    refuse ``power_of_two=True``)."""
    w: jax.Array
    q: jax.Array
    scale: jax.Array
    stats: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    @staticmethod
    def check(power_of_two: bool) -> None:
        if power_of_two:
            raise ValueError("power_of_two=True with a QuantizedWeight: prequantize makes "
                             "amax/448 scales; pass the unquantised weight for power-of-two "
                             "scales")

    def gathered(self, fn, *, scale: bool = True) -> QuantizedWeight:
        """The copy of a weight gathered by ``fn`` (an all-gather of one dim inside a
        `jax.shard_map`): ``w`` and ``q`` through ``fn``, ``scale`` too where it is sharded
        on that dim (``scale``; a scale left whole by `whole_blocks` stays), ``stats`` as
        they are."""
        return QuantizedWeight(fn(self.w), fn(self.q), fn(self.scale) if scale else self.scale,
                               self.stats)

    def map(self, fn) -> QuantizedWeight:
        """`fn` applied to ``w``, ``q``, ``scale`` and ``stats`` (e.g. a slice of leading
        dims, an all-gather along a 128-aligned dim)."""
        return QuantizedWeight(*(fn(a) for a in self))


def whole_blocks(dim: int, shards: int) -> bool:
    """Whether ``shards`` equal shards of a weight dimension of size ``dim`` each hold whole
    128-blocks: then the blocks each shard quantises are those of the whole weight, so an FP8
    copy made once (`prequantize`) can be sharded like the weight, its scales included; else
    a block straddles two shards (each shard must quantise its own part, or the copy's scales
    stay whole along that dimension)."""
    return dim % (shards * WEIGHT_BLOCK[1]) == 0


def prequantize(w: jax.Array) -> QuantizedWeight:
    """``w [..., K, N]`` with its FP8 copy per 128x128 block of each ``[K, N]`` (the values
    `quantize` with `WEIGHT_BLOCK` gives, so `dot` and `ragged_dot` of the result equal those
    of `w`, forward and backward) and its `quantize_stats` counts, from one reduction per
    block. Gradients reach ``w`` only through the products' VJPs."""
    if w.ndim < 2:
        raise ValueError(f"prequantize wants a weight [..., K, N], got shape {w.shape}")
    parts = _quantize_parts(w, WEIGHT_BLOCK, jnp.float8_e4m3fn, False)
    q, scale, stats = jax.lax.stop_gradient(
        (parts[0], parts[1], _block_counts(w, *parts, jnp.float8_e4m3fn)))
    return QuantizedWeight(w, q, scale, stats)


def _dot_forward(x, qw, sw, power_of_two):
    qx, sx = quantize(x, block=ACTIVATION_BLOCK, power_of_two=power_of_two)
    return scaled_matmul(qx, sx, qw, _expand_cols(sw, WEIGHT_BLOCK[1], qw.shape[1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dot2d(x, w, qw, sw, options):
    """``x [M, K] @ w [K, N]`` from ``w``'s FP8 copy (``qw``, ``sw``: `prequantize`'s or
    `_weight_copy`'s); ``w`` takes the gradient. `options`: (grad_dtype, power_of_two, x dtype,
    w dtype), static."""
    return _dot_forward(x, qw, sw, options[1])


def _dot2d_fwd(x, w, qw, sw, options):
    # wgrad contracts over M: x^T is requantised per 1x128 tile along M (DeepSeek caches it so)
    qxt, sxt = quantize(x.T, block=ACTIVATION_BLOCK, power_of_two=options[1])
    return _dot_forward(x, qw, sw, options[1]), (qxt, sxt, qw, sw)


def _dot2d_vjp(options, res, dy):
    return (*_dot2d_bwd(options, res, dy), None, None)


_dot2d.defvjp(_dot2d_fwd, _dot2d_vjp)


# -- the product per shard (a mesh's dense layers) -----------------------------------------

def sharded_dot(x: jax.Array, w: jax.Array | QuantizedWeight, *, mesh, x_spec, w_spec,
                grad_dtype=jnp.float8_e4m3fn, power_of_two: bool = False) -> jax.Array:
    """`dot` of ``x [..., K]`` sharded ``x_spec`` and ``w [K, N]`` (or its `prequantize`)
    sharded ``w_spec`` on `mesh`, as one `jax.shard_map`: each shard all-gathers the weight's
    K dim once, multiplies its own rows, and the gather's transpose reduce-scatters the
    weight's gradient (FSDP's pattern).

    Why: `dot`'s loops over 128-blocks (`scaled_matmul`) slice one block per iteration; left
    to XLA's partitioner, a sliced axis that is sharded (the weight's K under FSDP, the
    tokens in the weight gradient) makes XLA all-gather the whole operand in every
    iteration. Per shard, every loop is local.

    Args:
      x: ``[..., K]``; ``x_spec``'s entry for K is gathered before the product (a 1x128 tile
        needs its whole row).
      w: ``[K, N]`` or a `QuantizedWeight` of one; the FP8 copy's float8 values and scales
        are what travels when each K shard holds whole 128-blocks (half the bytes of a
        bfloat16 weight), else the weight, quantised after the gather (the same values).
      mesh: the mesh both specs name. Inside a `jax.shard_map` over any axis the specs name
        (the operands are that shard's already) this is `dot`.
      x_spec, w_spec: `jax.sharding.PartitionSpec` (or tuples) of ``x`` and ``w``.
      grad_dtype, power_of_two: as in `dot`.

    Returns:
      float32 ``[..., N]`` sharded ``(*x_spec[:-1], n)``, where ``n`` is ``w_spec``'s N entry
      when its shards hold whole 128-column blocks and share no axis with ``x_spec``'s lead
      dims (else N is gathered too).
    """
    pre = w if isinstance(w, QuantizedWeight) else None
    k, n = (pre.w if pre is not None else w).shape
    x_spec, w_spec = tuple(x_spec), tuple(w_spec)
    if len(x_spec) > x.ndim or len(w_spec) > 2 or x.shape[-1] != k:
        raise ValueError(f"sharded_dot wants x [..., K] with x_spec of at most x.ndim entries "
                         f"and w [K, N] with w_spec of at most 2; got x {x.shape} {x_spec}, "
                         f"w [{k}, {n}] {w_spec}")
    x_spec += (None,) * (x.ndim - len(x_spec))
    w_spec += (None,) * (2 - len(w_spec))
    names = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
    size = lambda e: math.prod(mesh.shape[a] for a in names(e))
    lead = x_spec[:-1]
    named = {a for e in x_spec + w_spec for a in names(e)}
    if named & set(jax.sharding.get_abstract_mesh().manual_axes):
        return dot(x, w, grad_dtype=grad_dtype, power_of_two=power_of_two)
    taken = {a for e in lead for a in names(e)}
    keep_n = (size(w_spec[1]) > 1 and not taken & set(names(w_spec[1]))
              and whole_blocks(n, size(w_spec[1])))
    gathers = [(0, names(w_spec[0])), (1, () if keep_n else names(w_spec[1]))]
    gathers = [(axis, a) for axis, a in gathers if a]
    send_copy = pre is not None and all(whole_blocks(dim, size(e))
                                        for dim, e in zip((k, n), w_spec))

    def gather(a):  # [..., K, N] shards -> the product's weight (leading dims: none here)
        for axis, a_names in gathers:
            a = jax.lax.all_gather(a, a_names, axis=a.ndim - 2 + axis, tiled=True)
        return a

    def local(x, w):
        w = w.gathered(gather) if isinstance(w, QuantizedWeight) else gather(w)
        return dot(x, w, grad_dtype=grad_dtype, power_of_two=power_of_two)

    w_in = P(*w_spec)
    if send_copy:
        w_in = QuantizedWeight(w_in, w_in, w_in, P())
        w_arg = pre
    else:
        w_arg = pre.w if pre is not None else w
    return jax.shard_map(local, mesh=mesh, in_specs=(P(*lead, None), w_in),
                         out_specs=P(*lead, w_spec[1] if keep_n else None))(x, w_arg)


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


def _ragged_forward(x, qw, sw, group_sizes, power_of_two):
    qx, sx = quantize(x, block=ACTIVATION_BLOCK, power_of_two=power_of_two)
    return _scaled_ragged(qx, sx, qw, sw, WEIGHT_BLOCK[1], group_sizes)


def _ragged_bwd(options, res, dy):
    grad_dtype, power_of_two, x_dtype, w_dtype = options
    qxt, sxt, qw, sw, group_sizes = res
    qdy, sdy = quantize(dy, block=ACTIVATION_BLOCK, dtype=grad_dtype, power_of_two=power_of_two)
    dx = _scaled_ragged(qdy, sdy, qw.transpose(0, 2, 1), sw.transpose(0, 2, 1), WEIGHT_BLOCK[0],
                        group_sizes)
    qdyc, sdyc = quantize(dy, block=(_TILE, 1), dtype=grad_dtype, power_of_two=power_of_two)
    dw = _scaled_ragged_wgrad(qxt, sxt, qdyc, sdyc, group_sizes, qw.shape[0])
    return dx.astype(x_dtype), dw.astype(w_dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ragged(x, w, qw, sw, group_sizes, options):
    """The grouped product from ``w``'s FP8 copy (``qw``, ``sw``: `prequantize`'s or
    `_weight_copy`'s); ``w`` takes the gradient."""
    return _ragged_forward(x, qw, sw, group_sizes, options[1])


def _ragged_fwd(x, w, qw, sw, group_sizes, options):
    qxt, sxt = quantize(x.T, block=ACTIVATION_BLOCK, power_of_two=options[1])
    y = _ragged_forward(x, qw, sw, group_sizes, options[1])
    return y, (qxt, sxt, qw, sw, group_sizes)


def _ragged_vjp(options, res, dy):
    dx, dw, _ = _ragged_bwd(options, res, dy)
    return dx, dw, None, None, None


_ragged.defvjp(_ragged_fwd, _ragged_vjp)


def ragged_dot(x: jax.Array | Tiles, w: jax.Array | QuantizedWeight, group_sizes: jax.Array,
               *, grad_dtype=jnp.float8_e4m3fn, power_of_two: bool = False) -> jax.Array:
    """float32 `jax.lax.ragged_dot` ``(x, w, group_sizes)`` from blockwise-quantised FP8
    operands: the MoE's grouped matmul.

    ``x [M, K]`` holds rows sorted by group (``group_sizes [G]``; rows past their sum give
    zeros), ``w [G, K, N]`` one weight per group (expert). ``x`` is quantised per 1x128 tile,
    each ``w[g]`` per 128x128 block; the backward as in `dot`, with ``dw[g] = x_g^T dy_g`` over
    128-row tiles of ``x^T`` and ``dy`` (a tile may span two groups: it shares their scale).

    ``x`` may come quantised already (`Tiles`, e.g. rows that crossed the MoE's all-to-all in
    FP8): its tiles are used as they are, so the forward equals that of the rows they were
    made from; the weight gradient's ``x^T`` tiles are cut from the dequantised rows (the
    original rows are elsewhere), and ``x``'s gradient goes to ``Tiles.values``.

    ``w`` may be its `prequantize` (`QuantizedWeight` of ``[G, K, N]``): the product takes
    that FP8 copy instead of quantising ``w`` again, for rows and `Tiles` alike (the same
    values forward and backward; ``QuantizedWeight.w`` takes the gradient) -- the MoE's
    expert weights quantised once per step (`zoo.layers.MoE.fp8_weights`).
    """
    _check_dtype(grad_dtype)
    pre = w if isinstance(w, QuantizedWeight) else None
    w = w.w if pre is not None else w
    rows = x.values if isinstance(x, Tiles) else x
    if (rows.ndim != 2 or w.ndim != 3 or rows.shape[1] != w.shape[1]
            or group_sizes.shape != w.shape[:1]):
        raise ValueError(f"fp8.ragged_dot wants x [M, K], w [G, K, N], group_sizes [G]; got "
                         f"x {rows.shape}, w {w.shape}, group_sizes {group_sizes.shape}")
    options = (np.dtype(grad_dtype), bool(power_of_two), np.dtype(rows.dtype), np.dtype(w.dtype))
    if pre is not None:
        pre.check(power_of_two)
    qw, sw = (pre.q, pre.scale) if pre is not None else _weight_copy(w, power_of_two)
    if isinstance(x, Tiles):
        return _ragged_tiles(*_same_varying(x.values, x.scale, w, qw, sw, group_sizes), options)
    return _ragged(*_same_varying(x, w, qw, sw, group_sizes), options)


# -- tiles that travel (the MoE's FP8 dispatch) ----------------------------------------------

class Tiles(NamedTuple):
    """Rows quantised per 1x128 tile (`quantize_tiles`) in a form that moves like the rows.

    ``values [M, K]`` hold the E4M3 values exactly, in the rows' own float dtype (every E4M3
    value is a bfloat16, float16 and float32 value), ``scale [M, ceil(K/128)]`` float32 their
    dequantisation factors: ``rows ≈ values * scale``. Row moves (gathers, all-to-alls) apply
    to both alike; `ragged_dot` takes them without quantising again, and a wire may send
    ``values`` as float8 bytes (`zoo.ops.moe.all_to_all_experts`). Gradients are
    straight-through, as in `dot`: the cotangent of ``values`` is the gradient with respect to
    the dequantised rows, ``scale`` takes none.
    """
    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    def take(self, idx: jax.Array, move) -> Tiles:
        """The rows `idx` of both: ``values`` by ``move(values)`` (a differentiable row move,
        e.g. `zoo.ops.rows.take_rows`), ``scale`` by plain indexing (it has no gradient)."""
        return Tiles(move(self.values), jax.lax.stop_gradient(self.scale)[idx])

    def dequantize(self) -> jax.Array:
        """The rows these tiles stand for: float32 ``values * scale``."""
        k = self.values.shape[-1]
        return self.values.astype(jnp.float32) * _expand_cols(self.scale, _TILE, k)


def pack_tiles(tiles: Tiles) -> jax.Array:
    """`Tiles` ``[M, K]`` as one uint8 row each for a wire: the K float8 bytes, then the
    ``ceil(K/128)`` float32 scales' bytes -- ``K + 4 * ceil(K/128)`` bytes a row against
    ``2 * K`` in bfloat16. No gradient (`unpack_tiles` is its inverse)."""
    values, scale = (jax.lax.stop_gradient(a) for a in tiles)
    q = jax.lax.bitcast_convert_type(values.astype(jnp.float8_e4m3fn), jnp.uint8)
    s = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint8)  # [M, Kb, 4]
    return jnp.concatenate([q, s.reshape(*scale.shape[:-1], -1)], axis=-1)


def unpack_tiles(rows: jax.Array, k: int, dtype) -> Tiles:
    """`pack_tiles`' rows ``[M, K + 4 * ceil(K/128)]`` uint8 back to `Tiles` with values in
    `dtype` (exact)."""
    kb = -(-k // _TILE)
    if rows.dtype != jnp.uint8 or rows.shape[-1] != k + 4 * kb:
        raise ValueError(f"unpack_tiles wants uint8 rows of {k} + 4*{kb} bytes (pack_tiles of "
                         f"K={k}), got {rows.dtype} {rows.shape}")
    q = jax.lax.bitcast_convert_type(rows[..., :k], jnp.float8_e4m3fn)
    s = rows[..., k:].reshape(*rows.shape[:-1], kb, 4)
    return Tiles(q.astype(dtype), jax.lax.bitcast_convert_type(s, jnp.float32))


def quantize_tiles(x: jax.Array, *, power_of_two: bool = False) -> Tiles:
    """``x [M, K]`` quantised per 1x128 tile (`quantize` with `ACTIVATION_BLOCK`) as `Tiles`
    in ``x``'s dtype; the gradient passes straight through to ``x``."""
    if x.ndim != 2:
        raise ValueError(f"quantize_tiles wants rows x [M, K], got shape {x.shape}; reshape "
                         f"to (-1, K) first")
    return Tiles(*_tiles(x, bool(power_of_two)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _tiles(x, power_of_two):
    q, scale = quantize(x, block=ACTIVATION_BLOCK, power_of_two=power_of_two)
    return q.astype(x.dtype), scale


def _tiles_fwd(x, power_of_two):
    return _tiles(x, power_of_two), None


def _tiles_bwd(power_of_two, res, cotangents):
    return (cotangents[0],)


_tiles.defvjp(_tiles_fwd, _tiles_bwd)


def _tiles_product(values, scale, qw, sw, group_sizes):
    qx = values.astype(jnp.float8_e4m3fn)  # exact: the values are E4M3 values
    return _scaled_ragged(qx, scale, qw, sw, WEIGHT_BLOCK[1], group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ragged_tiles(values, scale, w, qw, sw, group_sizes, options):
    """The grouped product of rows that come quantised (`Tiles`) and ``w``'s FP8 copy
    (``qw``, ``sw``); ``w`` takes the gradient, ``values`` the rows'."""
    return _tiles_product(values, scale, qw, sw, group_sizes)


def _ragged_tiles_fwd(values, scale, w, qw, sw, group_sizes, options):
    y = _tiles_product(values, scale, qw, sw, group_sizes)
    rows = Tiles(values, scale).dequantize()
    qxt, sxt = quantize(rows.T, block=ACTIVATION_BLOCK, power_of_two=options[1])
    return y, (qxt, sxt, qw, sw, group_sizes)


def _ragged_tiles_bwd(options, res, dy):
    dx, dw, _ = _ragged_bwd(options, res, dy)
    return dx, None, dw, None, None, None


_ragged_tiles.defvjp(_ragged_tiles_fwd, _ragged_tiles_bwd)


# -- statistics: what quantisation did (the train step's fp8/ metrics) ----------------------

STATS = ("blocks", "saturated_blocks", "nonzero", "underflow")  # `quantize_stats`' entries
_CLIP_SLACK = 1 + 2.0 ** -20  # a quotient past fmax by this much is a clip, not rounding


def quantize_stats(x: jax.Array, *, block: tuple[int, int] = ACTIVATION_BLOCK,
                   dtype=jnp.float8_e4m3fn, power_of_two: bool = False) -> jax.Array:
    """float32 ``[4]`` counts (`STATS`) of what `quantize` does to `x` with these arguments.

    * ``blocks``: the blocks (partial edge blocks count as one).
    * ``saturated_blocks``: blocks whose scale hit an extreme: a nonzero block whose
      ``amax / fmax`` fell below the smallest normal float32, so it took ``scale = 1`` and its
      values underflow; a block with a non-finite value (no finite scale holds it); or a block
      with a value clipped to ``±fmax`` (``|x| > fmax * scale`` beyond float32 rounding of
      the quotient -- with ``amax / fmax`` scales only the first two kinds occur).
    * ``nonzero``: the nonzero values of `x`; ``underflow``: those that are zero in FP8.

    Counts are float32 sums (exact below 2**24; fractions of them are what the metrics
    report). `x` is ``[..., rows, cols]`` as in `quantize`.
    """
    _check_dtype(dtype)
    parts = _quantize_parts(x, tuple(int(b) for b in block), dtype, power_of_two)
    return jnp.sum(_block_counts(x, *parts, dtype).reshape(-1, len(STATS)), axis=0)


def _block_counts(x, q, scale, xb, amax, dtype) -> jax.Array:
    """`quantize_stats`' counts per leading index of ``x [..., rows, cols]``: ``[..., 4]``,
    from `_quantize_parts`' ``(q, scale, xb, amax)``."""
    fmax = float(jnp.finfo(dtype).max)
    bound = (scale * jnp.float32(fmax * _CLIP_SLACK))[..., :, None, :, None]
    clipped = jnp.any(jnp.abs(xb) > bound, axis=(-3, -1))
    tiny = (amax > 0) & (amax * jnp.float32(1 / fmax) < jnp.finfo(jnp.float32).tiny)
    saturated = tiny | ~jnp.isfinite(amax) | clipped
    nonzero = x.astype(jnp.float32) != 0
    under = nonzero & (q.astype(jnp.float32) == 0)
    count = lambda a: jnp.sum(a, axis=(-2, -1), dtype=jnp.float32)
    blocks = jnp.full(scale.shape[:-2], scale.shape[-2] * scale.shape[-1], jnp.float32)
    return jnp.stack([blocks, count(saturated), count(nonzero), count(under)], axis=-1)


# -- targets: which chips multiply float8 ----------------------------------------------------

class Fp8EmulatedWarning(UserWarning):
    """``fp8="blockwise"`` on a TPU with no FP8 matrix unit: it runs emulated (`check_target`).
    ``warnings.simplefilter("error", Fp8EmulatedWarning)`` refuses such runs instead."""


# TPU generations whose matrix units multiply float8 (Ironwood); v4, v5e, v5p and v6e do not
TPU_FP8_KINDS = ("TPU7x", "TPU v7")


def check_target(mode: str | None, mesh) -> None:
    """Warn (`Fp8EmulatedWarning`) when FP8 `mode` is asked for on a mesh of TPU chips without
    an FP8 matrix unit (TPU v4, v5e, v5p, v6e: the platform is read from the mesh's devices,
    never from the process's backend). zoo runs it there anyway, as on the CPU: the same
    quantisation and float8 products (XLA:TPU compiles them; its MXU multiplies them without
    an FP8 mode) -- FP8's numerics, none of its speed. GPUs (H100/H200: FP8 tensor cores),
    CPUs (the development emulation) and meshes without devices pass silently."""
    if check_mode(mode) != "blockwise" or mesh is None:
        return
    try:
        devices = mesh.devices
    except ValueError:  # an AbstractMesh: no devices, no target yet
        return
    if not isinstance(devices, np.ndarray) or not devices.size:
        return
    kind = getattr(devices.flat[0], "device_kind", "")
    if mesh_platform(mesh) != "tpu" or kind.startswith(TPU_FP8_KINDS):
        return
    warnings.warn(
        f"fp8='blockwise' on {kind!r}: this TPU has no FP8 matrix unit (FP8 MXUs start with "
        f"TPU7x/Ironwood), so zoo runs FP8 emulated -- the same blockwise quantisation and "
        f"float8 products, which XLA:TPU compiles without FP8 throughput: FP8's numerics "
        f"without its speed-up. Use fp8=None for speed, or keep it to study FP8 numerics "
        f"(docs/fp8.md); warnings.simplefilter('error', zoo.ops.fp8.Fp8EmulatedWarning) "
        f"refuses instead.", Fp8EmulatedWarning, stacklevel=3)
