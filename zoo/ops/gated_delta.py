"""The gated delta rule (gated DeltaNet's linear attention) over packed documents, with context
parallelism, and the short causal convolution in front of it.

The recurrence, per value head, with state ``S`` [Dk, Dv] (Hugging Face's
``torch_recurrent_gated_delta_rule``)::

    S <- exp(g_t) S                                  decay (g_t <= 0, log space)
    S <- S + beta_t k_t (v_t - S^T k_t)^T             delta rule write
    o_t = S^T q_t

with ``q``/``k`` L2-normalised (eps 1e-6, as ``l2norm``) and ``q`` scaled by ``1/sqrt(Dk)``
inside the op. `gates` turns the layer's projections into ``g = -exp(A_log) * softplus(a +
dt_bias)`` and ``beta = sigmoid(b)``; `causal_conv1d` is the depthwise convolution (kernel 4,
SiLU) that produces q/k/v. Both follow transformers' ``qwen3_next`` modeling.

Shapes: q, k [B, L, Hk, Dk]; v [B, L, Hv, Dv]; g, beta [B, L, Hv] (g in float32); output
[B, L, Hv, Dv] in v's dtype. ``Hv`` is a multiple of ``Hk``: q/k head ``h`` serves value heads
``h*r .. h*r+r-1`` (``r = Hv // Hk``, transformers' ``repeat_interleave``). All math is float32.

Documents: ``segment_ids`` (0 = padding, documents 1..n numbered in packing order) and
``positions`` say where each token belongs, so rows may come in any order `zoo.data.load_balance`
produces. The state resets at every document start; padding contributes nothing and its
output is 0. Token ``t`` continues the state of the token ``(segment, position - 1)``.

Implementations:

* ``"recurrent"`` -- token by token (`jax.lax.scan`): the reference. Sorts rows into packing
  order (`zoo.data.restore_order`'s key) and back.
* ``"chunked"`` -- the chunk-parallel WY/UT form (chunks of ``C = 64``) with its own
  `jax.custom_vjp`, in `zoo.ops.gated_delta_chunked` (its docstring: memory, documents starting
  inside a chunk, the UT solve `solve_unit_lower`).

Generation: ``gated_delta_rule(..., return_state=True)`` also gives the state after each row's
last token (prefill), `conv_tail` the convolution's last inputs, and `recurrent_step` continues
a state by T tokens (decode), through the same recurrence as ``"recurrent"``.

Context parallelism (``partitioner`` whose attention scope shards ``length``): the rule and the
convolution run over the context shards by `zoo.ops.gated_delta_cp` (its docstring says how
pieces of documents exchange states; ``max_pieces`` slots per shard and row).

Legend: B batch, L length, H value heads, Hk key heads, K Dk, V Dv.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zoo.ops.gated_delta_chunked import CHUNK, chunked, solve_unit_lower, unit_lower_inverse
from zoo.ops.gated_delta_cp import (conv_shard, conv_sharded, pick_rows, piece_starts,
                                    sharded, take_at, take_rows)
from zoo.partitioning import Partitioner

# CHUNK, pick_rows, solve_unit_lower and unit_lower_inverse are their owners' (re-exported)
__all__ = ["CHUNK", "IMPLEMENTATIONS", "causal_conv1d", "conv_tail", "gated_delta_rule", "gates",
           "l2norm", "pick_rows", "recurrent_step", "solve_unit_lower", "unit_lower_inverse"]

IMPLEMENTATIONS = ("chunked", "recurrent")
EPS = 1e-6


def l2norm(x: jax.Array, eps: float = EPS) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (transformers' ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gates(a: jax.Array, b: jax.Array, A_log: jax.Array, dt_bias: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
    """``(g, beta)`` from the layer's projections ``a``, ``b`` [..., H]: ``g = -exp(A_log) *
    softplus(a + dt_bias)`` in float32, ``beta = sigmoid(b)``."""
    a = a.astype(jnp.float32)
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b)


# -- checks -----------------------------------------------------------------------------------

def _check(q, k, v, g, beta, segment_ids, positions, implementation, max_pieces):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must both be [B, L, Hk, Dk]")
    B, L, Hk, _ = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, L):
        raise ValueError(f"v {v.shape} must be [B, L, Hv, Dv] with B, L = {(B, L)} as q")
    H = v.shape[2]
    if H % Hk:
        raise ValueError(f"value heads Hv={H} must be a multiple of key heads Hk={Hk} (each "
                         "q/k head serves Hv // Hk value heads)")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, L, H):
            raise ValueError(f"{name} {x.shape} must be [B, L, Hv] = {(B, L, H)}")
    if g.dtype != jnp.float32:
        raise ValueError(f"g has dtype {g.dtype}; the log decay must be float32 (compute it "
                         "with zoo.ops.gated_delta.gates, or cast)")
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} has dtype {x.dtype}; it must be floating point")
    _check_tokens(segment_ids, positions, (B, L))
    if isinstance(max_pieces, bool) or not isinstance(max_pieces, int) or max_pieces < 1:
        raise ValueError(f"max_pieces={max_pieces!r} must be a positive int (state slots per "
                         "shard and row)")


def _check_tokens(segment_ids, positions, shape):
    for name, x in (("segment_ids", segment_ids), ("positions", positions)):
        if x is None or tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} {None if x is None else x.shape} must be [B, L] = "
                             f"{tuple(shape)} (0 = padding segment)")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} has dtype {x.dtype}; it must be an integer array")


# -- packing order ---------------------------------------------------------------------------

def _packing_order(seg, pos):
    """[B, L] permutation into packing order (padding last, segment, position)."""
    return jax.vmap(lambda s, p: jnp.lexsort((p, s, s == 0)))(seg, pos)


def _inverse(perm):
    return jax.vmap(lambda p: jnp.zeros_like(p).at[p].set(jnp.arange(p.shape[0])))(perm)


# -- the recurrent reference ------------------------------------------------------------------

def _update(S, qt, kt, vt, gt, bt):
    """One token of the recurrence (module docstring): state S [B, H, K, V], prepared q/k
    [B, H, K], v [B, H, V], g/beta [B, H] -> (new state, output [B, H, V])."""
    S = S * jnp.exp(gt)[..., None, None]
    u = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", S, kt))
    S = S + kt[..., :, None] * u[..., None, :]
    return S, jnp.einsum("bhkv,bhk->bhv", S, qt)


def _recurrent(q, k, v, g, beta, reset, state=None):
    """Token-by-token scan. q, k [B, H, T, K]; v [B, H, T, V]; g, beta, reset [B, H, T];
    ``state`` [B, H, K, V] the incoming state (None: zeros). Returns (o [B, H, T, V], the
    state after the last token)."""
    B, H, _, K = q.shape
    V = v.shape[-1]

    def step(S, x):
        qt, kt, vt, gt, bt, rt = x
        return _update(jnp.where(rt[..., None, None], 0.0, S), qt, kt, vt, gt, bt)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta, reset))
    S0 = jnp.zeros((B, H, K, V), jnp.float32) if state is None else state.astype(jnp.float32)
    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 2), S


def recurrent_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                   beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """T tokens of one document continuing ``state`` (generation's decode step): the
    recurrent form of `gated_delta_rule` from a given incoming state.

    Args:
      state: [B, Hv, Dk, Dv] the state after the tokens before these (float32).
      q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g (float32), beta: [B, T, Hv] -- as
        `gated_delta_rule` takes them (L2-normalised and scaled inside).

    Returns:
      (o [B, T, Hv, Dv] in v's dtype, the state after the T tokens [B, Hv, Dk, Dv] float32).
    """
    B, T = q.shape[:2]
    tokens = jnp.ones((B, T), jnp.int32)
    _check(q, k, v, g, beta, tokens, tokens, "recurrent", 1)
    H, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    if state.shape != (B, H, K, V):
        raise ValueError(f"state {state.shape} must be [B, Hv, Dk, Dv] = {(B, H, K, V)}")
    xs = _prepare(q, k, v, g, beta, tokens)
    o, S = _recurrent(*xs, jnp.zeros(xs[3].shape, bool), state)
    return _finish(o, tokens, v.dtype), S


# -- preparing inputs -------------------------------------------------------------------------

def _prepare(q, k, v, g, beta, segment_ids):
    """Normalised, scaled, head-repeated float32 inputs in [B, H, L, .] layout; padding tokens
    made identity (beta = 0, g = 0)."""
    H, Hk = v.shape[2], q.shape[2]
    f32 = jnp.float32
    q = l2norm(q.astype(f32)) * (q.shape[-1] ** -0.5)
    k = l2norm(k.astype(f32))
    if H != Hk:
        q, k = (jnp.repeat(x, H // Hk, axis=2) for x in (q, k))
    real = (segment_ids != 0)[..., None]
    g = jnp.where(real, g.astype(f32), 0.0)
    beta = jnp.where(real, beta.astype(f32), 0.0)
    heads_first = functools.partial(jnp.moveaxis, source=2, destination=1)
    return (heads_first(q), heads_first(k), heads_first(v.astype(f32)), heads_first(g),
            heads_first(beta))


def _finish(o, segment_ids, dtype):
    """[B, H, L, V] -> [B, L, H, V], 0 on padding."""
    o = jnp.moveaxis(o, 1, 2)
    return jnp.where((segment_ids != 0)[..., None, None], o, 0.0).astype(dtype)


def _unsharded(q, k, v, g, beta, seg, pos, implementation):
    """Any row order: sort into packing order, run, sort back. Returns (o, the state after
    each row's last real token in packing order [B, H, K, V]).

    Padding sorts last and does not reset the state (it is identity: beta = 0, g = 0), so the
    state after the row's last token is that of its last document."""
    order = _packing_order(seg, pos)
    seg_s, pos_s = take_rows(seg, order), take_rows(pos, order)
    xs = [jnp.moveaxis(take_rows(jnp.moveaxis(x, 1, 2), order), 2, 1)
          for x in (q, k, v, g, beta)]
    starts = piece_starts(seg_s, pos_s) & (seg_s != 0)
    reset = jnp.broadcast_to(starts[:, None], xs[3].shape).astype(jnp.float32)
    if implementation == "recurrent":
        o, state = _recurrent(*xs, reset > 0)
    else:
        o, state = chunked(*xs, reset)
        state = state[:, 0]
    return jnp.moveaxis(take_rows(jnp.moveaxis(o, 1, 2), _inverse(order)), 2, 1), state


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     *, segment_ids: jax.Array, positions: jax.Array,
                     partitioner: Partitioner | None = None, implementation: str = "chunked",
                     max_pieces: int = 4, return_state: bool = False):
    """The gated delta rule over packed rows in any load-balanced order (module docstring).

    Args:
      q, k: [B, L, Hk, Dk] (L2-normalised and scaled inside).
      v: [B, L, Hv, Dv], Hv a multiple of Hk.
      g: [B, L, Hv] float32 log decay (<= 0); beta: [B, L, Hv] write strength.
      segment_ids, positions: [B, L] ints (0 = padding segment).
      partitioner: shards the batch and, when its attention scope shards ``length``, the
        sequence (context parallelism; rows reordered by `zoo.data.load_balance`).
      implementation: ``"chunked"`` (training) or ``"recurrent"`` (the reference).
      max_pieces: state slots per shard and row under context parallelism (module docstring).
      return_state: also return the state after each row's last token in packing order (its
        last document's; zeros for a row of padding), [B, Hv, Dk, Dv] float32 -- what
        generation's prefill leaves for `recurrent_step`. Under context parallelism it comes
        from an unsharded chunked pass (the sequence gathered), not from the shards' summaries.

    Returns:
      [B, L, Hv, Dv] in v's dtype, 0 at padding; with `return_state`, (that, the state).
    """
    _check(q, k, v, g, beta, segment_ids, positions, implementation, max_pieces)
    seg, pos = segment_ids.astype(jnp.int32), positions.astype(jnp.int32)
    xs = _prepare(q, k, v, g, beta, seg)
    cp = 1 if partitioner is None or partitioner.mesh is None else \
        partitioner.context_size("attention")
    with jax.named_scope(f"gated_delta_{implementation}"):
        if cp == 1 or implementation == "recurrent":
            o, state = _unsharded(*xs, seg, pos, implementation)
        else:
            o = sharded(partitioner, xs, seg, pos, max_pieces)
            state = _unsharded(*xs, seg, pos, "chunked")[1] if return_state else None
    o = _finish(o, seg, v.dtype)
    return (o, state) if return_state else o


# -- the short causal convolution -------------------------------------------------------------

def causal_conv1d(x: jax.Array, weight: jax.Array, *, segment_ids: jax.Array,
                  positions: jax.Array, partitioner: Partitioner | None = None,
                  activation: str | None = "silu", max_pieces: int = 4) -> jax.Array:
    """Depthwise causal convolution over packed documents, in any load-balanced row order.

    ``out[t] = act(sum_j weight[:, W-1-j] * x[token (segment, position - j)])`` over the
    ``W`` taps, a missing token (before the document start, or padding) counting 0: each
    document is convolved on its own, as transformers' ``causal_conv1d_fn`` convolves a
    sequence. x [B, L, D]; weight [D, W] (Hugging Face's ``conv1d.weight[:, 0]``);
    ``activation`` ``"silu"`` or None. Under context parallelism (as `gated_delta_rule`)
    the ``W - 1`` tokens before each piece that starts mid-document are fetched from the shards
    that hold them (requests and answers of ``max_pieces * (W - 1)`` tokens per shard and row).
    Output in x's dtype, 0 at padding.
    """
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"x {x.shape} must be [B, L, D] and weight {weight.shape} [D, W] with "
                         "D the channels")
    if activation not in ("silu", None):
        raise ValueError(f"activation={activation!r} must be 'silu' or None")
    _check_tokens(segment_ids, positions, x.shape[:2])
    if isinstance(max_pieces, bool) or not isinstance(max_pieces, int) or max_pieces < 1:
        raise ValueError(f"max_pieces={max_pieces!r} must be a positive int")
    seg, pos = segment_ids.astype(jnp.int32), positions.astype(jnp.int32)
    cp = 1 if partitioner is None or partitioner.mesh is None else \
        partitioner.context_size("attention")
    if cp == 1:
        order = _packing_order(seg, pos)
        out = conv_shard(take_rows(x, order), weight, take_rows(seg, order),
                         take_rows(pos, order), axes=(), max_pieces=max_pieces)
        out = take_rows(out, _inverse(order))
    else:
        out = conv_sharded(partitioner, x, weight, seg, pos, max_pieces)
    if activation == "silu":
        out = jax.nn.silu(out)
    return jnp.where((seg != 0)[..., None], out, 0).astype(x.dtype)


def conv_tail(x: jax.Array, width: int, *, segment_ids: jax.Array,
              positions: jax.Array) -> jax.Array:
    """The last `width` inputs ``x`` [B, L, D] of each row's last document in packing order
    (rows in any order, padding anywhere), oldest first: [B, width, D], 0 where the document
    has fewer tokens -- the window `causal_conv1d` convolves a next token of that document
    with (generation's convolution cache)."""
    if x.ndim != 3:
        raise ValueError(f"x {x.shape} must be [B, L, D]")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width={width!r} must be an int >= 0 (the kernel size - 1)")
    _check_tokens(segment_ids, positions, x.shape[:2])
    seg, pos = segment_ids.astype(jnp.int32), positions.astype(jnp.int32)
    order = _packing_order(seg, pos)
    x_s, seg_s = take_rows(x, order), take_rows(seg, order)
    n = jnp.sum(seg != 0, axis=1, keepdims=True)  # real tokens, first in packing order
    idx = n - width + jnp.arange(width)  # [B, width]
    last = take_at(seg_s, n - 1, 0)  # [B, 1]: the last document (0: no token)
    keep = (idx >= 0) & (take_at(seg_s, jnp.maximum(idx, 0), -1) == last) & (last != 0)
    tail = take_rows(x_s, jnp.clip(idx, 0, x.shape[1] - 1))
    return jnp.where(keep[..., None], tail, 0).astype(x.dtype)
