"""Rows moved inside `jax.shard_map`, and the `jax.shard_map` axes values vary over.

The mixture-of-experts ops share them: the grouped products (`zoo.ops.grouped`), the dispatch
schemes (`zoo.ops.moe`, `zoo.ops.moe_rounds`) and the expert-parallel wire
(`zoo.ops.moe_wire`).

* `take_rows` -- ``x[idx]`` for an ``idx`` that takes every row the same number of times (a
  permutation, or a token's k copies), whose gradient is a gather as well (not the
  scatter-add, and on TPU the sort, that autodiff makes of a gather);
  `inverse_permutation` -- the permutation that undoes one.
* `varying_axes`, `mark_varying`, `as_varying` -- the `jax.shard_map` axes a value varies
  over, and a value (or a cotangent) given the varying type another one needs; outside a
  shard_map they are no-ops.

Legend: R rows, D (W) row width, c copies of each row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def varying_axes(v: jax.Array) -> frozenset:
    """The `jax.shard_map` axes `v` varies over (empty outside a shard_map)."""
    return jax.typeof(v).manual_axis_type.varying


def mark_varying(v: jax.Array, axes) -> jax.Array:
    """`v` marked as varying over `axes` too (inside `jax.shard_map`; a no-op outside)."""
    missing = tuple(sorted(set(axes) - varying_axes(v)))
    return jax.lax.pcast(v, missing, to="varying") if missing else v


def as_varying(v: jax.Array, axes) -> jax.Array:
    """A cotangent given the type of an input that varies over exactly `axes`: summed over the
    axes it varies over and the input does not (the transpose of the implicit broadcast),
    marked varying over those it lacks."""
    extra = tuple(sorted(varying_axes(v) - set(axes)))
    return mark_varying(jax.lax.psum(v, extra) if extra else v, axes)


def take_rows(x: jax.Array, idx: jax.Array, inv: jax.Array) -> jax.Array:
    """``x[idx]`` for an ``idx`` that takes every row of ``x [R, D]`` the same number of times
    ``c`` (a permutation: ``c = 1``; a token's k copies: ``c = k``), whose gradient is a gather
    as well: ``inv [c * R]`` says where copy ``q`` of row ``q % R`` sits in the result
    (``idx[inv[q]] == q % R``), so ``dx = sum over copies of g[inv]`` -- not the scatter-add
    (and, on TPU, the sort of the indices) that autodiff makes of a gather."""
    return _take_rows(x, idx, inv, x.shape[0], varying_axes(x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _take_rows(x, idx, inv, rows, axes):
    return x[idx]


def _take_rows_fwd(x, idx, inv, rows, axes):
    return x[idx], (idx, inv)


def _take_rows_bwd(rows, axes, res, g):
    idx, inv = res
    copies = g[inv].reshape(-1, rows, *g.shape[1:])
    dx = copies[0] if copies.shape[0] == 1 else jnp.sum(copies, 0, dtype=jnp.float32)
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)
    return as_varying(dx.astype(g.dtype), axes), zero(idx), zero(inv)


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def inverse_permutation(perm: jax.Array) -> jax.Array:
    """``inv`` with ``inv[perm[i]] == i`` (an integer scatter of distinct indices)."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype),
                                             unique_indices=True)
