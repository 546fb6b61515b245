"""Pure mixture-of-experts functions: routing, balance statistics, grouped matmul, dispatch.

No parameters and no mesh here; `zoo.layers.moe.MoE` wires them into a layer and runs the
dispatch inside `jax.shard_map` (`all_to_all_experts` names the mesh axis it exchanges over).

* `route` -- router logits -> top-k expert indices and combine weights, in float32, with the
  semantics of Hugging Face's ``MixtralTopKRouter`` (``scoring="softmax"``) and
  ``DeepseekV3TopkRouter`` (``scoring="sigmoid"``: selection bias, group-limited top-k,
  ``norm_topk_prob``, ``routed_scaling_factor``) and DeepSeek-V4's ``DeepseekV4TopKRouter``
  (``scoring="sqrtsoftplus"``: ``sqrt(softplus(logits))`` with a selection bias) and
  ``DeepseekV4HashRouter`` (``indices=``: a fixed token-id -> experts table chose them).
* `expert_counts`, `load_balance_loss` -- balance statistics over the tokens given.
* `grouped_swiglu` -- the experts' SwiGLU on rows sorted by expert. What runs where:
  ``"auto"`` picks, when the program is lowered (`jax.lax.platform_dependent`), the blocked
  grouped matmul on CPU (`blocked_matmul`: each expert's rows padded to blocks, a loop of
  dense block matmuls that slices each block's weight in place and skips empty blocks; HLO
  FLOPs within 1.25x of the useful ones once groups average 32 rows) and
  ``tokamax.ragged_dot`` on GPU/TPU (Mosaic GPU / Triton / Mosaic TPU kernels).
  ``jax.lax.ragged_dot`` stays selectable: XLA (GPU and CPU) expands it into a dense masked
  matmul over every local expert, ``E_local`` times the useful FLOPs.
* `dropless_experts` -- the all_gather scheme's work on one device: every token copy it sees,
  sorted by local expert (copies for other shards' experts sort last and cost nothing).
* `all_to_all_experts` -- the all_to_all scheme: each token copy travels only to the device
  holding its expert (`jax.lax.ragged_all_to_all` on GPU/TPU, a padded `jax.lax.all_to_all`
  on CPU, chosen at lowering), into ``capacity`` rows per peer
  (`zoo.ops.moe_execution.a2a_capacity`: dropless by default, or ``buffer_factor`` times the
  balanced share, overflow counted); results come back the same way. Sends, expert math and
  the k-way combine run in the compute dtype; with ``fp8_dispatch`` the sends carry FP8 tiles
  and their scales (`send_tiles`; the receiver's FP8 grouped matmul takes them as they are),
  their gradients the compute dtype.
  `dispatch_rows` / `return_rows` are the wire (ragged or padded) both ways.
* `capacity_experts` -- fixed capacity per expert (``[E, C, D]`` buffers, batched matmul);
  copies beyond the capacity are dropped, first choices before second choices.
* How a layer runs (the dispatch scheme, buffers, overflow, kernel and target device) is one
  value, `zoo.ops.moe_execution.MoEExecution`, with the sizes it rests on (`a2a_capacity`,
  `dispatch_bytes`) beside it there.
* `GLU` -- the experts' gated activation (a value): ``silu(gate) * up`` by default;
  gpt-oss's clamped form ``GLU(alpha=1.702, limit=7.0, up_offset=1.0)``. The expert functions
  take it as ``activation=`` and optional per-expert ``bias=(gate_bias, up_bias)`` ``[E_local,
  F]`` added before it (gpt-oss); the defaults keep the plain SwiGLU.

Legend: T tokens, M token copies (T*k), k experts per token, D embed, E experts (E_local on
this device), F mlp, C capacity per expert (or per peer), R receive rows, EP expert shards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zoo.ops import fp8
from zoo.ops.moe_execution import GROUPED_MATMULS

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


@dataclasses.dataclass(frozen=True)
class GLU:
    """``(gate * sigmoid(alpha * gate)) * (up + up_offset)``, with ``gate <= limit`` and ``up``
    in ``[-limit, limit]`` first when `limit` is set. ``GLU()`` is SwiGLU (``silu(gate) * up``);
    gpt-oss: ``GLU(alpha=1.702, limit=7.0, up_offset=1.0)``."""

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    def __post_init__(self):
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"GLU: limit={self.limit!r} must be > 0 (the clamp bound) or None")

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self == SWIGLU:
            return jax.nn.silu(gate) * up
        if self.limit is not None:
            gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
        return gate * jax.nn.sigmoid(self.alpha * gate) * (up + self.up_offset)


SWIGLU = GLU()


def _row_experts(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The local expert of each of `rows` rows sorted by expert (rows past the groups: the
    last expert; callers mask them)."""
    return jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right"),
                       group_sizes.shape[0] - 1)


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


def block_size(rows: int, num_local: int) -> int:
    """Rows per block of the blocked grouped matmul for about `rows` real rows: the largest
    power of two within 8..128 that is at most a quarter of the mean group size, so padding
    (at most ``E_local * (block - 1)`` rows) stays within 25% of the useful work whenever the
    mean group has 32 rows or more."""
    quarter = max(1.0, rows / max(1, num_local) / 4)
    return int(min(128, max(8, 2 ** math.floor(math.log2(quarter)))))


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


def _block_mm(x: jax.Array, w: jax.Array, experts: jax.Array, active: jax.Array) -> jax.Array:
    """``x [n, b, K]`` block n times ``w[experts[n]] [K, N]`` -> ``[n, b, N]``; inactive
    blocks give zeros and cost nothing (a `lax.cond` inside a loop). The weight of each block
    is sliced inside the loop, never gathered into an ``[n, K, N]`` temporary."""
    zeros = mark_varying(jnp.zeros((x.shape[1], w.shape[-1]), jnp.result_type(x, w)),
                  varying_axes(x) | varying_axes(w))

    def one(args):
        xb, e, on = args
        return jax.lax.cond(on, lambda: xb @ jax.lax.dynamic_index_in_dim(w, e, 0, False),
                            lambda: zeros)
    return jax.lax.map(one, (x, experts, active))


@jax.custom_vjp
def blocked_matmul(x, w, experts, active):
    """Block-diagonal grouped matmul ``[n, b, K] x [E, K, N] -> [n, b, N]`` (each block of
    rows belongs to one expert), differentiable with loops only: the gradient wrt ``x`` is the
    same loop against ``w^T``, the gradient wrt ``w`` accumulates ``x_n^T dy_n`` into
    ``dw[experts[n]]`` (one ``[E, K, N]`` carry)."""
    return _block_mm(x, w, experts, active)


def _blocked_fwd(x, w, experts, active):
    return _block_mm(x, w, experts, active), (x, w, experts, active)


def _blocked_bwd(res, dy):
    x, w, experts, active = res
    dx = _block_mm(dy, jnp.swapaxes(w, 1, 2), experts, active)
    # dw: an expert's blocks are contiguous, so one float32 [K, N] accumulator runs over them
    # and is written into dw (w's dtype) once per expert -- exact float32 sums without a
    # float32 copy of all the local experts' weights
    vary = lambda v: mark_varying(v, varying_axes(w))

    def flush(dw, acc, e):
        return jax.lax.dynamic_update_index_in_dim(dw, acc.astype(dw.dtype), e, 0)

    def step(n, carry):
        def add(carry):
            dw, acc, cur = carry
            e = experts[n]
            dw, acc = jax.lax.cond(e != cur, lambda: (flush(dw, acc, cur), jnp.zeros_like(acc)),
                                   lambda: (dw, acc))
            g = jnp.dot(x[n].T, dy[n], preferred_element_type=jnp.float32)  # bf16 in, f32 sum
            return dw, acc + g, e
        return jax.lax.cond(active[n], add, lambda c: c, carry)
    init = (vary(jnp.zeros(w.shape, w.dtype)), vary(jnp.zeros(w.shape[1:], jnp.float32)),
            vary(experts[0]))
    dw, acc, cur = jax.lax.fori_loop(0, x.shape[0], step, init)
    dw = flush(dw, acc, cur)
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)
    return dx, dw, zero(experts), zero(active)


blocked_matmul.defvjp(_blocked_fwd, _blocked_bwd)


def _blocked_swiglu(x: jax.Array, wi_gate: jax.Array, wi_up: jax.Array, wo: jax.Array,
                    group_sizes: jax.Array, block: int, order: jax.Array | None = None,
                    activation: GLU = SWIGLU, bias=None) -> jax.Array:
    """Grouped SwiGLU for XLA:CPU: each expert's rows padded to a multiple of `block`, then
    `blocked_matmul` over the blocks that hold rows (the rest are skipped at run time).

    Static sizes: ``blocks = ceil((R + E_local * (block - 1)) / block)`` for an ``R``-row
    buffer, so the program's FLOPs are at most ``1 + E_local * block / R`` times the useful
    work when the buffer is full; rows past ``sum(group_sizes)`` cost nothing.
    """
    rows = x.shape[0]
    num_local = wi_gate.shape[0]
    blocks = -(-(rows + num_local * (block - 1)) // block)
    starts = jnp.cumsum(group_sizes) - group_sizes
    padded = -(-group_sizes // block) * block
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    q = jnp.arange(blocks * block)  # padded row -> (expert, offset) -> sorted row
    expert = jnp.minimum(jnp.searchsorted(padded_ends, q, side="right"), num_local - 1)
    offset = q - padded_starts[expert]
    src = jnp.clip(starts[expert] + offset, 0, rows - 1)
    if order is not None:  # x is unsorted: one gather straight into the padded layout
        src = order[src]
    xp = jnp.where((offset < group_sizes[expert])[:, None], x[src], 0).reshape(blocks, block, -1)
    be = expert.reshape(blocks, block)[:, 0]  # one expert per block
    active = jnp.arange(blocks) * block < padded_ends[-1]
    # one varying type for blocks and weights, so the custom VJP returns each weight's
    # gradient in its own type (the sum over token shards is the transposed pcast's psum)
    axes = frozenset().union(*(varying_axes(v) for v in (xp, be, wi_gate, wi_up, wo)))
    xp, be, active, wi_gate, wi_up, wo = (mark_varying(v, axes)
                                          for v in (xp, be, active, wi_gate, wi_up, wo))
    gate, up = blocked_matmul(xp, wi_gate, be, active), blocked_matmul(xp, wi_up, be, active)
    if bias is not None:  # one expert per block
        gate, up = (h + b[be][:, None, :].astype(h.dtype) for h, b in zip((gate, up), bias))
    h = activation(gate, up)
    out = blocked_matmul(h, wo, be, active).reshape(blocks * block, -1)
    r = jnp.arange(rows)  # sorted row -> its padded row
    e_row = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), r, side="right"),
                        num_local - 1)
    dest = padded_starts[e_row] + r - starts[e_row]
    if order is not None:  # each row of x's own order -> its padded row
        dest = jnp.zeros_like(dest).at[order].set(dest)
    return out[jnp.clip(dest, 0, blocks * block - 1)]  # rows past the groups: masked by caller


def _ragged_swiglu(dot, x, wi_gate, wi_up, wo, group_sizes, activation=SWIGLU, bias=None):
    gate = dot(x, wi_gate, group_sizes)  # MD,EDF->MF
    up = dot(x, wi_up, group_sizes)
    if bias is not None:
        e = _row_experts(group_sizes, x.shape[0])
        gate, up = (h + b[e].astype(h.dtype) for h, b in zip((gate, up), bias))
    return dot(activation(gate, up), wo, group_sizes)  # MF,EFD->MD


def tokamax_dot(x, w, group_sizes, device=None):
    """``tokamax.ragged_dot(x, w, group_sizes)``; `device` (static): a device of the mesh the
    program is compiled for when that is not the process's default platform (a GPU target
    compiled on a CPU host). tokamax picks and admits its kernels by the default device (on a
    CPU default it refuses Mosaic GPU and Triton and falls back to `jax.lax.ragged_dot`), so
    forward and backward are then traced with `device` as the default
    (`zoo.ops.moe_execution.MoEExecution.device` carries it from the mesh; being a static
    value, it reaches the backward pass too)."""
    import tokamax  # imported on use: an accelerator kernel library, not needed on CPU
    from absl import flags
    # tokamax 0.0.12 reads its options through absl flags and, if nobody parsed them, parses
    # sys.argv -- which fails on any program's own flags (pytest's, the recipes'); take the
    # defaults instead
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    if device is None:
        return tokamax.ragged_dot(x, w, group_sizes)
    return _ragged_dot_for(device)(x, w, group_sizes, varying_axes(x), varying_axes(w))


@functools.cache
def _ragged_dot_for(device):
    """``tokamax.ragged_dot`` traced with `device` as the default device, its backward too
    (tokamax's own VJP runs when the backward is traced, after the forward's scope ended)."""
    import tokamax

    dims = jax.lax.RaggedDotDimensionNumbers

    # vx, vw: the shard_map axes x and w vary over; a kernel's outputs do not say, so its
    # result and gradients are marked as the inputs vary. The backward calls the kernels
    # itself (tokamax's own VJP would check its kernels' outputs against those axes and fail)
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def dot(x, w, group_sizes, vx, vw):
        with jax.default_device(device):
            return mark_varying(tokamax.ragged_dot(x, w, group_sizes), vx | vw)

    def fwd(x, w, group_sizes, vx, vw):
        return dot(x, w, group_sizes, vx, vw), (x, w, group_sizes)

    def bwd(vx, vw, res, g):  # g [M, N]: dx = g w_e^T per row, dw_e = x_e^T g_e per group
        x, w, group_sizes = res
        with jax.default_device(device):
            dx = tokamax.ragged_dot_general(
                g, w, group_sizes, dims((([1], [2]), ([], [])), [0], [0]),
                preferred_element_type=x.dtype)
            dw = tokamax.ragged_dot_general(
                x, g, group_sizes, dims((([0], [0]), ([], [])), [0], []),
                preferred_element_type=w.dtype)
        return as_varying(dx, vx), as_varying(dw, vw), None

    dot.defvjp(fwd, bwd)
    return dot


def grouped_swiglu(x: jax.Array, wi_gate: jax.Array, wi_up: jax.Array, wo: jax.Array,
                   group_sizes: jax.Array, impl: str = "auto", *,
                   expected_rows: int | None = None, order: jax.Array | None = None,
                   inverse: jax.Array | None = None, activation: GLU = SWIGLU,
                   bias=None, device=None) -> jax.Array:
    """SwiGLU of rows sorted by expert: ``[R, D] -> [R, D]``; rows past ``sum(group_sizes)``
    are undefined (callers mask them).

    ``impl``:
      * ``"blocked"``: `_blocked_swiglu`, loops of dense block matmuls; the CPU path.
      * ``"tokamax"``: ``tokamax.ragged_dot`` (Mosaic GPU kernels on Hopper/Blackwell, Triton,
        Mosaic TPU; its XLA fallback elsewhere).
      * ``"ragged_dot"``: `jax.lax.ragged_dot`. XLA:TPU has its own ragged-dot kernel, forward
        and both transposes; XLA:GPU and XLA:CPU expand it to a dense masked matmul over every
        local expert (``E_local`` times the useful FLOPs).
      * ``"auto"``: chosen by the platform the program is lowered for
        (`jax.lax.platform_dependent`; `zoo.layers.MoE` settles it from its mesh instead,
        `choose_grouped_matmul`): ``"blocked"`` on CPU, ``"ragged_dot"`` on TPU,
        ``"tokamax"`` on GPU. Not tokamax on TPU: its Mosaic TPU kernel cannot state its
        output's `jax.shard_map` axes (a ``check_vma`` error inside the MoE's shard_map, seen
        on a TPU v5e), its XLA fallback's backward builds a masked copy of every row per
        local expert for the weight gradients (``[E_local, R, D]``: 1.6 GiB more temporaries
        than XLA's ragged dot for one ``[65536, 7168] x [4, 7168, 2048]`` product on v5p),
        and on a v5e chip XLA's ragged dot ran a SwiGLU's forward and backward about 10x
        faster than the Mosaic kernel at its default tiles (docs/benchmarks.md).
      * ``"fp8_blockwise"``: `zoo.ops.fp8.ragged_dot`, blockwise-scaled FP8 operands (XLA's
        ragged dot per 128-block of D or F), forward and backward (docs/fp8.md). ``x`` may
        then be `zoo.ops.fp8.Tiles` (rows quantised already, e.g. by the FP8 dispatch): the
        gate and up products take its tiles as they are; and the weights their FP8 copies
        (`zoo.ops.fp8.QuantizedWeight`, made once per step: `zoo.layers.MoE.fp8_weights`).
    ``expected_rows``: the real rows expected (sets the block size; default ``R``).
    ``order``: when given, ``x`` is unsorted and ``x[order]`` is sorted by expert; the result
    then comes back in ``x``'s own order (the blocked form folds both permutations into its
    own gathers, saving two ``[R, D]`` temporaries). ``inverse``: ``order``'s inverse
    permutation when the caller has it (else computed); the sorted forms move rows with
    `take_rows`, whose gradients are gathers too.
    ``activation``: a `GLU`; ``bias``: None or ``(gate_bias, up_bias)`` ``[E_local, F]``.
    ``device``: the target device tokamax's kernels are traced for (`tokamax_dot`).
    """
    if impl not in GROUPED_MATMULS:
        raise ValueError(f"grouped matmul {impl!r} is not one of {GROUPED_MATMULS}")
    if isinstance(x, fp8.Tiles) and impl != "fp8_blockwise":
        raise ValueError(f"grouped_swiglu: x is FP8 tiles (zoo.ops.fp8.Tiles), which only "
                         f"impl='fp8_blockwise' takes, not {impl!r}")
    if impl != "fp8_blockwise" and any(isinstance(w, fp8.QuantizedWeight)
                                       for w in (wi_gate, wi_up, wo)):
        raise ValueError(f"grouped_swiglu: an expert weight is an FP8 copy "
                         f"(zoo.ops.fp8.QuantizedWeight), which only impl='fp8_blockwise' "
                         f"takes, not {impl!r}; pass the weights themselves")
    with jax.named_scope("grouped_matmul"):  # profiles and HLO read the experts' matmuls by it
        return _grouped_swiglu(x, wi_gate, wi_up, wo, group_sizes, impl, expected_rows, order,
                               inverse, activation, bias, device)


def _fp8_ragged_dot(x, w, group_sizes):
    return fp8.ragged_dot(x, w, group_sizes).astype(x.dtype)


def _grouped_swiglu(x, wi_gate, wi_up, wo, group_sizes, impl, expected_rows, order, inverse,
                    activation, bias, device):
    block = block_size(expected_rows or x.shape[0], wi_gate.shape[0])
    args = (x, wi_gate, wi_up, wo, group_sizes)
    blocked = lambda *a: _blocked_swiglu(*a, block, order, activation, bias)

    def sorted_rows(dot):
        def run(x, *rest):
            if order is None:
                return _ragged_swiglu(dot, x, *rest, activation, bias)
            inv = inverse_permutation(order) if inverse is None else inverse
            move = lambda v: take_rows(v, order, inv)
            x = x.take(order, move) if isinstance(x, fp8.Tiles) else move(x)
            out = _ragged_swiglu(dot, x, *rest, activation, bias)
            return take_rows(out, inv, order)
        return run
    if impl == "blocked":
        return blocked(*args)
    if impl == "ragged_dot":
        return sorted_rows(jax.lax.ragged_dot)(*args)
    if impl == "fp8_blockwise":
        return sorted_rows(_fp8_ragged_dot)(*args)
    tok = sorted_rows(functools.partial(tokamax_dot, device=device))
    if impl == "tokamax":
        return tok(*args)
    return jax.lax.platform_dependent(*args, cpu=blocked, tpu=sorted_rows(jax.lax.ragged_dot),
                                      default=tok)


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
    (`_send_plan`), so
    only rows and a ``[EP, E_local]`` count table travel (no expert ids); the receiver
    places what arrived by expert from the counts (`_arrival_layout`), runs the grouped
    SwiGLU and sends the rows back the same way, and the sender combines them with the
    routing weights. Rows move by `take_rows`, whose gradients are gathers. Copies beyond
    a peer's ``capacity`` are dropped: first choices go before second
    choices (then token order), exactly like on every platform; kept copies are exact.

    ``transport``: ``"ragged"`` (`jax.lax.ragged_all_to_all`: only real rows travel; GPU/TPU),
    ``"padded"`` (a dense `jax.lax.all_to_all` of ``[EP, capacity, D]``; XLA:CPU has no ragged
    all-to-all) or ``"auto"``: padded when lowered for CPU, ragged elsewhere
    (`jax.lax.platform_dependent`).
    ``fp8_dispatch`` (with ``impl="fp8_blockwise"``): the tokens travel as FP8 tiles with their
    scales (`send_tiles`: ``D + 4 * ceil(D/128)`` bytes a row) and the experts' FP8 grouped
    matmul takes those tiles as they are; their gradients come back in the compute dtype, and
    the expert outputs (the combine) travel in it both ways.
    Returns ``(y [T, D] float32, dropped copies int32 on this device)``.
    """
    if fp8_dispatch and impl != "fp8_blockwise":
        raise ValueError(f"fp8_dispatch=True sends FP8 tiles that only the 'fp8_blockwise' "
                         f"grouped matmul takes, but impl={impl!r}; pass "
                         f"impl='fp8_blockwise' (MoE(fp8='blockwise')) or fp8_dispatch=False")
    num_tokens, k = indices.shape
    num_local = wi_gate.shape[0]
    copies, cap, n = num_tokens * k, capacity, num_shards
    plan = _send_plan(indices.T.reshape(-1), num_local, n, cap)  # copy j*T + t: priority order
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
    arrival, order2, valid, group_sizes = _arrival_layout(recv_counts, cap)
    out = grouped_swiglu(recv_x, wi_gate, wi_up, wo, group_sizes, impl, expected_rows=copies,
                         order=order2, inverse=arrival, activation=activation,
                         bias=bias, device=device)  # in arrival order
    out = jnp.where(valid[:, None], out, 0)
    with jax.named_scope("moe_combine"):
        got = return_rows(wire, route, out)
    got = jnp.where(plan.kept[:, None], got, 0).reshape(k, num_tokens, -1)
    return combine_copies(got, weights), (copies - plan.sent.sum()).astype(jnp.int32)


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
    """The traced side: `_send_plan`'s arrays (``order``, ``pos``, ``dest``, ``kept``, ``sent``,
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
    receiver's ``[EP * C, W]`` rows, peer-major (`_arrival_layout`); differentiable."""
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
class _SendPlan:
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


def _send_plan(ids: jax.Array, num_local: int, n: int, cap: int) -> _SendPlan:
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
    return _SendPlan(order=order, pos=pos, dest=ids // num_local, kept=pos < total, sent=sent,
                     offsets=jnp.cumsum(sent) - sent, per_expert=per_expert)


def _arrival_layout(recv_counts: jax.Array, cap: int):
    """The receiver's side of `_send_plan`, from the counts alone: rows arrive in ``[EP, C]``
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
