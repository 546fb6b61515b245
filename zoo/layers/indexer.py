"""`Indexer`: DeepSeek-V3.2's lightning indexer, which scores every key for every query.

Follows Hugging Face ``DeepseekV32Indexer`` (attribute names match its checkpoint keys, so the
module sits under ``indexer`` in MLA's keys):

* queries from MLA's query latent (``q_a_layernorm(q_a_proj(x))``): ``wq_b`` Rq -> (N, H);
* one key per token shared by all index heads: ``wk`` D -> H, then ``k_norm`` (a `LayerNorm`
  with bias, eps 1e-6);
* RoPE on the *leading* Hr dims of each query and key head, in the half-split
  (non-interleaved) layout -- unlike MLA, which rotates its trailing Hr dims interleaved; the
  angles (and YaRN's frequencies and cos/sin factor) are MLA's (``rope_interleaved=True``:
  the interleaved layout, as GLM-5's ``GlmMoeDsaIndexer``);
* per-head weights ``weights_proj`` D -> N (in float32, as transformers keeps it), times
  ``N**-0.5``;
* ``score[b, l, s] = sum_n w[b, l, n] * relu(H**-0.5 * q[b, l, n] . k[b, s])`` in float32,
  ``-inf`` where the mask (default ``Causal() & Document()``, padding excluded) hides the key.

`topk` turns scores into the selection (array indices, ``-1`` for an empty slot) that
`zoo.ops.sparse_attention` reads; `select` is both, under ``stop_gradient`` (the selection is
discrete: no gradient reaches the indexer through it), in bounded memory (`select_keys`): the
queries in chunks (a `jax.lax.map`), the keys of a chunk in blocks whose per-head scores are
summed over the heads at once, so [chunk, N, block] and [chunk, S] float32 live at a time, never
[L, N, S]; a block no query of the chunk may see (the causal upper triangle, other documents) is
not scored. The indices are `topk`'s exactly. Under context parallelism `select` runs
under `jax.shard_map` over the attention sequence axes: each shard all-gathers the index keys
(H values per token) with their positions and segment ids -- that is all that crosses the
wire -- and scores its own queries against every key of the row, so the top-k is global and,
with the position-based tie rule, identical to the unsharded one for any token order
(`zoo.data.load_balance`); the indices name places in the whole row. Hugging Face's Hadamard
rotation and FP8 scoring are omitted as transformers omits them (an orthogonal rotation
preserves the dot products).

Training the indexer (DeepSeek-V3.2 report, section 2.1; `zoo.layers.MLA`'s ``index_stage``):
`distillation_loss` is the per-query ``KL(p_attn || softmax(I))`` where ``p_attn`` is the main
attention's distribution summed over heads and L1-renormalised over the keys (the target,
under ``stop_gradient``) and ``I`` the index scores over the same keys -- every causal key of
the document in the dense warm-up, only the selected keys in the sparse stage (scored by
`Indexer.score_selected` on the gathered keys). `distillation_kl` is the same per query, so
context-parallel shards and query chunks sum their parts (`zoo.layers.MLA.distillation`). MLA
sows it as an `IndexerLoss`, which the model collects.

Legend: B batch, L queries, S keys, D embed, Rq q_lora_rank, N index heads, H index head dim,
Hr rotary dims, k selected keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.layers import hf_keys as hfk
from zoo.layers.linear import Linear
from zoo.layers.rope import RoPE
from zoo.ops.compressed_attention import lexsort_stable
from zoo.ops.masks import Causal, Document, Mask, attention_mask
from zoo.ops.sparse_attention import choose_query_chunk, map_query_chunks
from zoo.partitioning import Partitioner, resolve


# MLA's ``index_stage``: "off" (the sparse forward, no indexer loss), "warmup" (dense forward,
# the indexer learns the attention's distribution), "sparse" (sparse forward, both learn)
INDEX_STAGES = ("off", "warmup", "sparse")

# `Indexer.select_keys`'s bounds: keys scored per step of a chunk (its per-head scores are
# [chunk, N, KEY_BLOCK] float32), and the 32-bit values a chunk of queries may hold per row
# (per query: N * key_block head scores plus about SORT_VALUES * S for the head-summed row and
# the top-k sort's operands and results) -- 256 MiB; at DeepSeek-V3.2's 64 heads and 131,072
# keys a chunk of 32 queries
KEY_BLOCK = 2048
SELECT_VALUES = 1 << 26
SORT_VALUES = 8


def check_chunks(query_chunk, key_block) -> None:
    """`Indexer.select`'s ``query_chunk`` (a positive int, ``"auto"`` or None) and
    ``key_block`` (a positive int or ``"auto"``)."""
    if query_chunk not in ("auto", None) and (isinstance(query_chunk, bool) or not isinstance(
            query_chunk, int) or query_chunk < 1):
        raise ValueError(f"Indexer.select: query_chunk={query_chunk!r} must be a positive int "
                         f"dividing the queries, 'auto' (bounded memory) or None (all at once)")
    if key_block != "auto" and (isinstance(key_block, bool) or not isinstance(key_block, int)
                                or key_block < 1):
        raise ValueError(f"Indexer.select: key_block={key_block!r} must be a positive int (keys "
                         f"scored per step) or 'auto' ({KEY_BLOCK})")


class IndexerLoss(nnx.Intermediate):
    """An indexer's distillation loss (`distillation_loss`), sown by `zoo.layers.MLA` in the
    training stages; a model pops and sums these into ``aux["indexer_loss"]``."""


def distillation_loss(attn_logits: jax.Array, index_scores: jax.Array, visible: jax.Array,
                      query_valid: jax.Array) -> jax.Array:
    """Mean over valid queries of ``KL(p_attn || softmax(index_scores))`` over the keys
    ``visible`` marks, a float32 scalar.

    Args:
      attn_logits: [B, L, N, S] the main attention's scaled scores of each head (S: the keys
        of the row, or a query's k selected slots).
      index_scores: [B, L, S] the indexer's scores of the same keys (gradient flows here only).
      visible: [B, L, S] bool, the keys of each query's distribution (causal keys of its
        document, or its valid selected slots).
      query_valid: [B, L] bool, queries that count (not padding).

    ``p_attn`` is ``mean_n softmax_s(attn_logits)`` over the visible keys -- the heads' sum,
    L1-renormalised -- under ``stop_gradient``; queries with no visible key count for nothing.
    """
    kl, counts = distillation_kl(attn_logits, index_scores, visible, query_valid)
    return jnp.sum(kl) / jnp.maximum(jnp.sum(counts), 1.0)


def distillation_kl(attn_logits: jax.Array, index_scores: jax.Array, visible: jax.Array,
                    query_valid: jax.Array, *, log_norm: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """`distillation_loss` per query, before the mean: (``KL`` [B, L] float32, zero where the
    query does not count, and ``counts`` [B, L] float32, 1 where it does). Sums of both over
    any split of the queries (context-parallel shards, query chunks) give the same mean.

    ``log_norm`` [B, L, N]: each head's log-normaliser of a larger attention these keys are
    part of (DeepSeek-V4's CSA: its softmax also covers the sliding window and the sinks).
    The target is then each head's probability of these keys in that attention, summed over
    the heads and L1-renormalised over the keys (heads that look elsewhere weigh less). None:
    the keys are the whole attention (each head's softmax over them, the heads' mean)."""
    vis = visible[:, :, None, :]
    logits = jnp.where(vis, attn_logits.astype(jnp.float32), -jnp.inf)
    any_key = jnp.any(visible, axis=-1)  # [B, L]
    logits = jnp.where(any_key[:, :, None, None], logits, 0.0)  # no NaN on empty rows
    if log_norm is None:
        p = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=2)  # [B, L, S]
    else:  # log sum_n p_n(s), renormalised over s in log space (no underflow to 0 / 0)
        lse = jnp.where(any_key[..., None], log_norm.astype(jnp.float32), 0.0)[..., None]
        summed = jax.nn.logsumexp(logits - lse, axis=2)  # [B, L, S]
        p = jax.nn.softmax(jnp.where(any_key[..., None], summed, 0.0), axis=-1)
    p = jax.lax.stop_gradient(p)
    scores = jnp.where(visible, index_scores.astype(jnp.float32), -jnp.inf)
    log_q = jax.nn.log_softmax(jnp.where(any_key[..., None], scores, 0.0), axis=-1)
    keep = visible & (p > 0)
    kl = jnp.sum(jnp.where(keep, p * (jnp.log(jnp.where(keep, p, 1.0)) - jnp.where(
        keep, log_q, 0.0)), 0.0), axis=-1)  # [B, L]
    counts = (query_valid & any_key).astype(jnp.float32)
    return kl * counts, counts


class LayerNorm(nnx.Module):
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis, in float32, cast to
    the input dtype (``torch.nn.LayerNorm``; Hugging Face keys ``weight`` and ``bias``)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, partitioner: Partitioner | None = None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.dim, self.eps = dim, eps
        p = resolve(partitioner)
        self.scale = nnx.Param(p.param(nnx.initializers.ones_init(), ("norm",))(
            rngs.params(), (dim,), param_dtype))
        self.bias = nnx.Param(p.param(nnx.initializers.zeros_init(), ("norm",))(
            rngs.params(), (dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"LayerNorm of dim {self.dim} got input of shape {x.shape}")
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32)
                + self.bias[...].astype(jnp.float32)).astype(x.dtype)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return [hfk.copy(("scale",), f"{prefix}.weight"), hfk.copy(("bias",), f"{prefix}.bias")]


class Indexer(nnx.Module):
    """The lightning indexer (module docstring): ``indexer(x, q_latent, positions=...,
    segment_ids=...)`` -> index scores [B, L, L]; ``topk(scores, k, kv_positions)`` -> indices.

    Args:
      num_heads: N, index heads (``index_n_heads``).
      head_dim: H (``index_head_dim``).
      rope_head_dim: Hr, the leading dims of each head that rotate (``qk_rope_head_dim``).
      q_lora_rank: Rq, the width of MLA's query latent.
      inputs_shape: ``(batch, length, embed)`` the layer will see.
      partitioner: how the mesh cuts parameters (None: unsharded).
      rope: MLA's `RoPE`; the indexer uses its frequencies in the layout
        ``rope_interleaved`` names (its ``interleaved`` is overridden). None: theta 10000.
      rope_interleaved: False (default): the half-split layout (DeepSeek-V3.2's
        ``DeepseekV32Indexer``); True: interleaved pairs (GLM-5's ``GlmMoeDsaIndexer``).
      mask: which keys a query may select (default ``Causal() & Document()``).
      dtype: computation dtype of the projections (None: the input's); param_dtype: storage.
    """

    def __init__(self, *, num_heads: int, head_dim: int, rope_head_dim: int, q_lora_rank: int,
                 inputs_shape: Sequence[int], partitioner: Partitioner | None,
                 rope: RoPE | None = None, mask: Mask | None = None, dtype=None,
                 param_dtype=jnp.float32, rope_interleaved: bool = False, rngs: nnx.Rngs):
        p = resolve(partitioner)
        if len(tuple(inputs_shape)) != 3:
            raise ValueError(f"Indexer: inputs_shape={tuple(inputs_shape)} must be (batch, "
                             f"length, embed)")
        _, _, embed = (int(v) for v in inputs_shape)
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim),
                            ("q_lora_rank", q_lora_rank)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Indexer: {name}={value!r} must be a positive int")
        if not isinstance(rope_head_dim, int) or rope_head_dim < 2 or rope_head_dim % 2 \
                or rope_head_dim > head_dim:
            raise ValueError(f"Indexer: rope_head_dim={rope_head_dim!r} must be an even int in "
                             f"2..head_dim={head_dim} (RoPE rotates pairs of the leading dims)")
        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(f"Indexer: mask={mask!r} must be a zoo.ops.masks.Mask")
        self.num_heads, self.head_dim, self.rope_head_dim = num_heads, head_dim, rope_head_dim
        self.q_lora_rank = q_lora_rank
        self.inputs_shape = tuple(inputs_shape)
        self.partitioner = p
        base = RoPE(theta=10000.0) if rope is None else rope
        self.rope = dataclasses.replace(base, interleaved=bool(rope_interleaved),
                                        partial_rotary_factor=1.0)
        self.mask = Causal() & Document() if mask is None else mask
        self.softmax_scale = head_dim ** -0.5
        kw = dict(partitioner=p, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wq_b = Linear(q_lora_rank, (num_heads, head_dim), in_axes=("q_lora",),
                           out_axes=(None, None), **kw)
        self.wk = Linear(embed, head_dim, in_axes=("embed",), out_axes=(None,), **kw)
        self.k_norm = LayerNorm(head_dim, eps=1e-6, partitioner=p, param_dtype=param_dtype,
                                rngs=rngs)
        # computed in float32 whatever the compute dtype, as transformers keeps it
        # (``_keep_in_fp32_modules``): the head weights decide the selection
        self.weights_proj = Linear(embed, num_heads, in_axes=("embed",), out_axes=(None,),
                                   **{**kw, "dtype": jnp.float32})

    def rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on the leading Hr dims of ``x [B, L, N, H]`` (``self.rope``'s layout)."""
        r = self.rope_head_dim
        return jnp.concatenate([self.rope.apply(x[..., :r], positions), x[..., r:]], axis=-1)

    def queries(self, x: jax.Array, q_latent: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, L, D], q_latent [B, L, Rq] -> rotated q [B, L, N, H] and float32 head
        weights [B, L, N] (``weights_proj(x) * N**-0.5``)."""
        q = self.rotate(self.wq_b(q_latent), positions)
        w = self.weights_proj(x).astype(jnp.float32) * self.num_heads ** -0.5
        return q, w

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, S, D] -> rotated index keys [B, S, H] (what a cache or a ring would carry)."""
        k = self.k_norm(self.wk(x))
        return self.rotate(k[:, :, None], positions)[:, :, 0]

    def score(self, q: jax.Array, w: jax.Array, k: jax.Array, *, q_positions: jax.Array,
              kv_positions: jax.Array, q_segment_ids: jax.Array | None = None,
              kv_segment_ids: jax.Array | None = None) -> jax.Array:
        """Index scores [B, L, S] in float32, ``-inf`` where ``self.mask`` (or padding) hides
        the key."""
        s = jnp.einsum("blnh,bsh->blns", q.astype(jnp.float32), k.astype(jnp.float32))
        s = jnp.einsum("blns,bln->bls", jax.nn.relu(s * self.softmax_scale), w)
        visible = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                                 mask=self.mask)
        return jnp.where(visible, s, -jnp.inf)

    def score_selected(self, q: jax.Array, w: jax.Array, k: jax.Array) -> jax.Array:
        """Index scores [B, L, k] in float32 of each query's own keys ``k [B, L, k, H]`` (its
        selected keys, gathered; `score`'s sum without a mask: the caller knows its empty
        slots)."""
        s = jnp.einsum("blnh,bljh->blnj", q.astype(jnp.float32), k.astype(jnp.float32))
        return jnp.einsum("blnj,bln->blj", jax.nn.relu(s * self.softmax_scale), w)

    def __call__(self, x: jax.Array, q_latent: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Self-attention index scores [B, L, L] of the tokens ``x`` (keys = queries)."""
        if x.shape[:2] != q_latent.shape[:2] or q_latent.shape[-1] != self.q_lora_rank:
            raise ValueError(f"Indexer: x {x.shape} and q_latent {q_latent.shape} must be "
                             f"[B, L, D] and [B, L, q_lora_rank={self.q_lora_rank}]")
        with jax.named_scope("indexer"):
            q, w = self.queries(x, q_latent, positions)
            k = self.keys(x, positions)
            return self.score(q, w, k, q_positions=positions, kv_positions=positions,
                              q_segment_ids=segment_ids, kv_segment_ids=segment_ids)

    def select(self, x: jax.Array, q_latent: jax.Array, k: int, *, positions: jax.Array,
               segment_ids: jax.Array | None = None, query_chunk: int | str | None = "auto",
               key_block: int | str = "auto") -> jax.Array:
        """The ``k`` keys each query attends to: int32 array indices [B, L, min(k, L)] into the
        row (`topk`'s order and tie rule), computed under ``stop_gradient``; global under
        context parallelism (module docstring). ``query_chunk``, ``key_block``: `select_keys`'s,
        on each shard's queries."""
        check_chunks(query_chunk, key_block)
        x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
        B, L = x.shape[:2]
        seg = jnp.ones((B, L), jnp.int32) if segment_ids is None else segment_ids
        pos, seg = positions.astype(jnp.int32), seg.astype(jnp.int32)
        with jax.named_scope("indexer"):
            q, w = self.queries(x, q_latent, positions)
            keys = self.keys(x, positions)
        p = self.partitioner
        seq_axes = tuple(p.sequence_axes("attention")) if p.mesh is not None else ()

        def local(q, w, keys, pos, seg):
            kpos, kseg = pos, seg
            if seq_axes:
                keys, kpos, kseg = (jax.lax.all_gather(a, seq_axes, axis=1, tiled=True)
                                    for a in (keys, kpos, kseg))
            return self.select_keys(q, w, keys, k, q_positions=pos, kv_positions=kpos,
                                    q_segment_ids=seg, kv_segment_ids=kseg,
                                    query_chunk=query_chunk, key_block=key_block)

        if p.mesh is None:
            return local(q, w, keys, pos, seg)
        # per shard also without sequence axes: each skipped block's test stays local (a
        # global one would all-reduce once per block)
        batch_axes = p.batch_axes("attention")
        while batch_axes and B % p.axis_size(batch_axes):
            batch_axes = batch_axes[:-1]
        b = None if not batch_axes else batch_axes[0] if len(batch_axes) == 1 else batch_axes
        s = None if not seq_axes else seq_axes[0] if len(seq_axes) == 1 else seq_axes
        with jax.named_scope("indexer_select_cp" if seq_axes else "indexer_select"):
            return jax.shard_map(
                local, mesh=p.mesh,
                in_specs=(P(b, s, None, None), P(b, s, None), P(b, s, None), P(b, s), P(b, s)),
                out_specs=P(b, s, None), check_vma=False)(q, w, keys, pos, seg)

    def select_keys(self, q: jax.Array, w: jax.Array, keys: jax.Array, k: int, *,
                    q_positions: jax.Array, kv_positions: jax.Array, q_segment_ids: jax.Array,
                    kv_segment_ids: jax.Array, query_chunk: int | str | None = "auto",
                    key_block: int | str = "auto") -> jax.Array:
        """``topk(score(q, w, keys, ...), k, kv_positions)`` -- the same indices -- in bounded
        memory: queries ``q [B, L, N, H]`` / ``w [B, L, N]`` in chunks of ``query_chunk`` (a
        `jax.lax.map`; ``"auto"``: `zoo.ops.sparse_attention.choose_query_chunk` under
        `SELECT_VALUES`; None: all at once), and within a chunk the keys ``[B, S, H]`` in
        blocks of ``key_block`` (``"auto"``: `KEY_BLOCK`), so the per-head scores live as
        [B, chunk, N, key_block] and the head-summed ones as [B, chunk, S], never [B, L, N, S].
        A block no query of the chunk may see (the causal upper triangle, other documents,
        padding; decided by ``self.mask`` on the positions and segment ids, so for any token
        order) is not scored."""
        B, L, N, _ = q.shape
        S = keys.shape[1]
        check_chunks(query_chunk, key_block)
        kb = min(KEY_BLOCK if key_block == "auto" else int(key_block), S)
        nb = -(-S // kb)
        if nb * kb != S:  # pad the keys to whole blocks with padding (segment 0: never seen)
            extra = nb * kb - S
            kpad = jnp.pad(keys, ((0, 0), (0, extra), (0, 0)))
            ppad, spad = (jnp.pad(a, ((0, 0), (0, extra))) for a in (kv_positions,
                                                                     kv_segment_ids))
        else:
            kpad, ppad, spad = keys, kv_positions, kv_segment_ids
        if query_chunk == "auto":
            query_chunk = choose_query_chunk(L, N * kb + SORT_VALUES * S, SELECT_VALUES)

        def chunk(args):
            qc, wc, qpos, qseg = args
            C = qc.shape[1]

            def block(i, scores):
                start = i * kb
                kblk, kpos, kseg = (jax.lax.dynamic_slice_in_dim(a, start, kb, axis=1)
                                    for a in (kpad, ppad, spad))
                seen = jnp.any(attention_mask(qpos, kpos, qseg, kseg, mask=self.mask))
                s = jax.lax.cond(
                    seen,
                    lambda: self.score(qc, wc, kblk, q_positions=qpos, kv_positions=kpos,
                                       q_segment_ids=qseg, kv_segment_ids=kseg),
                    lambda: jnp.full((B, C, kb), -jnp.inf, jnp.float32))
                return jax.lax.dynamic_update_slice_in_dim(scores, s, start, axis=2)

            scores = jax.lax.fori_loop(0, nb, block,
                                       jnp.full((B, C, nb * kb), -jnp.inf, jnp.float32))
            return self.topk(scores[:, :, :S], k, kv_positions)

        with jax.named_scope("indexer_topk"):
            return map_query_chunks(chunk, query_chunk, (q, w, q_positions, q_segment_ids),
                                    what="Indexer.select")

    @staticmethod
    def topk(scores: jax.Array, k: int, kv_positions: jax.Array) -> jax.Array:
        """The ``k`` best keys of each query: int32 array indices [B, L, min(k, S)], best first.

        Tie rule: among equal scores, the key with the larger position comes first (the more
        recent key); positions are distinct among a query's visible keys (one document), so
        the order is total and does not depend on where the keys sit in the arrays. Slots
        whose score is ``-inf`` (fewer than ``k`` visible keys) hold ``-1``.
        """
        B, L, S = scores.shape
        if kv_positions.shape != (B, S):
            raise ValueError(f"Indexer.topk: kv_positions {kv_positions.shape} must be [B, S] = "
                             f"[{B}, {S}] as the scores {scores.shape}")
        k = min(int(k), S)
        s = jax.lax.stop_gradient(scores).astype(jnp.float32) + 0.0  # -0.0 ties with 0.0
        pos = jnp.broadcast_to(kv_positions[:, None, :], (B, L, S)).astype(jnp.int32)
        # ascending sort of (-score, -position): best score first, then the larger position
        neg, order = lexsort_stable(-s, -pos)
        neg, order = neg[..., :k], order[..., :k]
        return jnp.where(jnp.isfinite(neg), order, -1)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """``wq_b``, ``wk``, ``k_norm``, ``weights_proj`` under ``prefix`` (e.g.
        ``model.layers.3.self_attn.indexer``)."""
        return hfk.children(self, prefix, ("wq_b", "wk", "k_norm", "weights_proj"))
