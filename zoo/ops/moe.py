"""Pure mixture-of-experts functions: routing, balance statistics and the dispatch schemes.

No parameters and no mesh here; `zoo.layers.moe.MoE` wires them into a layer and runs the
dispatch inside `jax.shard_map` (`all_to_all_experts` names the mesh axis it exchanges over).
Beside this module: the experts' grouped products (`zoo.ops.grouped`: `grouped_swiglu`,
`GLU`, `blocked_matmul`, `tokamax_dot`), the all_to_all scheme's wire (`zoo.ops.moe_wire`:
`dispatch_rows`, `return_rows`, `send_tiles`, the send plan), row movement and
`jax.shard_map` typing (`zoo.ops.rows`: `take_rows`, `mark_varying`), the exact dispatch in
rounds (`zoo.ops.moe_rounds`) and how a layer runs (`zoo.ops.moe_execution`). `GLU`,
`SWIGLU`, `grouped_swiglu`, `tokamax_dot`, `take_rows`, `mark_varying` and `varying_axes`
stay importable from here.

* `route` -- router logits -> top-k expert indices and combine weights, in float32, with the
  semantics of Hugging Face's ``MixtralTopKRouter`` (``scoring="softmax"``) and
  ``DeepseekV3TopkRouter`` (``scoring="sigmoid"``: selection bias, group-limited top-k,
  ``norm_topk_prob``, ``routed_scaling_factor``) and DeepSeek-V4's ``DeepseekV4TopKRouter``
  (``scoring="sqrtsoftplus"``: ``sqrt(softplus(logits))`` with a selection bias) and
  ``DeepseekV4HashRouter`` (``indices=``: a fixed token-id -> experts table chose them).
* `expert_counts`, `load_balance_loss` -- balance statistics over the tokens given;
  `expert_capacity` -- slots per expert for a capacity factor.
* `dropless_experts` -- the all_gather scheme's work on one device: every token copy it sees,
  sorted by local expert (copies for other shards' experts sort last and cost nothing).
* `all_to_all_experts` -- the all_to_all scheme: each token copy travels only to the device
  holding its expert (`jax.lax.ragged_all_to_all` on GPU/TPU, a padded `jax.lax.all_to_all`
  on CPU, chosen at lowering), into ``capacity`` rows per peer
  (`zoo.ops.moe_execution.a2a_capacity`: dropless by default, or ``buffer_factor`` times the
  balanced share, overflow counted); results come back the same way. Sends, expert math and
  the k-way combine run in the compute dtype; with ``fp8_dispatch`` the sends carry FP8 tiles
  and their scales (`zoo.ops.moe_wire.send_tiles`; the receiver's FP8 grouped matmul takes
  them as they are), their gradients the compute dtype.
* `capacity_experts` -- fixed capacity per expert (``[E, C, D]`` buffers, batched matmul);
  copies beyond the capacity are dropped, first choices before second choices.
* `combine_copies` -- a token's k expert outputs weighted by the routing weights and summed.
* How a layer runs (the dispatch scheme, buffers, overflow, kernel and target device) is one
  value, `zoo.ops.moe_execution.MoEExecution`, with the sizes it rests on (`a2a_capacity`,
  `dispatch_bytes`) beside it there.
* The expert functions take the experts' gated activation as ``activation=`` (a
  `zoo.ops.grouped.GLU`; the default `SWIGLU` is ``silu(gate) * up``) and optional per-expert
  ``bias=(gate_bias, up_bias)`` ``[E_local, F]`` added before it (gpt-oss).

Legend: T tokens, M token copies (T*k), k experts per token, D embed, E experts (E_local on
this device), F mlp, C capacity per expert (or per peer), R receive rows, EP expert shards.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from zoo.ops import fp8
from zoo.ops.grouped import GLU, SWIGLU, grouped_swiglu, tokamax_dot
from zoo.ops.moe_wire import (Route, Wire, arrival_layout, dispatch_rows, return_rows,
                              send_plan, send_tiles)
from zoo.ops.rows import inverse_permutation, mark_varying, take_rows, varying_axes

__all__ = ["GLU", "SCORINGS", "SWIGLU", "all_to_all_experts", "capacity_experts",
           "combine_copies", "dropless_experts", "expert_capacity", "expert_counts",
           "grouped_swiglu", "load_balance_loss", "mark_varying", "route", "router_scores",
           "take_rows", "tokamax_dot", "varying_axes"]


SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


def router_scores(logits: jax.Array, scoring: str) -> jax.Array:
    """Float32 router scores: ``softmax`` over experts, ``sigmoid`` (DeepSeek-V3) or
    ``sqrtsoftplus`` = ``sqrt(softplus(logits))`` (DeepSeek-V4), elementwise."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r} is not one of {SCORINGS}")
    logits = logits.astype(jnp.float32)
    if scoring == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if scoring == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jax.nn.softplus(logits))


# -- routing ---------------------------------------------------------------------------------
def route(logits: jax.Array, *, k: int, scoring: str = "softmax", bias: jax.Array | None = None,
          n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          routed_scaling_factor: float = 1.0, indices: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing. Returns ``(weights [..., k] f32, indices [..., k] int32, scores [..., E])``.

    ``scores`` are the unbiased router scores (softmax probabilities or sigmoid scores), which
    the balance loss uses. Selection ranks ``scores + bias`` (bias: DeepSeek-V3's
    ``e_score_correction_bias``, selection only); with ``n_group > 1`` only the ``topk_group``
    groups with the largest sum of their top-2 biased scores are eligible. Weights are the
    unbiased scores of the selected experts, divided by their sum when ``norm_topk_prob``
    (+1e-20 for sigmoid, as DeepSeek-V3 does), times ``routed_scaling_factor``. With softmax and
    ``norm_topk_prob`` this is Mixtral's "softmax over all, top-k, renormalise", which equals a
    softmax over the k selected logits. ``sqrtsoftplus`` (DeepSeek-V4) is handled as
    ``sigmoid`` with its own scores. ``indices [..., k]`` given (hash routing: DeepSeek-V4's
    ``tid2eid[token]``) skip the selection: the weights are those experts' scores,
    normalised and scaled the same way (``bias``, groups ignored).
    """
    scores = router_scores(logits, scoring)
    num_experts = logits.shape[-1]
    if indices is not None:
        if indices.shape != (*scores.shape[:-1], k):
            raise ValueError(f"route: indices of shape {indices.shape} must be the scores' "
                             f"leading shape plus k={k}: {(*scores.shape[:-1], k)}")
        indices = indices.astype(jnp.int32)
        weights = _combine_weights(scores, indices, scoring=scoring,
                                   norm_topk_prob=norm_topk_prob,
                                   routed_scaling_factor=routed_scaling_factor)
        return weights, indices, scores
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    choice = jax.lax.stop_gradient(choice)  # selection is discrete; weights carry the gradient
    if n_group > 1:
        per_group = num_experts // n_group
        grouped = choice.reshape(*choice.shape[:-1], n_group, per_group)
        group_score = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)  # [..., n_group]
        _, best = jax.lax.top_k(group_score, topk_group)
        keep = jnp.sum(jax.nn.one_hot(best, n_group, dtype=jnp.int32), axis=-2) > 0
        keep = jnp.repeat(keep, per_group, axis=-1)  # [..., E]
        choice = jnp.where(keep, choice, -jnp.inf)
    _, indices = jax.lax.top_k(choice, k)
    weights = _combine_weights(scores, indices, scoring=scoring, norm_topk_prob=norm_topk_prob,
                               routed_scaling_factor=routed_scaling_factor)
    return weights, indices.astype(jnp.int32), scores


def _combine_weights(scores, indices, *, scoring, norm_topk_prob, routed_scaling_factor):
    """The selected experts' scores, normalised (``+1e-20`` unless softmax, as DeepSeek does)
    and scaled."""
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if norm_topk_prob:
        denom = weights.sum(-1, keepdims=True)
        weights = weights / (denom if scoring == "softmax" else denom + 1e-20)
    return weights * routed_scaling_factor


def expert_counts(indices: jax.Array, num_experts: int) -> jax.Array:
    """``int32 [E]``: how many token copies were routed to each expert."""
    one_hot = jax.nn.one_hot(indices, num_experts, dtype=jnp.int32)  # no reshape: keeps sharding
    return one_hot.sum(tuple(range(indices.ndim)))


def load_balance_loss(scores: jax.Array, counts: jax.Array, *, k: int,
                      scoring: str = "softmax") -> jax.Array:
    """Switch-style balance loss ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

    ``f_e = counts_e / (T * k)``: the fraction of token copies routed to expert ``e`` (no
    gradient); ``P_e``: the mean over tokens of the router probability of ``e`` (softmax), or of
    the sigmoid (or sqrtsoftplus) score normalised over experts (``s / sum(s)``, DeepSeek-V3's
    sequence-wise loss).
    Hugging Face's ``load_balancing_loss_func`` uses ``counts / T`` instead, i.e. ``k`` times
    this value (per layer).
    """
    num_experts = scores.shape[-1]
    scores = scores.astype(jnp.float32)
    if scoring != "softmax":  # sigmoid, sqrtsoftplus: normalised over experts
        scores = scores / scores.sum(-1, keepdims=True)
    prob = scores.mean(tuple(range(scores.ndim - 1)))  # over all tokens
    frac = counts.astype(jnp.float32) / (scores.size // num_experts * k)
    return num_experts * jnp.sum(frac * prob)


def expert_capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert for `tokens` tokens: ``ceil(factor * tokens * k / num_experts)``."""
    return max(1, math.ceil(factor * tokens * k / num_experts))


def _local_keys(expert_ids: jax.Array, expert_offset, num_local: int) -> jax.Array:
    """Local expert id in ``0..E_local-1``; copies for other shards' experts -> ``E_local``."""
    local = expert_ids - expert_offset
    return jnp.where((local >= 0) & (local < num_local), local, num_local)


# -- dispatch ----------------------------------------------------------------------------------
def combine_copies(out_copies: jax.Array, weights: jax.Array) -> jax.Array:
    """``out [k, T, D]`` (copy ``j*T + t``) weighted by ``weights [T, k]`` and summed over k,
    as one dot in the compute dtype (so its transpose is one too; GPU/TPU matmul units
    accumulate it in float32), returned as float32."""
    return jnp.einsum("ktd,tk->td", out_copies,
                      weights.astype(out_copies.dtype)).astype(jnp.float32)


def dropless_experts(x: jax.Array, indices: jax.Array, weights: jax.Array, wi_gate: jax.Array,
                     wi_up: jax.Array, wo: jax.Array, *, expert_offset=0, impl: str = "auto",
                     expected_rows: int | None = None, activation: GLU = SWIGLU,
                     bias=None, device=None) -> tuple[jax.Array, jax.Array]:
    """Weighted sum of the local experts' SwiGLU outputs for each token; nothing dropped.

    Args:
      x: ``[T, D]`` tokens; indices, weights: ``[T, k]`` from `route`.
      wi_gate, wi_up: ``[E_local, D, F]``; wo: ``[E_local, F, D]`` (experts
        ``expert_offset ..``; the offset may be traced, e.g. from `jax.lax.axis_index`).
      impl, expected_rows, activation, bias, device: the grouped matmul, see
        `grouped_swiglu`.
    Returns:
      ``(y [T, D] float32, dropped)`` with ``dropped`` an int32 zero (nothing is dropped).
    """
    num_tokens, k = indices.shape
    num_local = wi_gate.shape[0]
    keys = _local_keys(indices.T.reshape(-1), expert_offset, num_local)  # [M], row = j*T + t
    order = jnp.argsort(keys, stable=True)  # local experts' copies first, grouped by expert
    group_sizes = jnp.bincount(keys, length=num_local + 1)[:num_local].astype(jnp.int32)
    inverse = inverse_permutation(order)
    x_sorted = take_rows(x.astype(wi_gate.dtype), order % num_tokens, inverse)  # [M, D]
    out = grouped_swiglu(x_sorted, wi_gate, wi_up, wo, group_sizes, impl,
                         expected_rows=expected_rows, activation=activation, bias=bias,
                         device=device)
    # rows past the local groups belong to other shards' experts: zero them explicitly, since
    # a grouped-matmul kernel need not define them
    valid = jnp.arange(order.shape[0]) < group_sizes.sum()
    out = jnp.where(valid[:, None], out, 0)
    y = combine_copies(take_rows(out, inverse, order).reshape(k, num_tokens, -1), weights)
    return y, jnp.zeros((), jnp.int32)


def all_to_all_experts(x: jax.Array, indices: jax.Array, weights: jax.Array,
                       wi_gate: jax.Array, wi_up: jax.Array, wo: jax.Array, *,
                       axis_name, num_shards: int, capacity: int, impl: str = "auto",
                       transport: str = "auto", activation: GLU = SWIGLU,
                       bias=None, device=None, fp8_dispatch: bool = False
                       ) -> tuple[jax.Array, jax.Array]:
    """Expert-parallel dispatch by all-to-all, inside `jax.shard_map` over `axis_name`.

    Each device holds its own tokens ``x [T, D]`` (with ``indices/weights [T, k]``) and the
    experts ``me * E_local ..`` (``me = axis_index(axis_name)``). Every token copy travels
    only to the device holding its expert, into ``capacity`` rows reserved per sender there
    (see `zoo.ops.moe_execution.a2a_capacity`), grouped by that device's experts on the way
    (`zoo.ops.moe_wire.send_plan`), so only rows and a ``[EP, E_local]`` count table travel
    (no expert ids); the receiver places what arrived by expert from the counts
    (`zoo.ops.moe_wire.arrival_layout`), runs the grouped SwiGLU and sends the rows back the
    same way (`zoo.ops.moe_wire.dispatch_rows`, `zoo.ops.moe_wire.return_rows`), and the
    sender combines them with the routing weights. Rows move by `zoo.ops.rows.take_rows`,
    whose gradients are gathers. Copies beyond a peer's ``capacity`` are dropped: first
    choices go before second choices (then token order), exactly like on every platform;
    kept copies are exact.

    ``transport``: ``"ragged"`` (`jax.lax.ragged_all_to_all`: only real rows travel; GPU/TPU),
    ``"padded"`` (a dense `jax.lax.all_to_all` of ``[EP, capacity, D]``; XLA:CPU has no ragged
    all-to-all) or ``"auto"``: padded when lowered for CPU, ragged elsewhere
    (`jax.lax.platform_dependent`).
    ``fp8_dispatch`` (with ``impl="fp8_blockwise"``): the tokens travel as FP8 tiles with their
    scales (`zoo.ops.moe_wire.send_tiles`: ``D + 4 * ceil(D/128)`` bytes a row) and the
    experts' FP8 grouped matmul takes those tiles as they are; their gradients come back in
    the compute dtype, and the expert outputs (the combine) travel in it both ways.
    Returns ``(y [T, D] float32, dropped copies int32 on this device)``.
    """
    if fp8_dispatch and impl != "fp8_blockwise":
        raise ValueError(f"fp8_dispatch=True sends FP8 tiles that only the 'fp8_blockwise' "
                         f"grouped matmul takes, but impl={impl!r}; pass "
                         f"impl='fp8_blockwise' (MoE(fp8='blockwise')) or fp8_dispatch=False")
    num_tokens, k = indices.shape
    num_local = wi_gate.shape[0]
    copies, cap, n = num_tokens * k, capacity, num_shards
    plan = send_plan(indices.T.reshape(-1), num_local, n, cap)  # copy j*T + t: priority order
    x = x.astype(wi_gate.dtype)
    # each peer's rows for me, per local expert of mine, and where my rows sit on each peer
    recv_counts = jax.lax.all_to_all(plan.per_expert, axis_name, 0, 0, tiled=True)  # [EP, E_l]
    route = Route(order=plan.order, pos=plan.pos, dest=plan.dest, kept=plan.kept,
                  sent=plan.sent, offsets=plan.offsets, me=jax.lax.axis_index(axis_name),
                  recv_sizes=recv_counts.sum(1),
                  their_offsets=jax.lax.all_to_all(plan.offsets, axis_name, 0, 0, tiled=True))
    wire = Wire(axis_name, n, cap, num_tokens, transport)
    with jax.named_scope("moe_dispatch"):  # hlo.collective_bytes(scope=) reads the wire by it
        recv_x = (send_tiles(wire, route, fp8.quantize_tiles(x)) if fp8_dispatch
                  else dispatch_rows(wire, route, x))

    # on the receiver: [EP * C] rows, peer-major, each peer's grouped by expert
    arrival, order2, valid, group_sizes = arrival_layout(recv_counts, cap)
    out = grouped_swiglu(recv_x, wi_gate, wi_up, wo, group_sizes, impl, expected_rows=copies,
                         order=order2, inverse=arrival, activation=activation,
                         bias=bias, device=device)  # in arrival order
    out = jnp.where(valid[:, None], out, 0)
    with jax.named_scope("moe_combine"):
        got = return_rows(wire, route, out)
    got = jnp.where(plan.kept[:, None], got, 0).reshape(k, num_tokens, -1)
    return combine_copies(got, weights), (copies - plan.sent.sum()).astype(jnp.int32)


def capacity_experts(x: jax.Array, indices: jax.Array, weights: jax.Array, wi_gate: jax.Array,
                     wi_up: jax.Array, wo: jax.Array, *, capacity: int, expert_offset=0,
                     activation: GLU = SWIGLU, bias=None) -> tuple[jax.Array, jax.Array]:
    """Like `dropless_experts` with at most `capacity` copies per local expert.

    Priority: all first choices (in token order), then all second choices, ... (GShard's
    order), so a token loses its lower-ranked experts first. Dropped copies contribute zero.
    Returns ``(y [T, D] float32, dropped)`` with ``dropped`` the int32 number of dropped copies
    that were routed to these local experts.
    """
    num_tokens, k = indices.shape
    num_local = wi_gate.shape[0]
    keys = _local_keys(indices.T.reshape(-1), expert_offset, num_local)  # [M], row = j*T + t
    order = jnp.argsort(keys, stable=True)
    counts = jnp.bincount(keys, length=num_local + 1).astype(jnp.int32)  # [E_local + 1]
    starts = jnp.cumsum(counts) - counts
    keys_sorted = keys[order]
    pos_sorted = jnp.arange(order.shape[0]) - starts[keys_sorted]  # rank within its expert
    keep_sorted = (keys_sorted < num_local) & (pos_sorted < capacity)
    # gather the buffer [E_local, C, D]: slot (e, c) holds sorted row starts[e] + c
    slots = jnp.arange(capacity)
    rows = jnp.minimum(starts[:num_local, None] + slots[None], order.shape[0] - 1)
    filled = slots[None] < counts[:num_local, None]
    tokens = order[rows] % num_tokens
    xb = jnp.where(filled[..., None], x[tokens], 0).astype(wi_gate.dtype)
    gate = jnp.einsum("ecd,edf->ecf", xb, wi_gate)
    up = jnp.einsum("ecd,edf->ecf", xb, wi_up)
    if bias is not None:
        gate, up = (h + b[:, None, :].astype(h.dtype) for h, b in zip((gate, up), bias))
    ob = jnp.einsum("ecf,efd->ecd", activation(gate, up), wo)  # [E_local, C, D]
    # back to sorted copies, then to (j, t) order
    e_idx = jnp.minimum(keys_sorted, num_local - 1)
    c_idx = jnp.clip(pos_sorted, 0, capacity - 1)
    w_sorted = weights.T.reshape(-1)[order]
    out = jnp.where(keep_sorted[:, None],
                    ob[e_idx, c_idx].astype(jnp.float32) * w_sorted[:, None], 0.0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = out[inverse].reshape(k, num_tokens, -1).sum(0)
    dropped = jnp.sum(keys < num_local) - jnp.sum(keep_sorted)
    return y, dropped.astype(jnp.int32)
