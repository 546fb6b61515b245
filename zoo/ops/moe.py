"""Pure mixture-of-experts functions: routing, balance statistics and token dispatch.

No parameters and no mesh here; `zoo.layers.moe.MoE` wires them into a layer and runs the
dispatch inside `jax.shard_map`. Everything works on one device's tokens and one device's
(local) experts, so the same functions serve the unsharded and the expert-parallel paths.

* `route` -- router logits -> top-k expert indices and combine weights, in float32, with the
  semantics of Hugging Face's ``MixtralTopKRouter`` (``scoring="softmax"``) and
  ``DeepseekV3TopkRouter`` (``scoring="sigmoid"``: selection bias, group-limited top-k,
  ``norm_topk_prob``, ``routed_scaling_factor``).
* `expert_counts`, `load_balance_loss` -- balance statistics over the tokens given.
* `dropless_experts` -- sort token copies by expert and run the SwiGLU experts as a grouped
  matmul (`grouped_swiglu`): `jax.lax.ragged_dot` on GPU/TPU; on XLA:CPU, where ragged_dot
  lowers to a dense masked matmul over every local expert, a blocked grouped matmul (rows
  padded per expert to blocks, batched matmul; 3.6-9.8x faster there, `benchmarks/moe.py`).
  Nothing is dropped. Buffer: ``tokens * k`` rows (the worst case, every copy on a local
  expert), so shapes stay static.
* `capacity_experts` -- fixed capacity per expert (``[E, C, D]`` buffers, batched matmul);
  copies beyond the capacity are dropped, first choices before second choices.

Only experts ``expert_offset .. expert_offset + E_local`` (the weights passed in) are computed;
copies routed elsewhere contribute zero, so summing the outputs of all expert shards gives the
full layer.

Legend: T tokens, M token copies (T*k), k experts per token, D embed, E experts (E_local on
this device), F mlp, C capacity per expert.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

SCORINGS = ("softmax", "sigmoid")


# -- routing ---------------------------------------------------------------------------------
def route(logits: jax.Array, *, k: int, scoring: str = "softmax", bias: jax.Array | None = None,
          n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          routed_scaling_factor: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing. Returns ``(weights [..., k] f32, indices [..., k] int32, scores [..., E])``.

    ``scores`` are the unbiased router scores (softmax probabilities or sigmoid scores), which
    the balance loss uses. Selection ranks ``scores + bias`` (bias: DeepSeek-V3's
    ``e_score_correction_bias``, selection only); with ``n_group > 1`` only the ``topk_group``
    groups with the largest sum of their top-2 biased scores are eligible. Weights are the
    unbiased scores of the selected experts, divided by their sum when ``norm_topk_prob``
    (+1e-20 for sigmoid, as DeepSeek-V3 does), times ``routed_scaling_factor``. With softmax and
    ``norm_topk_prob`` this is Mixtral's "softmax over all, top-k, renormalise", which equals a
    softmax over the k selected logits.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r} is not one of {SCORINGS}")
    logits = logits.astype(jnp.float32)
    num_experts = logits.shape[-1]
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
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
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if norm_topk_prob:
        denom = weights.sum(-1, keepdims=True)
        weights = weights / (denom + 1e-20 if scoring == "sigmoid" else denom)
    return weights * routed_scaling_factor, indices.astype(jnp.int32), scores


def expert_counts(indices: jax.Array, num_experts: int) -> jax.Array:
    """``int32 [E]``: how many token copies were routed to each expert."""
    one_hot = jax.nn.one_hot(indices, num_experts, dtype=jnp.int32)  # no reshape: keeps sharding
    return one_hot.sum(tuple(range(indices.ndim)))


def load_balance_loss(scores: jax.Array, counts: jax.Array, *, k: int,
                      scoring: str = "softmax") -> jax.Array:
    """Switch-style balance loss ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

    ``f_e = counts_e / (T * k)``: the fraction of token copies routed to expert ``e`` (no
    gradient); ``P_e``: the mean over tokens of the router probability of ``e`` (softmax), or of
    the sigmoid score normalised over experts (``s / sum(s)``, DeepSeek-V3's sequence-wise loss).
    Hugging Face's ``load_balancing_loss_func`` uses ``counts / T`` instead, i.e. ``k`` times
    this value (per layer).
    """
    num_experts = scores.shape[-1]
    scores = scores.astype(jnp.float32)
    if scoring == "sigmoid":
        scores = scores / scores.sum(-1, keepdims=True)
    prob = scores.mean(tuple(range(scores.ndim - 1)))  # over all tokens
    frac = counts.astype(jnp.float32) / (scores.size // num_experts * k)
    return num_experts * jnp.sum(frac * prob)


def expert_capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert for `tokens` tokens: ``ceil(factor * tokens * k / num_experts)``."""
    return max(1, math.ceil(factor * tokens * k / num_experts))


# -- dispatch ----------------------------------------------------------------------------------
def _local_keys(expert_ids: jax.Array, expert_offset, num_local: int) -> jax.Array:
    """Local expert id in ``0..E_local-1``; copies for other shards' experts -> ``E_local``."""
    local = expert_ids - expert_offset
    return jnp.where((local >= 0) & (local < num_local), local, num_local)


def block_size(rows: int, num_local: int) -> int:
    """Rows per block of the blocked grouped matmul: the power of two nearest the mean group
    size, within 8..128 (small blocks waste less padding, large ones run matmuls faster)."""
    mean = max(1.0, rows / max(1, num_local))
    return int(min(128, max(8, 2 ** round(math.log2(mean)))))


def _blocked_swiglu(x: jax.Array, keys: jax.Array, wi_gate: jax.Array, wi_up: jax.Array,
                    wo: jax.Array, group_sizes: jax.Array, block: int) -> jax.Array:
    """Grouped SwiGLU from gathers and batched matmuls (megablocks-style), for XLA:CPU.

    Each expert's rows are padded to a multiple of `block`; every block belongs to one expert,
    so ``[blocks, block, D] x [blocks, D, F]`` (weights gathered per block) does the work.
    Static sizes: ``blocks = ceil((M + E_local * (block - 1)) / block)``, i.e. at most
    ``E_local * (block - 1)`` padding rows. `keys` are the sorted rows' local expert ids.
    """
    rows, _ = x.shape
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
    xp = jnp.where((offset < group_sizes[expert])[:, None], x[src], 0)
    xp = xp.reshape(blocks, block, -1)
    be = expert.reshape(blocks, block)[:, 0]  # one expert per block
    gate = jnp.einsum("nbd,ndf->nbf", xp, wi_gate[be])
    up = jnp.einsum("nbd,ndf->nbf", xp, wi_up[be])
    out = jnp.einsum("nbf,nfd->nbd", jax.nn.silu(gate) * up, wo[be]).reshape(blocks * block, -1)
    e_row = jnp.minimum(keys, num_local - 1)
    dest = padded_starts[e_row] + jnp.arange(rows) - starts[e_row]
    return out[jnp.clip(dest, 0, blocks * block - 1)]  # rows of other shards: masked by caller


def grouped_swiglu(x: jax.Array, keys: jax.Array, wi_gate: jax.Array, wi_up: jax.Array,
                   wo: jax.Array, group_sizes: jax.Array, impl: str | None = None) -> jax.Array:
    """SwiGLU of rows sorted by expert: ``[M, D] -> [M, D]``; rows past ``sum(group_sizes)``
    are undefined. ``impl``: ``"ragged_dot"`` (`jax.lax.ragged_dot`: a grouped-matmul kernel on
    GPU/TPU, but a dense masked matmul over all local experts on XLA:CPU), ``"blocked"``
    (`_blocked_swiglu`) or None: ``"blocked"`` on CPU, ``"ragged_dot"`` elsewhere."""
    impl = impl or ("blocked" if jax.default_backend() == "cpu" else "ragged_dot")
    if impl == "blocked":
        block = block_size(x.shape[0], wi_gate.shape[0])
        return _blocked_swiglu(x, keys, wi_gate, wi_up, wo, group_sizes, block)
    if impl != "ragged_dot":
        raise ValueError(f"grouped matmul impl={impl!r} must be 'ragged_dot', 'blocked' or None")
    gate = jax.lax.ragged_dot(x, wi_gate, group_sizes)  # MD,EDF->MF
    up = jax.lax.ragged_dot(x, wi_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, wo, group_sizes)  # MF,EFD->MD


def dropless_experts(x: jax.Array, indices: jax.Array, weights: jax.Array, wi_gate: jax.Array,
                     wi_up: jax.Array, wo: jax.Array, *, expert_offset=0,
                     impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Weighted sum of the local experts' SwiGLU outputs for each token; nothing dropped.

    Args:
      x: ``[T, D]`` tokens; indices, weights: ``[T, k]`` from `route`.
      wi_gate, wi_up: ``[E_local, D, F]``; wo: ``[E_local, F, D]`` (experts
        ``expert_offset ..``; the offset may be traced, e.g. from `jax.lax.axis_index`).
      impl: the grouped matmul, see `grouped_swiglu`.
    Returns:
      ``(y [T, D] float32, dropped)`` with ``dropped`` an int32 zero (nothing is dropped).
    """
    num_tokens, k = indices.shape
    num_local = wi_gate.shape[0]
    keys = _local_keys(indices.reshape(-1), expert_offset, num_local)  # [M], row = t*k + j
    order = jnp.argsort(keys, stable=True)  # local experts' copies first, grouped by expert
    group_sizes = jnp.bincount(keys, length=num_local + 1)[:num_local].astype(jnp.int32)
    x_sorted = x[order // k].astype(wi_gate.dtype)  # [M, D]
    out = grouped_swiglu(x_sorted, keys[order], wi_gate, wi_up, wo, group_sizes, impl)
    # rows past the local groups belong to other shards' experts: zero them explicitly, since
    # a grouped-matmul kernel need not define them
    w_sorted = jnp.where(keys < num_local, weights.reshape(-1), 0.0)[order]
    valid = jnp.arange(order.shape[0]) < group_sizes.sum()
    out = jnp.where(valid[:, None], out.astype(jnp.float32) * w_sorted[:, None], 0.0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = out[inverse].reshape(num_tokens, k, -1).sum(1)  # back to token order, sum over k
    return y, jnp.zeros((), jnp.int32)


def capacity_experts(x: jax.Array, indices: jax.Array, weights: jax.Array, wi_gate: jax.Array,
                     wi_up: jax.Array, wo: jax.Array, *, capacity: int, expert_offset=0
                     ) -> tuple[jax.Array, jax.Array]:
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
    ob = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, wo)  # [E_local, C, D]
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
