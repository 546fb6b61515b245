"""Dot-product attention: the unsharded reference and the context-parallel entry point.

* `dot_product_attention` -- the plain reference: dense fp32 logits [B, N, L, S], masks from
  positions and segment ids only (`zoo.ops.masks`), exact zeros for padding rows.
* `attention` -- the same function for real use: ``implementation`` is ``"reference"``,
  ``"all_gather"`` (gather K/V over the sequence shards, local Q attends), ``"ring"`` (rotate
  K/V around the sequence shards with `ppermute`, fp32 online-softmax merge, empty blocks
  skipped), ``"cudnn"`` (GPU, contiguous causal/windowed masks without packing) or ``"auto"``.
  It runs under `jax.shard_map` over the partitioner's attention batch, sequence and head axes;
  inputs of any sharding are resharded by the (Auto-axis) mesh. Gradients come from a
  flash-style `custom_vjp` (see `zoo.ops.flash` and `zoo.ops.ring`).

Head layout (Hugging Face convention): query head n uses kv head n // (N // K).

Legend: B batch, L query length, S kv length, N query heads, K kv heads, G = N // K query heads
per kv head, H q/k head dim, Hv value head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zoo.ops import ring as _ring
from zoo.ops.masks import attention_mask
from zoo.partitioning import Partitioner, resolve

IMPLEMENTATIONS = ("auto", "reference", "all_gather", "ring", "cudnn")


# -- reference -------------------------------------------------------------------------------

def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
                          kv_positions: jax.Array, q_segment_ids: jax.Array | None = None,
                          kv_segment_ids: jax.Array | None = None, causal: bool = True,
                          sliding_window: int | None = None,
                          scale: float | None = None) -> jax.Array:
    """Unsharded reference attention. q [B,L,N,H], k [B,S,K,H], v [B,S,K,Hv] -> [B,L,N,Hv].

    Computes in fp32 with the dense mask; rows that see no key (padding, segment 0) are exactly
    zero with zero gradient, never NaN. ``scale`` defaults to H**-0.5.
    """
    B, L, N, H = q.shape
    K = k.shape[2]
    _check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  sliding_window)
    scale = H ** -0.5 if scale is None else scale
    with jax.named_scope("dot_product_attention"):
        mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                              causal=causal, sliding_window=sliding_window)  # [B, L, S]
        qg = q.astype(jnp.float32).reshape(B, L, K, N // K, H)
        s = jnp.einsum("blkgh,bskh->bkgls", qg, k.astype(jnp.float32)) * scale
        m = mask[:, None, None]
        s = jnp.where(m, s, -jnp.inf)
        # max over visible keys; a fully masked row has max -inf, replaced by 0 so exp gives 0
        mx = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        p = jnp.exp(s - mx)  # exp(-inf) = 0 on masked entries, and its gradient is 0 too
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        out = jnp.einsum("bkgls,bskh->blkgh", p, v.astype(jnp.float32))
        return out.reshape(B, L, N, v.shape[-1]).astype(q.dtype)


# -- validation ------------------------------------------------------------------------------

def _check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  sliding_window):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects q [B,L,N,H], k [B,S,K,H], v [B,S,K,Hv]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    B, L, N, H = q.shape
    Bk, S, K, Hk = k.shape
    if Bk != B or v.shape[:3] != k.shape[:3] or Hk != H:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B={B}, S, K, H={H}] and "
                         f"[B={B}, S, K, Hv] to match q {q.shape}")
    if N % K:
        raise ValueError(f"num_heads N={N} must be a multiple of num_kv_heads K={K} "
                         f"(grouped-query attention); choose K among the divisors of {N}")
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


def check_attention_shapes(*, partitioner: Partitioner | None, batch: int, q_length: int,
                           kv_length: int, num_heads: int, num_kv_heads: int) -> None:
    """Raise `ValueError` (numbers and fix) if these shapes cannot be sharded by `partitioner`.

    Layers call this at construction with their ``inputs_shape``; `attention` calls it at trace
    time. Rules: the sequence axes' size ``cp`` divides both lengths; the attention tensor axis
    size ``tp`` divides ``num_heads``; ``num_kv_heads`` is a multiple of ``tp`` or divides it
    (then each kv head is repeated ``tp // num_kv_heads`` times so every tensor shard holds the
    one it needs). The batch is sharded over the largest prefix of the attention batch axes
    whose size divides it (the rest replicate the work), so any batch size is accepted.
    """
    p = resolve(partitioner)
    cp = p.axis_size(p.sequence_axes("attention"))
    for name, n in (("query length", q_length), ("kv length", kv_length)):
        if n % cp:
            raise ValueError(
                f"{name} {n} is not divisible by the attention sequence shards "
                f"{p.sequence_axes('attention')} of size {cp}; pad the sequence to "
                f"{-(-n // (2 * cp)) * 2 * cp} (a multiple of 2*cp for load balancing) or use "
                f"a smaller context/expert axis")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}; choose num_kv_heads among the divisors of {num_heads}")
    tp = p.axis_size(p.mesh_axes("act_heads", "attention"))
    if num_heads % tp:
        raise ValueError(f"num_heads={num_heads} is not divisible by the tensor axis size {tp}; "
                         f"use a tensor axis that divides {num_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} and the tensor axis size {tp} must divide "
                         f"one another (kv heads are split over, or repeated across, the tensor "
                         f"shards); change num_kv_heads or the tensor axis")


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
    fit. On the 8-device CPU of the tests the two run within ~20% of each other either way.
    """
    p = resolve(partitioner)
    cp = p.axis_size(p.sequence_axes("attention"))
    if cp == 1:
        return "all_gather"
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    gathered = kv_length * num_kv_heads * (head_dim + v_head_dim)
    local_q = q_length // cp * num_heads * head_dim
    return "all_gather" if gathered <= local_q else "ring"


# -- entry point -----------------------------------------------------------------------------

def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_positions: jax.Array, q_segment_ids: jax.Array | None = None,
              kv_segment_ids: jax.Array | None = None, causal: bool = True,
              sliding_window: int | None = None, scale: float | None = None,
              partitioner: Partitioner | None = None, implementation: str = "auto") -> jax.Array:
    """Attention of q [B,L,N,H] over k [B,S,K,H], v [B,S,K,Hv] -> [B,L,N,Hv] in q's dtype.

    Same semantics as `dot_product_attention` (masks from positions/segment ids, segment 0 =
    padding -> zero rows, no NaN, fp32 softmax); see the module docstring for the
    implementations. Any order of the sequence is correct; the load-balanced order (shard r
    holds chunks r and 2*cp-1-r of 2*cp) makes the causal work even across shards.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; valid values are "
                         f"{', '.join(repr(i) for i in IMPLEMENTATIONS)}")
    _check_shapes(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  sliding_window)
    kw = dict(causal=causal, sliding_window=sliding_window, scale=scale)
    if implementation == "reference":
        return dot_product_attention(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                                     q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                     **kw)
    B, L, N, H = q.shape
    _, S, K, Hv = v.shape
    p = resolve(partitioner)
    check_attention_shapes(partitioner=p, batch=B, q_length=L, kv_length=S, num_heads=N,
                           num_kv_heads=K)
    if implementation == "cudnn":
        return _cudnn(q, k, v, q_segment_ids, kv_segment_ids, p, **kw)
    if implementation == "auto":
        implementation = choose_implementation(partitioner=p, q_length=L, kv_length=S,
                                               num_heads=N, num_kv_heads=K, head_dim=H,
                                               v_head_dim=Hv)
    if q_segment_ids is None:  # one document, no padding
        q_segment_ids = jnp.ones((B, L), jnp.int32)
        kv_segment_ids = jnp.ones((B, S), jnp.int32)
    scale = H ** -0.5 if scale is None else float(scale)
    return _sharded(q, k, v, q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32),
                    q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32), p,
                    strategy=implementation, causal=causal, sliding_window=sliding_window,
                    scale=scale)


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


def _sharded(q, k, v, qpos, kpos, qseg, kseg, p: Partitioner, *, strategy, causal,
             sliding_window, scale):
    batch_axes, seq_axes, head_axes, repeat = _layout(p, q.shape[0], k.shape[2])
    if repeat > 1:  # fewer kv heads than tensor shards: each shard gets a copy of its kv head
        k = jnp.repeat(k, repeat, axis=2)
        v = jnp.repeat(v, repeat, axis=2)
    local = functools.partial(_ring.attend_shard, strategy=strategy, axes=seq_axes,
                              causal=causal, sliding_window=sliding_window, scale=scale)
    if p.mesh is None:
        return local(q, k, v, qpos, kpos, qseg, kseg)
    b, s, h = _entry(batch_axes), _entry(seq_axes), _entry(head_axes)
    act, tok = P(b, s, h, None), P(b, s)
    with jax.named_scope(f"attention_{strategy}"):
        return jax.shard_map(local, mesh=p.mesh, in_specs=(act, act, act, tok, tok, tok, tok),
                             out_specs=act, check_vma=False)(q, k, v, qpos, kpos, qseg, kseg)


def _cudnn(q, k, v, q_segment_ids, kv_segment_ids, p: Partitioner, *, causal, sliding_window,
           scale):
    """cuDNN fused attention (GPU) via `jax.nn.dot_product_attention`.

    cuDNN builds its mask from array indices, so this path *assumes* q and kv positions are
    0..L-1 in order (they are not read) and accepts no segment ids (no packing, no padding),
    no sequence sharding, and equal q/v head dims. Batch and heads are sharded as elsewhere.
    """
    if jax.default_backend() != "gpu":
        raise ValueError(f'implementation="cudnn" needs a GPU backend, this is '
                         f'{jax.default_backend()!r}; use "auto", "ring" or "all_gather"')
    if q_segment_ids is not None:
        raise ValueError('implementation="cudnn" supports only unpacked, unpadded sequences '
                         '(segment ids None); packed documents need "ring" or "all_gather"')
    cp = p.axis_size(p.sequence_axes("attention"))
    if cp > 1:
        raise ValueError(f'implementation="cudnn" cannot run with the sequence sharded {cp} '
                         f'ways; use "ring" or "all_gather" for context parallelism')
    if q.shape[1] != k.shape[1]:
        raise ValueError(f'implementation="cudnn" needs q and kv of equal length, got '
                         f'{q.shape[1]} and {k.shape[1]}')
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f'implementation="cudnn" needs bfloat16 or float16 inputs, got '
                         f'{q.dtype}; cast q, k and v or use "auto"')
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f'implementation="cudnn" needs the value head dim ({v.shape[-1]}) to '
                         f'equal the query/key head dim ({q.shape[-1]}) -- not MLA; use "auto"')
    # our window: q - k < W, one-sided; cuDNN's (left, right) counts tokens on each side
    window = None if sliding_window is None else (sliding_window - 1,
                                                  0 if causal else k.shape[1])

    def local(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                            local_window_size=window, implementation="cudnn")

    if p.mesh is None:
        return local(q, k, v)
    batch_axes, _, head_axes, repeat = _layout(p, q.shape[0], k.shape[2])
    if repeat > 1:
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    spec = P(_entry(batch_axes), None, _entry(head_axes), None)
    return jax.shard_map(local, mesh=p.mesh, in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=False)(q, k, v)

