"""Exact all-to-all expert dispatch in bounded buffers: overflow travels in further rounds.

`zoo.ops.moe.all_to_all_experts` reserves ``capacity`` receive rows per peer and drops the
copies beyond them. `all_to_all_rounds` keeps those buffers and drops nothing: round ``r``
sends, for every destination, the copies ranked ``[r*C, (r+1)*C)`` among those bound for it
(first choices first, then token order), the receiver runs the grouped SwiGLU on them and
sends the rows back. The number of rounds is decided on device: the largest
``ceil(count / C)`` over every (sender, destination) pair of the expert axis (one ``pmax``),
so a balanced router needs one round and every token sent to one expert needs
``ceil(T * k_on_that_device / C)``. The loop is a `jax.lax.while_loop`.

A while loop with a data-dependent trip count has no reverse-mode derivative, so the exchange
has its own VJP (`jax.custom_vjp`): the backward runs the same rounds, re-sending the round's
inputs with the output's cotangent rows (recompute instead of storing every round's buffers),
differentiates the grouped SwiGLU on them, accumulates the expert weights' gradients and sends
the input rows' gradients back. Memory is that of one round (the ``capacity`` buffers) plus
``[M, D]`` accumulators of the per-copy outputs (forward) or input gradients (backward), and
the expert-weight gradient accumulators; time grows with the rounds.

With ``fp8_dispatch`` the rows cross the wire as FP8 tiles with their scales
(`zoo.ops.fp8.pack_tiles`), in the backward's re-sends too, beside the cotangent rows in the
compute dtype; the receiver's FP8 grouped matmul takes the tiles as they are.

Legend as in `zoo.ops.moe`: T tokens, k copies per token, M = T*k copies, D embed, C rows per
peer per round, EP (``n``) expert shards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from zoo.ops import fp8
from zoo.ops.grouped import grouped_swiglu
from zoo.ops.moe import combine_copies
from zoo.ops.rows import mark_varying, varying_axes

__all__ = ["all_to_all_rounds"]


def all_to_all_rounds(x: jax.Array, indices: jax.Array, weights: jax.Array,
                      wi_gate: jax.Array, wi_up: jax.Array, wo: jax.Array, *, axis_name,
                      num_shards: int, capacity: int, impl: str = "auto",
                      transport: str = "auto", device=None, fp8_dispatch: bool = False
                      ) -> tuple[jax.Array, jax.Array]:
    """Exact expert-parallel dispatch by all-to-all in rounds of ``capacity`` rows per peer,
    inside `jax.shard_map` over `axis_name` (arguments as `zoo.ops.moe.all_to_all_experts`;
    ``device``, static, reaches the backward's kernels too). With ``impl="fp8_blockwise"`` the
    weights may be their FP8 copies (`zoo.ops.fp8.QuantizedWeight`): every round, forward and
    backward, takes them as they are, and the gradients go to their ``w``.

    Returns ``(y [T, D] float32, rounds int32)``: ``rounds`` is the number of rounds this
    expert group ran (the same on each of its devices); nothing is dropped.
    """
    if fp8_dispatch and impl != "fp8_blockwise":
        raise ValueError(f"fp8_dispatch=True sends FP8 tiles that only the 'fp8_blockwise' "
                         f"grouped matmul takes, but impl={impl!r}; pass "
                         f"impl='fp8_blockwise' (MoE(fp8='blockwise')) or fp8_dispatch=False")
    x = x.astype(wi_gate.dtype)
    leaves = jax.tree.leaves((x, indices, weights, wi_gate, wi_up, wo))
    axes = frozenset().union(*(varying_axes(v) for v in leaves))
    x, wi_gate, wi_up, wo = jax.tree.map(lambda v: mark_varying(v, axes), (x, wi_gate, wi_up, wo))
    indices = mark_varying(indices, axes)
    cfg = _Cfg(axis_name, num_shards, capacity, impl, transport, device, bool(fp8_dispatch))
    got, rounds = _exchange(cfg, x, wi_gate, wi_up, wo, indices)
    num_tokens, k = indices.shape
    return combine_copies(got.reshape(k, num_tokens, -1), weights), rounds


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """The static settings of one exchange (hashable for `jax.custom_vjp`'s nondiff args)."""
    axis_name: Any
    n: int
    cap: int
    impl: str
    transport: str
    device: Any = None  # the kernels' target device (`zoo.ops.grouped.tokamax_dot`)
    fp8: bool = False  # rows on the wire as FP8 tiles (`zoo.ops.fp8.pack_tiles`)


class _Plan:
    """Where every copy goes: destination, local expert, rank among the copies for that
    destination, the copies sorted by destination, and the rounds the group needs."""

    def __init__(self, cfg: _Cfg, indices: jax.Array, num_local: int):
        num_tokens, k = indices.shape
        self.num_tokens, self.copies = num_tokens, num_tokens * k
        ids = indices.T.reshape(-1)  # copy j*T + t: first choices first
        self.dest = ids // num_local
        self.e_local = ids - self.dest * num_local
        self.order = jnp.argsort(self.dest, stable=True)
        self.counts = jnp.bincount(self.dest, length=cfg.n).astype(jnp.int32)
        self.starts = jnp.cumsum(self.counts) - self.counts
        self.pos = jnp.zeros_like(self.order).at[self.order].set(
            jnp.arange(self.copies, dtype=self.order.dtype))
        self.rank = self.pos - self.starts[self.dest]
        need = jnp.max((self.counts + cfg.cap - 1) // cfg.cap)
        self.rounds = jax.lax.pmax(need, cfg.axis_name).astype(jnp.int32)
        self.me = jax.lax.axis_index(cfg.axis_name)
        self.their_starts = jax.lax.all_to_all(self.starts, cfg.axis_name, 0, 0, tiled=True)


def _round(cfg: _Cfg, plan: _Plan, r):
    """Round r's per-destination sizes and slots: (sent [n], received [n], slot copies [n, C],
    filled [n, C], in-round mask of the copies [M])."""
    cap = cfg.cap
    sent = jnp.clip(plan.counts - r * cap, 0, cap)
    recv = jax.lax.all_to_all(sent, cfg.axis_name, 0, 0, tiled=True)
    slot = jnp.arange(cap)
    src = plan.order[jnp.clip(plan.starts[:, None] + r * cap + slot, 0, plan.copies - 1)]
    filled = slot < sent[:, None]
    here = (plan.rank >= r * cap) & (plan.rank < (r + 1) * cap)
    return sent, recv, src, filled, here


def _go(cfg: _Cfg, plan: _Plan, r, rows, tags):
    """Send round r's copies: ``rows [M, D]`` and ``tags [M]`` (copy order) -> the receiver's
    ``[n*C, D]`` rows and ``[n*C]`` tags (empty slots tagged -1), peer-major."""
    sent, recv, src, filled, _ = _round(cfg, plan, r)
    n, cap, name = cfg.n, cfg.cap, cfg.axis_name

    def padded(rows, tags):
        send_x = jnp.where(filled[..., None], rows[src], 0)
        send_t = jnp.where(filled, tags[src], -1)
        out = [jax.lax.all_to_all(v, name, 0, 0, tiled=True) for v in (send_x, send_t)]
        return out[0].reshape(n * cap, -1), out[1].reshape(-1)

    def ragged(rows, tags):
        xs, ts = rows[plan.order], tags[plan.order]
        at = jnp.full((n,), plan.me * cap, jnp.int32)
        offsets = plan.starts + r * cap
        vary = lambda v, like: mark_varying(v, varying_axes(like))
        rx = jax.lax.ragged_all_to_all(xs, vary(jnp.zeros((n * cap, xs.shape[-1]), xs.dtype), xs),
                                       offsets, sent, at, recv, axis_name=name)
        rt = jax.lax.ragged_all_to_all(ts, vary(jnp.full((n * cap,), -1, ts.dtype), ts),
                                       offsets, sent, at, recv, axis_name=name)
        return rx, rt
    return _transport(cfg, padded, ragged, rows, tags)


def _back(cfg: _Cfg, plan: _Plan, r, out, acc):
    """Return round r's result rows ``out [n*C, D]`` to their senders, into ``acc [M, D]``
    (copy order; the round's copies replaced)."""
    sent, recv, _, _, here = _round(cfg, plan, r)
    n, cap, name = cfg.n, cfg.cap, cfg.axis_name

    def padded(out):
        back = jax.lax.all_to_all(out.reshape(n, cap, -1), name, 0, 0, tiled=True)
        return back[plan.dest, jnp.clip(plan.rank - r * cap, 0, cap - 1)]

    def ragged(out):
        dst = mark_varying(jnp.zeros((plan.copies, out.shape[-1]), out.dtype), varying_axes(out))
        back = jax.lax.ragged_all_to_all(out, dst, jnp.arange(n) * cap, recv,
                                         plan.their_starts + r * cap, sent, axis_name=name)
        return back[plan.pos]
    got = _transport(cfg, padded, ragged, out)
    return jnp.where(here[:, None], got.astype(acc.dtype), acc)


def _transport(cfg: _Cfg, padded, ragged, *args):
    if cfg.transport == "padded":
        return padded(*args)
    if cfg.transport == "ragged":
        return ragged(*args)
    return jax.lax.platform_dependent(*args, cpu=padded, default=ragged)


def _expert_rows(cfg: _Cfg, recv_x, recv_e, wg, wu, wo, copies: int):
    """The grouped SwiGLU of one round's received rows (empty slots give zeros)."""
    num_local = wg.shape[0]
    keys = jnp.where(recv_e < 0, num_local, recv_e)
    order = jnp.argsort(keys, stable=True)
    sizes = jnp.bincount(keys, length=num_local + 1)[:num_local].astype(jnp.int32)
    out = grouped_swiglu(recv_x, wg, wu, wo, sizes, cfg.impl, expected_rows=copies, order=order,
                         device=cfg.device)
    return jnp.where((keys < num_local)[:, None], out, 0)


def _source_rows(cfg: _Cfg, plan: _Plan, x):
    """Each copy's row of ``x [T, D]`` as the wire carries it: ``[M, D]``, or FP8 tiles packed
    into ``[M, D + 4 * ceil(D/128)]`` bytes (each token quantised once)."""
    if cfg.fp8:
        x = fp8.pack_tiles(fp8.quantize_tiles(x))
    return x[jnp.arange(plan.copies) % plan.num_tokens]


def _arrived(cfg: _Cfg, recv, width: int, dtype):
    """Received rows as the experts take them: the rows, or `zoo.ops.fp8.Tiles`."""
    return fp8.unpack_tiles(recv, width, dtype) if cfg.fp8 else recv


def _forward(cfg: _Cfg, x, wg, wu, wo, indices):
    plan = _Plan(cfg, indices, wg.shape[0])
    rows = _source_rows(cfg, plan, x)

    def body(carry):
        r, acc = carry
        recv_x, recv_e = _go(cfg, plan, r, rows, plan.e_local)
        recv_x = _arrived(cfg, recv_x, x.shape[-1], x.dtype)
        out = _expert_rows(cfg, recv_x, recv_e, wg, wu, wo, plan.copies)
        return r + 1, _back(cfg, plan, r, out, acc)

    acc = mark_varying(jnp.zeros((plan.copies, x.shape[-1]), x.dtype), varying_axes(x))
    zero = mark_varying(jnp.zeros((), jnp.int32), varying_axes(plan.rounds))
    _, acc = jax.lax.while_loop(lambda c: c[0] < plan.rounds, body, (zero, acc))
    return acc, plan.rounds


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _exchange(cfg: _Cfg, x, wg, wu, wo, indices):
    return _forward(cfg, x, wg, wu, wo, indices)


def _exchange_fwd(cfg, x, wg, wu, wo, indices):
    got, rounds = _forward(cfg, x, wg, wu, wo, indices)
    return (got, rounds), (x, wg, wu, wo, indices)


def _exchange_bwd(cfg, res, cotangents):
    # the grouped matmuls' kernels are traced for ``cfg.device`` again (a static value: the
    # backward is traced after the forward's scope has closed)
    x, wg, wu, wo, indices = res
    d_got = cotangents[0].astype(x.dtype)
    plan = _Plan(cfg, indices, wg.shape[0])
    rows = _source_rows(cfg, plan, x)
    # the cotangent rows travel beside their copies' rows (as bytes beside FP8 tiles)
    width, sent_width = x.shape[-1], rows.shape[-1]
    d_rows = (jax.lax.bitcast_convert_type(d_got, jnp.uint8).reshape(plan.copies, -1)
              if cfg.fp8 else d_got)
    both = jnp.concatenate([rows, d_rows], axis=-1)

    def body(carry):
        r, dx_acc, dwg, dwu, dwo = carry
        recv, recv_e = _go(cfg, plan, r, both, plan.e_local)
        recv_x = _arrived(cfg, recv[:, :sent_width], width, x.dtype)
        recv_d = recv[:, sent_width:]
        if cfg.fp8:
            recv_d = jax.lax.bitcast_convert_type(
                recv_d.reshape(recv_d.shape[0], width, -1), x.dtype)
        scale = recv_x.scale if cfg.fp8 else None
        as_rows = (lambda a: fp8.Tiles(a, scale)) if cfg.fp8 else (lambda a: a)
        # differentiated with respect to the weights themselves (an FP8 copy's ``w``)
        _, vjp = jax.vjp(lambda a, g, u, o: _expert_rows(
            cfg, as_rows(a), recv_e, _with_weight(wg, g), _with_weight(wu, u),
            _with_weight(wo, o), plan.copies),
            recv_x.values if cfg.fp8 else recv_x, *map(_weight, (wg, wu, wo)))
        d_rx, d_g, d_u, d_o = vjp(recv_d)
        dx_acc = _back(cfg, plan, r, d_rx, dx_acc)
        return r + 1, dx_acc, dwg + d_g.astype(dwg.dtype), dwu + d_u.astype(dwu.dtype), \
            dwo + d_o.astype(dwo.dtype)

    def zeros(v, dtype=None):
        return mark_varying(jnp.zeros(v.shape, dtype or v.dtype), varying_axes(v))
    zero = mark_varying(jnp.zeros((), jnp.int32), varying_axes(plan.rounds))
    dx0 = mark_varying(jnp.zeros((plan.copies, width), x.dtype), varying_axes(x))
    init = (zero, dx0, *(zeros(_weight(w), jnp.float32) for w in (wg, wu, wo)))
    _, dx_copies, dwg, dwu, dwo = jax.lax.while_loop(lambda c: c[0] < plan.rounds, body, init)
    k = plan.copies // plan.num_tokens
    dx = dx_copies.reshape(k, plan.num_tokens, width).sum(0)
    return (dx.astype(x.dtype), *(_weight_cotangent(w, d) for w, d in
                                  ((wg, dwg), (wu, dwu), (wo, dwo))), None)


def _weight(w):
    """The weight itself: ``w``, or an FP8 copy's ``w`` (what takes the gradient)."""
    return w.w if isinstance(w, fp8.QuantizedWeight) else w


def _with_weight(like, w):
    """`w` in the form of `like`: the FP8 copy with ``w`` as its weight, or ``w``."""
    return like._replace(w=w) if isinstance(like, fp8.QuantizedWeight) else w


def _weight_cotangent(like, d):
    """The cotangent of `like` from ``d``, the float32 gradient of its weight: an FP8
    copy's float8 values, scales and counts take none."""
    if not isinstance(like, fp8.QuantizedWeight):
        return d.astype(like.dtype)
    return fp8.QuantizedWeight(d.astype(like.dtype), *(
        mark_varying(jnp.zeros(a.shape, a.dtype), varying_axes(a)) for a in like[1:]))


_exchange.defvjp(_exchange_fwd, _exchange_bwd)
