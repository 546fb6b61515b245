"""Dot-product attention as an open op: the unsharded reference and the context-parallel entry.

* `dot_product_attention` -- the plain reference: dense fp32 logits [B, N, L, S], the mask
  evaluated densely from positions and segment ids (`zoo.ops.masks`), score modifiers and sinks
  as formulas, exact zeros for padding rows; autodiff gives its gradients.
* `attention` -- the same function for real use. ``implementation`` names the
  context-parallel *strategy*: ``"reference"``, ``"all_gather"`` (gather K/V over the sequence
  shards, local Q attends), ``"ring"`` (rotate K/V with `ppermute`, fp32 online-softmax merge)
  or ``"auto"`` (`choose_implementation`). ``kernel`` names the *block kernel* the strategies
  call (`zoo.ops.kernels`: ``"flash"``, ``"pallas_tpu"``, ``"tokamax"``, a registered name or
  an instance; ``"auto"``: tokamax on GPU, pallas_tpu on TPU, flash on CPU). It runs under
  `jax.shard_map` over the partitioner's attention batch, sequence and head axes; gradients
  come from an exact `custom_vjp` (`zoo.ops.ring`).
* `mla_attention` -- DeepSeek's multi-head latent attention with the compressed latent on the
  wire: [B, S, kv_lora_rank] and the shared rotary key [B, S, Hr] go around the ring / through
  the all-gather, and each shard expands them to per-head K/V with ``kv_up``.

Masks are values (``mask=Causal() & Document()``, `zoo.ops.masks`); ``causal``/
``sliding_window`` remain as shorthands (``causal=None`` means causal when no mask is given)
and may not be combined with ``mask``. Score modifiers: ``logits_soft_cap`` (``cap *
tanh(logits / cap)``), ``score_mod`` (`zoo.ops.kernels.ScoreMod`) and ``sinks`` ([N] logits
that join every row's softmax and carry no value, as in gpt-oss).

Head layout (Hugging Face convention): query head n uses kv head n // (N // K).

Legend: B batch, L query length, S kv length, N query heads, K kv heads, G = N // K query heads
per kv head, H q/k head dim, Hv value head dim, R kv_lora_rank, Hn/Hr MLA no-position/rotary
key dims.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zoo.ops import fp8 as fp8_ops
from zoo.ops import flash as _flash  # noqa: F401  (registers the "flash" kernel)
from zoo.ops import pallas_tpu as _pallas_tpu  # noqa: F401  (registers "pallas_tpu")
from zoo.ops import ring as _ring
from zoo.ops.kernels import BlockKernel, ScoreMod, Scores, get_kernel
from zoo.ops.masks import Mask, attention_mask, default_mask
from zoo.partitioning import Partitioner, resolve

IMPLEMENTATIONS = ("auto", "reference", "all_gather", "ring")
# what crosses the context-parallel wire in MLA: the latent (each shard expands what it
# receives: `mla_attention`) or the per-head K/V (each shard expands its own tokens, then
# `attention`); "auto": `choose_mla_wire`
KV_WIRES = ("auto", "latent", "expanded")
# the matmul FLOPs that cost as much as one byte moved by a context-parallel collective, on
# virtual CPU devices (one process; a collective is a copy through memory): the 2-core box's
# matmul rate over its 8-device all-gather rate (see `choose_mla_wire`)
CPU_FLOPS_PER_WIRE_BYTE = 16.0


# -- reference -------------------------------------------------------------------------------

def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
                          kv_positions: jax.Array, q_segment_ids: jax.Array | None = None,
                          kv_segment_ids: jax.Array | None = None, causal: bool | None = None,
                          sliding_window: int | None = None, mask: Mask | None = None,
                          scale: float | None = None, logits_soft_cap: float | None = None,
                          sinks: jax.Array | None = None,
                          score_mod: ScoreMod | None = None,
                          kv_heads_major: bool = False) -> jax.Array:
    """Unsharded reference attention. q [B,L,N,H], k [B,S,K,H], v [B,S,K,Hv] -> [B,L,N,Hv].

    Computes in fp32 with the dense mask; rows that see no key (padding, segment 0) are exactly
    zero with zero gradient, never NaN. ``scale`` defaults to H**-0.5. ``kv_heads_major``: k
    and v are laid out [B,K,S,H] and [B,K,S,Hv] instead (a decode cache: both products are
    then plain batched matmuls over each kv head's keys, with no transpose of the keys).
    """
    B, L, N, H = q.shape
    kv = "bksh" if kv_heads_major else "bskh"
    if kv_heads_major:
        _check_shapes(q, *(jax.ShapeDtypeStruct(tuple(a.shape[i] for i in (0, 2, 1, 3))
                                                if a.ndim == 4 else a.shape, a.dtype)
                           for a in (k, v)), q_positions, kv_positions, q_segment_ids,
                      kv_segment_ids, sliding_window, logits_soft_cap, sinks, score_mod)
    else:
        _check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                      sliding_window, logits_soft_cap, sinks, score_mod)
    K = k.shape[1 if kv_heads_major else 2]
    G = N // K
    scores = Scores(default_mask(causal, sliding_window, mask),
                    H ** -0.5 if scale is None else float(scale), logits_soft_cap, score_mod)
    qseg = jnp.ones((B, L), jnp.int32) if q_segment_ids is None else q_segment_ids
    kseg = jnp.ones(kv_positions.shape, jnp.int32) if kv_segment_ids is None else kv_segment_ids
    with jax.named_scope("dot_product_attention"):
        visible = attention_mask(q_positions, kv_positions, qseg, kseg, mask=scores.mask)
        # q [B, K, L, G, H] and logits [B, K, L, G, S]: the matmul's own order (batch, lhs
        # free, rhs free), so only q (small) is transposed, never the keys or the logits,
        # which matters in a decode step (L = 1, S large)
        qg = jnp.swapaxes(q.astype(jnp.float32).reshape(B, L, K, G, H), 1, 2)
        s = jnp.einsum(f"bkmh,{kv}->bkms", qg.reshape(B, K, L * G, H), k.astype(jnp.float32))
        s = s.reshape(B, K, L, G, -1) * scores.scale
        tokens = (q_positions[:, None, :, None, None], kv_positions[:, None, None, None, :],
                  qseg[:, None, :, None, None], kseg[:, None, None, None, :])
        s = scores.modify(s, *tokens, jnp.arange(N).reshape(1, K, 1, G, 1))
        s = jnp.where(visible[:, None, :, None], s, -jnp.inf)
        if sinks is not None:  # the sink: one more logit per head in the softmax, no value
            sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, 1, G, 1),
                                    (B, K, L, G, 1))
            s = jnp.concatenate([s, sink], axis=-1)
        # max over visible keys; a fully masked row has max -inf, replaced by 0 so exp gives 0
        mx = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        p = jnp.exp(s - mx)  # exp(-inf) = 0 on masked entries, and its gradient is 0 too
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        if sinks is not None:
            p = p[..., :-1]
        out = jnp.einsum(f"bkms,{kv}->bkmh", p.reshape(B, K, L * G, -1), v.astype(jnp.float32))
        out = jnp.swapaxes(out.reshape(B, K, L, G, -1), 1, 2)
        return out.reshape(B, L, N, v.shape[-1]).astype(q.dtype)


# -- validation ------------------------------------------------------------------------------

def _check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  sliding_window, logits_soft_cap=None, sinks=None, score_mod=None):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects q [B,L,N,H], k [B,S,K,H], v [B,S,K,Hv]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    B, L, N, H = q.shape
    Bk, S, K, Hk = k.shape
    if Bk != B or v.shape[:3] != k.shape[:3] or Hk != H:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B={B}, S, K, H={H}] and "
                         f"[B={B}, S, K, Hv] to match q {q.shape}")
    resolve(None).check_heads(N, K, what="attention")  # grouped-query: N a multiple of K
    for name, x, n in (("q_positions", q_positions, L), ("kv_positions", kv_positions, S),
                       ("q_segment_ids", q_segment_ids, L),
                       ("kv_segment_ids", kv_segment_ids, S)):
        if x is not None and tuple(x.shape) != (B, n):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected "
                             f"({'B, L' if name[0] == 'q' else 'B, S'}) = ({B}, {n})")
        if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers (int32), got {x.dtype}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither (one document, "
                         "no padding)")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int or None")
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float))
                                            and logits_soft_cap > 0):
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be a positive number "
                         f"(logits become cap * tanh(logits / cap)) or None")
    if sinks is not None and tuple(sinks.shape) != (N,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; expected [num_heads] = ({N},), "
                         f"one logit per query head")
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise ValueError(f"score_mod={score_mod!r} must be a zoo.ops.ScoreMod(fn) with "
                         f"fn(score, q_pos, kv_pos, q_seg, kv_seg, head) -> score")


def choose_implementation(*, partitioner: Partitioner | None, q_length: int, kv_length: int,
                          num_heads: int, num_kv_heads: int, head_dim: int,
                          v_head_dim: int | None = None) -> str:
    """What ``implementation="auto"`` runs: ``"all_gather"`` or ``"ring"``.

    Without sequence sharding both are the same local flash kernel (no collective); we name it
    ``"all_gather"``. With ``cp`` shards: ``"all_gather"`` when the whole K/V is no larger than
    the local queries (``S * K * (H + Hv) <= L/cp * N * H``: grouped-query attention with few kv
    heads and moderate cp, Llama-3 style), because then it is one gather and one reduce-scatter
    per layer instead of ``cp`` dependent ring steps, with the same bytes moved; ``"ring"``
    otherwise (MHA, MLA's per-head K/V, large cp), where a gather would have to be sliced into
    ``cp``-ish pieces to keep memory ~1/cp and the ring's neighbour-only exchange is the better
    fit. "The whole K/V" is the *expanded* per-head K/V, also for MLA, whose latent is what
    crosses the wire: both strategies move the same latent bytes, but each shard expands what
    it holds, so a gather that is not one piece is sliced (`zoo.ops.ring.gather_slices`) into
    dependent steps that are narrower than the ring's pieces. (Choosing by the latent's size
    picked a 32-slice gather for the mini DeepSeek-V3 under EP-as-CP, 2.6x slower than the
    ring.)
    """
    p = resolve(partitioner)
    cp = p.context_size("attention")
    if cp == 1:
        return "all_gather"
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    gathered = kv_length * num_kv_heads * (head_dim + v_head_dim)
    local_q = q_length // cp * num_heads * head_dim
    return "all_gather" if gathered <= local_q else "ring"


def choose_mla_wire(*, partitioner: Partitioner | None, kv_lora_rank: int, num_heads: int,
                    qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                    itemsize: int) -> str:
    """What MLA's ``kv_wire="auto"`` sends under context parallelism: ``"latent"`` or
    ``"expanded"``.

    Each token a shard receives costs, with the latent on the wire, its expansion by
    ``kv_b_proj`` on that shard (``2 R N (Hn + Hv)`` FLOPs forward, twice that backward) and ``R
    + Hr`` values each way; expanded, it costs no FLOPs there but ``N (Hn + Hr + Hv)`` values
    each way. Without sequence shards nothing crosses and it is ``"latent"`` (the same program
    as before the choice existed). On CPU meshes the choice is ``"expanded"`` when the FLOPs
    saved exceed `CPU_FLOPS_PER_WIRE_BYTE` times the bytes added (the mini DeepSeek-V3: 44 FLOPs
    a byte in fp32, so expanded; one layer's forward and backward under EP-as-CP, fsdp=2 x
    expert=4, 8 x 512 tokens, ring: 609 ms latent, 544 ms expanded, measured once on a loaded
    2-core box; the 16 is an estimate, not yet a measured all-gather rate). On TPU and GPU
    meshes it stays ``"latent"``: at DeepSeek-V3's dims the expanded K/V is 71x the latent in
    every ring piece and gather slice a step holds, and no chip measurement says the FLOPs saved
    (623 a byte in bf16) pay for it.
    """
    p = resolve(partitioner)
    if p.context_size("attention") == 1 or p.platform != "cpu":
        return "latent"
    R, N, Hr = kv_lora_rank, num_heads, qk_rope_head_dim
    flops = 3 * 2 * R * N * (qk_nope_head_dim + v_head_dim)
    added = 2 * (N * (qk_nope_head_dim + Hr + v_head_dim) - (R + Hr)) * itemsize
    return "expanded" if flops > CPU_FLOPS_PER_WIRE_BYTE * added else "latent"


# -- entry points ----------------------------------------------------------------------------

def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_positions: jax.Array, q_segment_ids: jax.Array | None = None,
              kv_segment_ids: jax.Array | None = None, causal: bool | None = None,
              sliding_window: int | None = None, mask: Mask | None = None,
              scale: float | None = None, logits_soft_cap: float | None = None,
              sinks: jax.Array | None = None, score_mod: ScoreMod | None = None,
              partitioner: Partitioner | None = None, implementation: str = "auto",
              kernel: str | BlockKernel = "auto", split: int = 2,
              layout: str | None = None, rounds: int | None = None) -> jax.Array:
    """Attention of q [B,L,N,H] over k [B,S,K,H], v [B,S,K,Hv] -> [B,L,N,Hv] in q's dtype.

    Same semantics as `dot_product_attention` (masks from positions/segment ids, segment 0 =
    padding -> zero rows, no NaN, fp32 softmax); see the module docstring for the strategies
    and kernels. ``split``: sub-blocks per side that the strategies classify (empty / full /
    partial) per block. Any order of the sequence is correct; the load-balanced order (shard r
    holds chunks r and 2*cp-1-r of 2*cp) makes the causal work even across shards.

    ``layout`` (opt-in) states how the sequence lies on the context shards: ``"contiguous"``
    (shard r holds tokens [r*n, (r+1)*n)), ``"balanced"`` (the load-balanced order above) or
    None (unknown, the default). With a layout and a mask whose `zoo.ops.masks.Reach` bounds
    the sequence distance (e.g. ``SlidingWindow(w) & Causal() & Document()``), the ring moves
    only the blocks some query can see (`zoo.ops.ring.hop_plan`). That needs positions that
    strictly increase along the sequence within each document (packed rows, in that layout);
    the op checks it per batch and runs the full ring where it fails, so any input is exact.

    ``rounds``: how many rounds the full ring makes, each streaming 1/rounds of every shard's
    keys (less memory, the same bytes; key sub-blocks are then at most S/cp/rounds long); None
    picks it from the shapes (`zoo.ops.ring.ring_rounds`). It must divide the local kv length.
    """
    _check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  sliding_window, logits_soft_cap, sinks, score_mod)
    m = default_mask(causal, sliding_window, mask)
    reference = functools.partial(
        dot_product_attention, q, k, v, q_positions=q_positions, kv_positions=kv_positions,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, mask=m, scale=scale,
        logits_soft_cap=logits_soft_cap, sinks=sinks, score_mod=score_mod)
    H = q.shape[-1]
    K, Hv = v.shape[2:]
    return _run(reference, q, (k, v), (), None, q_positions, kv_positions, q_segment_ids,
                kv_segment_ids, m, scale, logits_soft_cap, sinks, score_mod, partitioner,
                implementation, kernel, split, layout, rounds, num_kv_heads=K, head_dim=H,
                v_head_dim=Hv)


def mla_attention(q: jax.Array, latent: jax.Array, k_pe: jax.Array, kv_up: jax.Array, *,
                  qk_nope_head_dim: int, q_positions: jax.Array, kv_positions: jax.Array,
                  q_segment_ids: jax.Array | None = None,
                  kv_segment_ids: jax.Array | None = None, causal: bool | None = None,
                  sliding_window: int | None = None, mask: Mask | None = None,
                  scale: float | None = None, logits_soft_cap: float | None = None,
                  sinks: jax.Array | None = None, score_mod: ScoreMod | None = None,
                  partitioner: Partitioner | None = None, implementation: str = "auto",
                  kernel: str | BlockKernel = "auto", split: int = 2,
                  layout: str | None = None, rounds: int | None = None,
                  fp8: str | None = None) -> jax.Array:
    """Multi-head latent attention with the latent on the wire.

    q [B,L,N,Hn+Hr] (rotated), latent [B,S,R] (normalised), k_pe [B,S,Hr] (rotated, shared by
    every head), kv_up [R, N, Hn+Hv] (``kv_b_proj``'s kernel; with FP8 also its
    `zoo.ops.fp8.prequantize` as ``[R, N*(Hn+Hv)]``, whose FP8 copy each shard then uses
    instead of quantising the kernel again) -> [B,L,N,Hv]. Per head,
    ``k = concat(latent @ kv_up[..., :Hn], k_pe)`` and ``v = latent @ kv_up[..., Hn:]``; under
    context parallelism only (latent, k_pe) -- R + Hr values per token instead of
    N * (Hn + Hr + Hv) -- cross the wire, and each shard expands what it receives.
    ``layout``, ``rounds``: as in `attention` (the ring's static hop plan, its rounds).
    ``fp8="blockwise"``: the expansion is `zoo.ops.fp8.dot` (the scores do not change).
    """
    _, _, N, Hqk = q.shape
    R = latent.shape[-1]
    Hn, Hr = qk_nope_head_dim, k_pe.shape[-1]
    fp8 = fp8_ops.check_mode(fp8, what="mla_attention(fp8=)")
    pre = isinstance(kv_up, fp8_ops.QuantizedWeight)
    if pre and (fp8 != "blockwise" or kv_up.w.ndim != 2 or kv_up.w.shape[1] % N):
        raise ValueError(f"mla_attention: a prequantized kv_up (zoo.ops.fp8.QuantizedWeight) "
                         f"needs fp8='blockwise' (got {fp8!r}) and w [R, N*(Hn+Hv)] with N={N} "
                         f"(got {kv_up.w.shape}); pass the kernel [R, N, Hn+Hv] otherwise")
    kv_shape = (R, N, kv_up.w.shape[1] // N) if pre else kv_up.shape
    if (latent.ndim != 3 or k_pe.ndim != 3 or latent.shape[:2] != k_pe.shape[:2]
            or kv_shape[:2] != (R, N) or Hn + Hr != Hqk or kv_shape[2] <= Hn):
        raise ValueError(f"mla_attention expects q [B,L,N,Hn+Hr], latent [B,S,R], k_pe "
                         f"[B,S,Hr], kv_up [R,N,Hn+Hv] with Hn=qk_nope_head_dim={Hn}; got "
                         f"{q.shape}, {latent.shape}, {k_pe.shape}, {kv_shape}")
    if pre and _straddles(partitioner, kv_up.w.shape[1]):
        kv_up = kv_up.w.reshape(kv_shape)  # quantised per shard, as without the FP8 copy
    expand = functools.partial(_mla_expand, Hn, fp8, kv_shape[2])
    k, v = jax.eval_shape(expand, (kv_up,), (latent, k_pe))
    _check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  sliding_window, logits_soft_cap, sinks, score_mod)
    m = default_mask(causal, sliding_window, mask)

    def reference():
        k, v = expand((kv_up,), (latent, k_pe))
        return dot_product_attention(
            q, k, v, q_positions=q_positions, kv_positions=kv_positions,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, mask=m, scale=scale,
            logits_soft_cap=logits_soft_cap, sinks=sinks, score_mod=score_mod)

    return _run(reference, q, (latent, k_pe), (kv_up,), expand, q_positions, kv_positions,
                q_segment_ids, kv_segment_ids, m, scale, logits_soft_cap, sinks, score_mod,
                partitioner, implementation, kernel, split, layout, rounds, num_kv_heads=N,
                head_dim=Hqk, v_head_dim=v.shape[-1])


def _straddles(partitioner: Partitioner | None, columns: int) -> bool:
    """Whether the shard_map that splits heads cuts a prequantized kv_up's ``columns``
    (``N*(Hn+Hv)``) inside a 128-column block: each shard then quantises its own columns (a
    block may not straddle two shards), so the FP8 copy cannot cross."""
    p = resolve(partitioner)
    tp = p.axis_size(p.mesh_axes("act_heads", "attention")) if p.mesh is not None else 1
    return tp > 1 and not fp8_ops.whole_blocks(columns, tp)


def _mla_expand(qk_nope_head_dim, fp8, width, params, payload):
    """(kv_up,), (latent [B,S,R], k_pe [B,S,Hr]) -> k [B,S,N,Hn+Hr], v [B,S,N,Hv]; `width`:
    Hn+Hv (a prequantized kv_up is [R, N*(Hn+Hv)])."""
    (kv_up,), (latent, k_pe) = params, payload
    if isinstance(kv_up, fp8_ops.QuantizedWeight):
        kv = fp8_ops.dot(latent, kv_up).astype(latent.dtype)
        kv = kv.reshape(*latent.shape[:2], -1, width)
    elif fp8 == "blockwise":
        r, n, d = kv_up.shape
        kv = fp8_ops.dot(latent, kv_up.reshape(r, n * d)).astype(latent.dtype)
        kv = kv.reshape(*latent.shape[:2], n, d)
    else:
        kv = jnp.einsum("bsr,rnd->bsnd", latent, kv_up.astype(latent.dtype))
    k_nope, v = kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:]
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], k_pe.shape[-1]))
    return jnp.concatenate([k_nope, k_pe.astype(k_nope.dtype)], axis=-1), v


def _run(reference, q, payload, params, expand, qpos, kpos, qseg, kseg, mask, scale, soft_cap,
         sinks, score_mod, partitioner, implementation, kernel, split, layout, rounds, *,
         num_kv_heads, head_dim, v_head_dim):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; valid values are "
                         f"{', '.join(repr(i) for i in IMPLEMENTATIONS)} (block kernels are "
                         f"chosen with kernel=...)")
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"split={split!r} must be a positive int (sub-blocks per side)")
    if layout not in _ring.LAYOUTS:
        raise ValueError(f"layout={layout!r}; valid values are {_ring.LAYOUTS}: how the "
                         f"sequence lies on the context shards (None: not known)")
    p = resolve(partitioner)
    kern = get_kernel("flash" if kernel == "auto" and score_mod is not None else kernel,
                      p.platform, p.target_device)  # a ScoreMod's VJP is taken in JAX
    if implementation == "reference":
        return reference()
    B, L, N, H = q.shape
    S = kpos.shape[1]
    for name, n in (("query length", L), ("kv length", S)):  # any order of the tokens is exact
        p.check_sequence(n, name=name, balanced=layout == "balanced")
    p.check_heads(N, num_kv_heads)
    if implementation == "auto":
        implementation = choose_implementation(
            partitioner=p, q_length=L, kv_length=S, num_heads=N, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim)
    if qseg is None:  # one document, no padding
        qseg, kseg = jnp.ones((B, L), jnp.int32), jnp.ones((B, S), jnp.int32)
    scores = Scores(mask, H ** -0.5 if scale is None else float(scale),
                    None if soft_cap is None else float(soft_cap), score_mod)
    cfg = _ring.Config(implementation, (), scores, kern, expand, split, sinks is not None)
    sinks = jnp.zeros((N,), jnp.float32) if sinks is None else sinks
    tokens = tuple(x.astype(jnp.int32) for x in (qpos, kpos, qseg, kseg))
    cp = p.context_size("attention")
    if rounds is not None and (not isinstance(rounds, int) or rounds < 1
                               or (S // cp) % rounds):
        raise ValueError(f"rounds={rounds!r} must be a positive int dividing the local kv "
                         f"length {S // cp} (kv length {S} over {cp} context shards); None "
                         f"picks it (zoo.ops.ring.ring_rounds)")
    hops = (_ring.hop_plan(mask.reach(), layout, cp, L)
            if implementation == "ring" and L == S and p.mesh is not None else None)
    # the plan's assumption, checked on the whole batch (one scalar all devices agree on)
    ok = (_ring.sequence_order_ok(layout, cp, *tokens) if hops is not None
          else jnp.ones((), bool))
    cfg = dataclasses.replace(cfg, hops=hops, rounds=rounds, platform=p.platform)
    return _sharded(cfg, p, q, payload, params, sinks, ok, *tokens, plain=expand is None)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _layout(p: Partitioner, B: int, K: int):
    """(batch axes, sequence axes, head axes, kv repeat factor) for shard_map."""
    batch_axes = p.batch_axes("attention")
    while batch_axes and B % p.axis_size(batch_axes):  # largest prefix that divides B
        batch_axes = batch_axes[:-1]
    head_axes = p.mesh_axes("act_heads", "attention")
    tp = p.axis_size(head_axes)
    repeat = tp // K if K % tp else 1
    return batch_axes, p.sequence_axes("attention"), head_axes, repeat


def _unit_axes(mesh, *named: tuple[str, ...]) -> tuple[str, ...]:
    """The size-1 mesh axes no spec names. `shard_map`'s transpose psums each input's
    cotangent over the axes its spec leaves out; over a size-1 axis that is an all-reduce over
    one device, which XLA:CPU keeps -- and it writes dq, dk and dv into fresh buffers. Named
    in a spec (a no-op split), they are not summed."""
    used = {a for axes in named for a in axes}
    return tuple(a for a in mesh.axis_names if mesh.shape[a] == 1 and a not in used)


def _param_spec(w, unit, h):
    if isinstance(w, fp8_ops.QuantizedWeight):
        return fp8_ops.QuantizedWeight(P(unit, h), P(unit, h), P(unit, h), P())
    return P(unit, h, None)


def _sharded(cfg, p: Partitioner, q, payload, params, sinks, ok, qpos, kpos, qseg, kseg, *,
             plain):
    batch_axes, seq_axes, head_axes, repeat = _layout(p, q.shape[0], q.shape[2] if not plain
                                                      else payload[0].shape[2])
    if plain and repeat > 1:  # fewer kv heads than tensor shards: each shard gets its copy
        payload = tuple(jnp.repeat(x, repeat, axis=2) for x in payload)
    if p.mesh is None:
        return _ring.attend_shard(q, payload, params, sinks, ok, qpos, kpos, qseg, kseg,
                                  cfg=cfg)
    cfg = dataclasses.replace(cfg, axes=tuple(seq_axes))
    unit = _unit_axes(p.mesh, tuple(batch_axes), tuple(seq_axes), tuple(head_axes))
    b, s, h = _entry((*batch_axes, *unit)), _entry(seq_axes), _entry(head_axes)
    act, tok = P(b, s, h, None), P(b, s)
    # MLA: the latent and rotary key are not split by head; kv_up is [R, N, Hn+Hv]
    pay_specs = (act, act) if plain else (P(b, s, None), P(b, s, None))
    par_specs = tuple(_param_spec(w, _entry(unit), h) for w in params)
    sink_spec = P(_entry((*head_axes, *unit)))
    local = functools.partial(_ring.attend_shard, cfg=cfg)
    with jax.named_scope(f"attention_{cfg.strategy}"):
        return jax.shard_map(local, mesh=p.mesh,
                             in_specs=(act, pay_specs, par_specs, sink_spec, P(), tok, tok,
                                       tok, tok),
                             out_specs=act, check_vma=False)(
            q, payload, params, sinks, ok, qpos, kpos, qseg, kseg)
