"""The expert-parallel wire of `zoo.ops.moe.all_to_all_experts`: token copies to the devices
holding their experts and back, over one `jax.shard_map` axis.

* `send_plan` (a `SendPlan`) -- on the sender: the send order, copies by peer, then by that
  peer's local expert; the copies beyond a peer's ``capacity`` go last and are not sent
  (first choices before second choices, then token order). Only rows and a ``[EP,
  E_local]`` count table travel (no expert ids).
* `arrival_layout` -- on the receiver, from the counts alone: where each arrived row sits once
  sorted by expert.
* `Wire` (static: axis, peers, rows per peer, tokens, transport) and `Route` (traced: the
  plan, this device's index, the rows each peer sends) -- one exchange.
* `dispatch_rows` / `return_rows` -- rows there and back: ``"ragged"``
  (`jax.lax.ragged_all_to_all`: only real rows travel; GPU/TPU), ``"padded"`` (a dense
  `jax.lax.all_to_all` of ``[EP, C, W]``; XLA:CPU has no ragged all-to-all) or ``"auto"``
  (padded when lowered for CPU, ragged elsewhere: `jax.lax.platform_dependent`);
  differentiable, rows moved by `zoo.ops.rows.take_rows`.
* `send_tiles` -- `dispatch_rows` of FP8 `zoo.ops.fp8.Tiles` (float8 bytes and their scales
  in one row, `zoo.ops.fp8.pack_tiles`); their gradients come back in the compute dtype.

Legend as in `zoo.ops.moe`: T tokens, M token copies (T*k), EP (``n``) peers, C (``cap``)
receive rows per peer, E_local experts per device, W row width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zoo.ops import fp8
from zoo.ops.rows import as_varying, inverse_permutation, mark_varying, take_rows, varying_axes


@dataclasses.dataclass(frozen=True)
class Wire:
    """The static side of one `all_to_all_experts` exchange over ``axis_name``: ``n`` peers,
    ``cap`` receive rows per peer, ``num_tokens`` tokens on each device, the ``transport``."""
    axis_name: Any
    n: int
    cap: int
    num_tokens: int
    transport: str = "auto"


class Route(NamedTuple):
    """The traced side: `send_plan`'s arrays (``order``, ``pos``, ``dest``, ``kept``, ``sent``,
    ``offsets``), this device's index ``me`` on the axis, the rows each peer sends it
    (``recv_sizes [EP]``) and where its own rows sit on each peer (``their_offsets [EP]``)."""
    order: jax.Array
    pos: jax.Array
    dest: jax.Array
    kept: jax.Array
    sent: jax.Array
    offsets: jax.Array
    me: jax.Array
    recv_sizes: jax.Array
    their_offsets: jax.Array


def _by_transport(wire: Wire, padded, ragged, rows):
    if wire.transport == "auto":
        return jax.lax.platform_dependent(rows, cpu=padded, default=ragged)
    return dict(padded=padded, ragged=ragged)[wire.transport](rows)


def dispatch_rows(wire: Wire, route: Route, x: jax.Array) -> jax.Array:
    """Each token copy's row of ``x [T, W]`` (any dtype) to its expert's device: the
    receiver's ``[EP * C, W]`` rows, peer-major (`arrival_layout`); differentiable."""
    n, cap, r = wire.n, wire.cap, route

    def ragged(x):
        xs = take_rows(x, r.order % wire.num_tokens, r.pos)  # copies in send order [M, W]
        at = jnp.full((n,), r.me * cap, jnp.int32)  # my rows on every peer
        into = mark_varying(jnp.zeros((n * cap, x.shape[-1]), x.dtype), varying_axes(xs))
        return jax.lax.ragged_all_to_all(xs, into, r.offsets, r.sent, at, r.recv_sizes,
                                         axis_name=wire.axis_name)

    def padded(x):
        slot = jnp.arange(cap)
        src = r.order[jnp.clip(r.offsets[:, None] + slot, 0, r.order.shape[0] - 1)]  # [EP, C]
        send = jnp.where((slot < r.sent[:, None])[..., None], x[src % wire.num_tokens], 0)
        return jax.lax.all_to_all(send, wire.axis_name, 0, 0, tiled=True).reshape(n * cap, -1)
    return _by_transport(wire, padded, ragged, x)


def return_rows(wire: Wire, route: Route, out: jax.Array) -> jax.Array:
    """The receiver's ``out [EP * C, W]`` back to the copies they came from: ``[M, W]`` in
    copy order (``j*T + t``); rows of copies that were not sent (``route.kept`` False) are
    undefined. Up to that mask and the sum over a token's copies, the transpose of
    `dispatch_rows`."""
    n, cap, r = wire.n, wire.cap, route
    copies = r.order.shape[0]

    def ragged(out):
        into = mark_varying(jnp.zeros((copies, out.shape[-1]), out.dtype), varying_axes(out))
        back = jax.lax.ragged_all_to_all(out, into, jnp.arange(n) * cap, r.recv_sizes,
                                         r.their_offsets, r.sent,
                                         axis_name=wire.axis_name)  # my send order
        return take_rows(back, r.pos, r.order)

    def padded(out):
        back = jax.lax.all_to_all(out.reshape(n, cap, -1), wire.axis_name, 0, 0, tiled=True)
        return back[r.dest, jnp.clip(r.pos - r.offsets[r.dest], 0, cap - 1)]
    return _by_transport(wire, padded, ragged, out)


def send_tiles(wire: Wire, route: Route, tiles: fp8.Tiles) -> fp8.Tiles:
    """`dispatch_rows` of FP8 `zoo.ops.fp8.Tiles`: each row crosses the wire as its float8
    bytes and float32 scales (`zoo.ops.fp8.pack_tiles`, one uint8 row); the receiver gets the
    same tiles. The gradient of ``tiles.values`` (straight-through: the dequantised rows')
    comes back by `return_rows` in the values' dtype, summed over each token's copies."""
    axes = varying_axes(tiles.values) | varying_axes(tiles.scale)
    values, scale = (mark_varying(v, axes) for v in tiles)
    return fp8.Tiles(*_send_tiles(wire, axes, route, values, scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _send_tiles(wire, axes, route, values, scale):
    recv = dispatch_rows(wire, route, fp8.pack_tiles(fp8.Tiles(values, scale)))
    return tuple(fp8.unpack_tiles(recv, values.shape[-1], values.dtype))


def _send_tiles_fwd(wire, axes, route, values, scale):
    return _send_tiles(wire, axes, route, values, scale), route


def _send_tiles_bwd(wire, axes, route, cotangents):
    got = return_rows(wire, route, cotangents[0])  # [M, D], copy order
    got = jnp.where(route.kept[:, None], got.astype(jnp.float32), 0)
    dx = got.reshape(-1, wire.num_tokens, got.shape[-1]).sum(0)
    return None, as_varying(dx.astype(cotangents[0].dtype), axes), None


_send_tiles.defvjp(_send_tiles_fwd, _send_tiles_bwd)


@dataclasses.dataclass(frozen=True)
class SendPlan:
    """Where each token copy goes in `all_to_all_experts` (M copies, EP peers):
    ``order [M]`` the copies in send order and ``pos [M]`` each copy's place in it;
    ``dest [M]`` its peer; ``kept [M]`` whether it fits the peer's buffer; ``sent [EP]`` and
    ``offsets [EP]`` each peer's block of the send order; ``per_expert [EP, E_local]`` the
    block's rows per expert of that peer."""
    order: jax.Array
    pos: jax.Array
    dest: jax.Array
    kept: jax.Array
    sent: jax.Array
    offsets: jax.Array
    per_expert: jax.Array


def send_plan(ids: jax.Array, num_local: int, n: int, cap: int) -> SendPlan:
    """The send order of `all_to_all_experts`: the copies that fit -- each peer's first `cap`
    in priority (copy) order -- by peer, then by its local expert, priority order within;
    the copies that do not fit last. One sort (by expert id), no scatter of rows.

    A copy's priority rank among all copies for its peer is its rank within its own expert's
    run plus, for each other expert of that peer, how many of that expert's copies come
    earlier: binary searches in the sorted (expert id, copy) keys."""
    copies = ids.shape[0]
    groups = n * num_local
    if groups * copies >= 2 ** 31:
        raise ValueError(f"all_to_all dispatch: {copies} token copies on a device times {groups} "
                         f"experts must stay below 2**31 (int32 sort keys); use fewer tokens "
                         f"per device (smaller batch or more expert/data shards)")
    by_id = jnp.argsort(ids, stable=True)  # by (peer, local expert), then priority
    ids_s = ids[by_id]
    id_counts = jnp.bincount(ids, length=groups).astype(jnp.int32)
    id_starts = jnp.cumsum(id_counts) - id_counts
    sorted_keys = ids_s * copies + by_id  # increasing
    # [E_l, M] (copies minor, so no relayout): each expert of the copy's peer
    peer_ids = jnp.arange(num_local)[:, None] + (ids_s // num_local)[None, :] * num_local
    earlier = (jnp.searchsorted(sorted_keys, peer_ids * copies + by_id[None, :])
               - id_starts[peer_ids])  # copies of each expert of the peer before this one
    fits = earlier.sum(0) < cap
    kept_per_id = jnp.bincount(jnp.where(fits, ids_s, groups), length=groups + 1)[:groups]
    kept_starts = jnp.cumsum(kept_per_id) - kept_per_id  # peer-major, so peers' blocks too
    s = jnp.arange(copies)
    run = s - id_starts[ids_s]  # place in its expert's run (kept copies: the run's prefix)
    total = kept_per_id.sum()
    send_pos = jnp.where(fits, kept_starts[ids_s] + run,
                         total + s - kept_starts[ids_s] - kept_per_id[ids_s])
    order = jnp.zeros_like(by_id).at[send_pos].set(by_id, unique_indices=True)
    pos = inverse_permutation(order)
    per_expert = kept_per_id.reshape(n, num_local).astype(jnp.int32)
    sent = per_expert.sum(1)
    return SendPlan(order=order, pos=pos, dest=ids // num_local, kept=pos < total, sent=sent,
                     offsets=jnp.cumsum(sent) - sent, per_expert=per_expert)


def arrival_layout(recv_counts: jax.Array, cap: int):
    """The receiver's side of `send_plan`, from the counts alone: rows arrive in ``[EP, C]``
    slots, peer p's first ``sum(recv_counts[p])`` rows grouped by expert. Returns
    ``(arrival, order, valid, group_sizes)``: ``arrival [EP*C]`` each slot's place once
    sorted by expert (peer order within an expert; empty slots last, in slot order),
    ``order`` its inverse, ``valid [EP*C]`` the slots that hold a row and ``group_sizes
    [E_local]``."""
    n, num_local = recv_counts.shape
    rows = n * cap
    sizes = recv_counts.sum(1)  # [EP]
    group_sizes = recv_counts.sum(0).astype(jnp.int32)  # [E_l]
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    before_peer = jnp.cumsum(recv_counts, 0) - recv_counts  # [EP, E_l]: earlier peers' rows
    within_ends = jnp.cumsum(recv_counts, 1)  # [EP, E_l]: ends of the experts' runs in a block
    total = sizes.sum()
    empty_before = jnp.arange(n) * cap - (jnp.cumsum(sizes) - sizes)  # [EP]
    r = jnp.arange(rows)
    p, i = r // cap, r % cap
    valid = i < sizes[p]
    e = jnp.minimum(jnp.sum(i[None, :] >= within_ends.T[:, p], 0), num_local - 1)  # [E_l, R]
    run = i - (within_ends[p, e] - recv_counts[p, e])
    arrival = jnp.where(valid, group_starts[e] + before_peer[p, e] + run,
                        total + empty_before[p] + i - sizes[p])
    return arrival, inverse_permutation(arrival), valid, group_sizes

