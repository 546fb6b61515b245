"""Load-balanced sequence reordering for causal context parallelism, and its inverse.

With causal attention split over ``cp`` shards of the sequence, the shard holding the last
tokens does the most work (it attends to everything before it). Cutting the sequence into
``2*cp`` equal chunks and giving shard ``r`` chunks ``r`` and ``2*cp-1-r`` pairs a cheap chunk
with an expensive one, so every shard does the same work.

* `load_balance(x, cp, axis)` -- reorder ``[c0 c1 ... c_{2cp-1}]`` into
  ``[c0 c_{2cp-1} | c1 c_{2cp-2} | ... | c_{cp-1} c_cp]`` (shard ``r`` is the ``r``-th pair).
* `restore_order(x, cp, axis)` -- the exact inverse.

Example, ``cp=4`` and 16 tokens (chunks of 2)::

    0 1 | 14 15 | 2 3 | 12 13 | 4 5 | 10 11 | 6 7 | 8 9

Both work on numpy arrays (returning numpy) and on jax arrays or tracers (returning jax), with
static slices and one concatenation, so under `jax.jit` they lower to copies, not gathers.
Masks in attention are computed from the carried ``positions``/``segment_ids``, never from
array indices, so a model consuming reordered arrays needs no inverse.

Legend: L length (the reordered axis), ``m = 2*cp`` chunks of ``L // m`` tokens.
"""

from __future__ import annotations

import numpy as np

__all__ = ["load_balance", "restore_order", "chunk_order", "check_length"]


def _check_cp(cp) -> int:
    if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"context_parallel={cp!r} must be a positive integer (1 = no reorder)")
    return int(cp)


def check_length(length: int, cp: int, what: str = "sequence length") -> None:
    """Raise a `ValueError` unless ``length`` splits into ``2*cp`` equal chunks (cp=1: any)."""
    cp = _check_cp(cp)
    if cp == 1:
        return
    m = 2 * cp
    if length % m == 0 and length > 0:
        return
    lower, upper = (length // m) * m, (length // m + 1) * m
    nearest = upper if lower == 0 or length - lower > upper - length else lower
    raise ValueError(
        f"{what} {length} is not divisible by 2*context_parallel = {m} (load-balanced "
        f"reordering cuts it into {m} equal chunks); the nearest valid length is {nearest}"
        + (f" (or {upper})" if nearest != upper else ""))


def chunk_order(cp: int) -> list[int]:
    """Chunk indices in load-balanced order: ``[0, 2cp-1, 1, 2cp-2, ..., cp-1, cp]``."""
    cp = _check_cp(cp)
    order = []
    for r in range(cp):
        order += [r, 2 * cp - 1 - r]
    return order


def _permute_chunks(x, cp: int, axis: int, order: list[int]):
    cp = _check_cp(cp)
    if cp == 1:
        return x
    if not hasattr(x, "shape"):  # lists and scalars: treat as numpy
        x = np.asarray(x)
    ndim = np.ndim(x)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array of rank {ndim}")
    axis %= ndim
    length = np.shape(x)[axis]
    check_length(length, cp)
    if isinstance(x, np.ndarray):
        xp = np
    else:  # jax arrays and tracers; imported lazily so numpy-only users never pay for jax
        import jax.numpy as xp
    chunk = length // (2 * cp)
    index = [slice(None)] * ndim

    def piece(c):
        index[axis] = slice(c * chunk, (c + 1) * chunk)
        return x[tuple(index)]

    return xp.concatenate([piece(c) for c in order], axis=axis)


def load_balance(x, cp: int, axis: int = 1):
    """Reorder ``x`` along ``axis`` so context shard ``r`` holds chunks ``r`` and ``2cp-1-r``.

    ``cp=1`` returns ``x`` unchanged. The length along ``axis`` must be divisible by ``2*cp``
    (`ValueError` naming the nearest valid length otherwise).
    """
    return _permute_chunks(x, cp, axis, chunk_order(cp))


def restore_order(x, cp: int, axis: int = 1):
    """Exact inverse of `load_balance`: ``restore_order(load_balance(x, cp), cp) == x``."""
    order = chunk_order(cp)
    inverse = [0] * len(order)
    for position, c in enumerate(order):
        inverse[c] = position
    return _permute_chunks(x, cp, axis, inverse)
