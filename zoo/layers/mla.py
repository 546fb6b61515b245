"""`MLA`: DeepSeek-V3 multi-head latent attention, context-parallel from birth.

Follows Hugging Face ``DeepseekV3Attention`` (submodule names match its checkpoint keys):

* query: ``q_proj`` D -> (N, Hqk) when ``q_lora_rank`` is None, else the low-rank path
  ``q_a_proj`` D -> Rq, ``q_a_layernorm`` (RMSNorm), ``q_b_proj`` Rq -> (N, Hqk);
  ``Hqk = qk_nope_head_dim + qk_rope_head_dim``.
* keys/values from one compressed latent: ``kv_a_proj_with_mqa`` D -> Rkv + Hr, split into the
  latent (``kv_a_layernorm``, RMSNorm) and a single rotary key ``k_pe`` [B, L, 1, Hr] shared by
  all heads; ``kv_b_proj`` Rkv -> (N, Hn + Hv) gives the per-head ``k_nope`` and ``v``.
* decoupled RoPE: only the trailing Hr dims of q and k rotate; ``k = concat(k_nope, k_pe
  broadcast to N heads)``. Interleaved pair layout by default (DeepSeek checkpoints).
* softmax scale ``Hqk**-0.5 * rope.softmax_scale_multiplier()`` (YaRN's mscale correction);
  ``o_proj`` (N, Hv) -> D.
* Under context parallelism ``kv_wire`` picks what crosses the wire. ``"latent"``:
  `zoo.ops.mla_attention` moves the normalised latent [B, L, Rkv] and the rotated ``k_pe``
  [B, L, Hr] around the ring / through the all-gather (Rkv + Hr values per token instead of
  N * (Hqk + Hv)) and expands them with ``kv_b_proj``'s kernel on each shard; gradients come
  back the same way. ``"expanded"``: each shard expands its own tokens and `zoo.ops.attention`
  moves the per-head K/V (cp times fewer expansion FLOPs, more bytes). ``"auto"``:
  `zoo.ops.attention.choose_mla_wire` (expanded on CPU meshes where the FLOPs saved outweigh
  the bytes, latent on TPU/GPU), resolved at construction into ``self.kv_wire``.

Same overridable steps as `zoo.layers.Attention`: `project`, `apply_rope`, `attend`, `out`;
here ``project`` returns ``(q, k_pe, latent)`` -- ``k_pe`` takes k's place (it is what RoPE
rotates) and the latent v's -- and ``attend(q, k_pe, latent)`` expands them. Mask, soft cap,
sinks and kernel as in `Attention` (``mask`` class attribute or argument).

DeepSeek sparse attention (DSA, DeepSeek-V3.2; ``index_topk=k``, off by default): a lightning
`zoo.layers.Indexer` (submodule ``indexer``, Hugging Face's key names) reads the query latent
``q_a_layernorm(q_a_proj(x))`` and ``x``, scores every key of the row and keeps each query's
``k`` best among the causal keys of its document (padding excluded; `Indexer.select`, under
``stop_gradient``: the selection trains nothing, as in transformers and DeepSeek's default
stage). The attention then sees only those keys: with ``implementation="reference"`` as
`zoo.ops.masks.TopK` composed with the layer's mask in the dense reference
(`zoo.ops.dot_product_attention` over the expanded K/V), otherwise through
`zoo.ops.sparse_mla_attention` (absorbed form; gathers only the selected latents, or dense
under the top-k membership when k is at least half the row: `choose_sparse_implementation`).
Under context parallelism the selection is global: the index keys (``index_head_dim`` values
per token) with positions and segment ids are all-gathered for the scoring, and the latent and
rotary key (``kv_lora_rank + qk_rope_head_dim`` per token) for the attention, whose gradient
is reduce-scattered back; exact for every `zoo.data.load_balance` order. ``kv_wire`` and the
ring do not apply to this path. Cached (`zoo.inference`), the layer also keeps ``index_k`` [B,
1, S, index_head_dim], the indexer's rotated keys: each decoded query scores the cached index
keys, keeps its top-k and attends to those slots of ``latent_pe`` (absorbed).

Training the indexer (``index_stage``, the DeepSeek-V3.2 report's two stages; `__call__`
only, the cached calls always select): ``"off"`` (default) is the above, with no indexer loss.
``"warmup"``: the dense forward pass (the layer's mask, no top-k), and the indexer, reading
``x`` and the query latent under ``stop_gradient``, is scored against the main attention's
distribution over every visible key (`zoo.layers.indexer.distillation_loss`). ``"sparse"``:
the sparse forward pass over the indexer's top-k, and the same loss over the selected keys
only. The loss is sown as a `zoo.layers.indexer.IndexerLoss` (the model collects it); its
gradient reaches only the indexer's parameters. The target is computed in the absorbed form
(`absorbed_target`) in query chunks, [chunk, N, S] or [chunk, N, k] scores at a time
(`distillation`); under context parallelism each shard all-gathers the index keys, the
latent and the rotary key, as the sparse forward does, and scores its own queries against
the whole row, exact for every `zoo.data.load_balance` order.

Cached (`zoo.inference`): one array, ``latent_pe`` [B, 1, S, Rkv + Hr] (the latent and the
rotated shared key), and ``attend_cache`` decodes with the up-projections absorbed: the
query's no-position part goes through ``kv_b_proj``'s key half into latent space, attention
runs as one shared head over the cached latent, and the value half maps the result back.

Legend: B batch, L length, D embed, N heads, Rq q_lora_rank, Rkv kv_lora_rank,
Hn qk_nope_head_dim, Hr qk_rope_head_dim, Hqk = Hn + Hr, Hv v_head_dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.layers.attention import (
    SCOPE,
    AttentionBlock,
    CachePut,
    check_call,
    check_inputs_shape,
    reshard,
    resolve_implementation,
    resolve_scores,
)
from zoo.layers.indexer import (INDEX_STAGES, SELECT_VALUES, SORT_VALUES, Indexer, IndexerLoss,
                                distillation_kl)
from zoo.layers.linear import Linear, prequantized, record_fp8_stats
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import RoPE
from zoo.ops import fp8 as fp8_ops
from zoo.ops.attention import (KV_WIRES, attention, choose_mla_wire, dot_product_attention,
                               mla_attention)
from zoo.ops.masks import Mask, attention_mask, default_mask
from zoo.ops.sparse_attention import (TopK, check_fetch, choose_query_chunk, gather_keys,
                                     map_query_chunks, sparse_attention, sparse_mla_attention)
from zoo.partitioning import Partitioner, resolve

_HEADS = ("batch", "length", "act_heads", "act_head_dim")
_LATENT = ("batch", "length", None)  # low-rank latents are small: never sharded


class MLA(AttentionBlock):
    """Multi-head latent attention (DeepSeek-V2/V3).

    Args:
      num_heads: N.
      q_lora_rank: Rq of the query's low-rank path, or None for a plain ``q_proj``.
      kv_lora_rank: Rkv, the compressed key/value latent.
      qk_nope_head_dim, qk_rope_head_dim: Hn (no position) and Hr (rotary) parts of q/k heads.
      v_head_dim: Hv.
      inputs_shape: ``(batch, length, embed)`` the layer will see; validated here.
      partitioner: how the mesh cuts parameters and activations (None: unsharded).
      rope: a `RoPE` over the Hr dims (None: ``RoPE(theta=10000.0, interleaved=True)``); with
        ``scaling=YaRN(...)`` its softmax-scale multiplier is applied.
      rms_norm_eps: epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``.
      implementation: see `zoo.ops.attention` (``"auto"`` is resolved here).
      dtype: computation dtype (None: the input's); param_dtype: storage dtype.
      mask, logits_soft_cap, sinks, kernel: as in `zoo.layers.Attention`.
      kv_wire: ``"latent"``, ``"expanded"`` or ``"auto"`` (resolved here): what crosses the
        wire under context parallelism (module docstring; default ``"auto"``,
        `zoo.ops.choose_mla_wire`). It adds no parameters.
      fp8: "blockwise": every projection (the latents' down and up projections included, also
        where ``kv_b_proj`` expands the latent inside `zoo.ops.mla_attention`) in
        blockwise-scaled FP8; the scores, softmax and the cached (absorbed) decode do not change.
      index_topk: DSA's keys per query (module docstring); None (the default): dense MLA.
      index_n_heads, index_head_dim: the indexer's heads and head width (DeepSeek-V3.2: 64,
        128); used only with ``index_topk``.
      index_stage: ``"off"`` (default), ``"warmup"`` or ``"sparse"``: how the indexer trains
        (module docstring); used only with ``index_topk``.
      index_rope_interleaved: the indexer's RoPE layout (`Indexer`'s ``rope_interleaved``):
        False (DeepSeek-V3.2, half-split) or True (GLM-5, interleaved).
      index_fetch: ``"auto"`` (default), ``"all_gather"`` or ``"hops"``: how the selected
        latents reach each context shard (`zoo.ops.sparse_mla_attention`'s ``fetch``).
    """

    block_name = "mla"

    @property
    def hf_projections(self) -> tuple[str, ...]:  # Hugging Face DeepseekV3Attention's names
        q = ("q_proj",) if self.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
        return (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "indexer")

    def __init__(self, *, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 inputs_shape: Sequence[int], partitioner: Partitioner | None,
                 rope: RoPE | None = None, rms_norm_eps: float = 1e-6,
                 implementation: str = "auto", dtype=None, param_dtype=jnp.float32,
                 mask: Mask | None = None, logits_soft_cap: float | None = None,
                 sinks: bool = False, kernel="auto", layout: str | None = None,
                 kv_wire: str = "auto", fp8: str | None = None,
                 index_topk: int | None = None, index_n_heads: int = 64,
                 index_head_dim: int = 128, index_stage: str = "off",
                 index_rope_interleaved: bool = False, index_fetch: str = "auto",
                 rngs: nnx.Rngs):
        p = resolve(partitioner)
        _, length, embed = check_inputs_shape(inputs_shape, p, num_heads=num_heads,
                                              num_kv_heads=num_heads, what="MLA")
        for name, value, low in (("kv_lora_rank", kv_lora_rank, 1),
                                 ("qk_nope_head_dim", qk_nope_head_dim, 0),
                                 ("qk_rope_head_dim", qk_rope_head_dim, 2),
                                 ("v_head_dim", v_head_dim, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"MLA: {name}={value!r} must be an int >= {low}")
        if q_lora_rank is not None and (not isinstance(q_lora_rank, int) or q_lora_rank < 1):
            raise ValueError(f"MLA: q_lora_rank={q_lora_rank!r} must be a positive int, or None "
                             f"for a plain q_proj")
        if kv_wire not in KV_WIRES:
            raise ValueError(f"MLA: kv_wire={kv_wire!r} must be one of {KV_WIRES}: what crosses "
                             f"the context-parallel wire, the latent or the expanded K/V")
        if qk_rope_head_dim % 2:
            raise ValueError(f"MLA: qk_rope_head_dim={qk_rope_head_dim} must be even (RoPE "
                             f"rotates pairs of dimensions)")
        check_index(index_topk, q_lora_rank, logits_soft_cap, sinks)
        check_index_stage(index_stage, index_topk)
        check_fetch(index_fetch, "MLA: index_fetch")
        self.num_heads = self.num_kv_heads = num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.inputs_shape = tuple(inputs_shape)
        self.embed_dim = embed
        self.partitioner = p
        self.rope = RoPE(theta=10000.0, interleaved=True) if rope is None else rope
        self.scale = self.qk_head_dim ** -0.5 * self.rope.softmax_scale_multiplier()
        self.implementation = resolve_implementation(
            implementation, p, length=length, num_heads=num_heads, num_kv_heads=num_heads,
            head_dim=self.qk_head_dim, v_head_dim=v_head_dim, what="MLA")
        self.kv_wire = kv_wire if kv_wire != "auto" else choose_mla_wire(
            partitioner=p, kv_lora_rank=kv_lora_rank, num_heads=num_heads,
            qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim, itemsize=jnp.dtype(dtype or param_dtype).itemsize)
        resolve_scores(self, "MLA", mask=mask, sliding_window=None,
                       logits_soft_cap=logits_soft_cap, sinks=sinks, kernel=kernel,
                       num_heads=num_heads, p=p, param_dtype=param_dtype, rngs=rngs,
                       layout=layout)

        self.fp8 = fp8
        kw = dict(partitioner=p, scope=SCOPE, dtype=dtype, param_dtype=param_dtype, fp8=fp8,
                  rngs=rngs)
        heads = ("heads", "head_dim")
        if q_lora_rank is None:
            self.q_proj = Linear(embed, (num_heads, self.qk_head_dim), in_axes=("embed",),
                                 out_axes=heads, **kw)
        else:
            # The low-rank dim is whole on the down-projection (its embed dim is already
            # FSDP-sharded) and FSDP-sharded on the up-projection, so both are cut.
            self.q_a_proj = Linear(embed, q_lora_rank, in_axes=("embed",), out_axes=(None,),
                                   **kw)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=rms_norm_eps, partitioner=p,
                                         param_dtype=param_dtype, rngs=rngs)
            self.q_b_proj = Linear(q_lora_rank, (num_heads, self.qk_head_dim),
                                   in_axes=("q_lora",), out_axes=heads, **kw)
        self.kv_a_proj_with_mqa = Linear(embed, kv_lora_rank + qk_rope_head_dim,
                                         in_axes=("embed",), out_axes=(None,), **kw)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=rms_norm_eps, partitioner=p,
                                      param_dtype=param_dtype, rngs=rngs)
        self.kv_b_proj = Linear(kv_lora_rank, (num_heads, qk_nope_head_dim + v_head_dim),
                                in_axes=("kv_lora",), out_axes=heads, **kw)
        self.o_proj = Linear((num_heads, v_head_dim), embed, in_axes=heads,
                             out_axes=("embed",), **kw)
        self.index_topk = index_topk
        self.index_stage = index_stage
        self.index_fetch = index_fetch
        self.indexer = None if index_topk is None else Indexer(
            num_heads=index_n_heads, head_dim=index_head_dim, rope_head_dim=qk_rope_head_dim,
            q_lora_rank=q_lora_rank, inputs_shape=inputs_shape, partitioner=p, rope=self.rope,
            mask=self.mask, dtype=dtype, param_dtype=param_dtype,
            rope_interleaved=index_rope_interleaved, rngs=rngs)

    # -- steps a subclass may override --------------------------------------------------------
    def q_latent(self, x: jax.Array) -> jax.Array:
        """x [B, L, D] -> the query latent ``q_a_layernorm(q_a_proj(x))`` [B, L, Rq]."""
        return self.q_a_layernorm(self.partitioner.constrain(self.q_a_proj(x), _LATENT, SCOPE))

    def project_q(self, x: jax.Array, q_latent: jax.Array | None = None) -> jax.Array:
        """x [B, L, D] -> q [B, L, N, Hqk] (before RoPE); ``q_latent``: `q_latent` (x)
        when the caller has it already."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_latent(x) if q_latent is None else q_latent)
        return self.partitioner.constrain(q, _HEADS, SCOPE)

    def project_kv(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, L, D] -> k_pe [B, L, 1, Hr] (shared, before RoPE), latent [B, L, Rkv]
        (after ``kv_a_layernorm``): what crosses the wire."""
        c = self.partitioner.constrain
        kv_a = c(self.kv_a_proj_with_mqa(x), _LATENT, SCOPE)  # [B, L, Rkv + Hr]
        latent, k_pe = kv_a[..., :self.kv_lora_rank], kv_a[..., self.kv_lora_rank:]
        return k_pe[:, :, None, :], c(self.kv_a_layernorm(latent), _LATENT, SCOPE)

    def project_all(self, x: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x [B, L, D] -> (q_latent, q, k_pe, latent): `project` with the query latent kept
        (DSA's indexer reads it), one seam for the sparse, training-stage and decode paths."""
        q_latent = self.q_latent(x)
        return (q_latent, self.project_q(x, q_latent), *self.project_kv(x))

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, L, D] -> q [B, L, N, Hqk], k_pe [B, L, 1, Hr], latent [B, L, Rkv] (before
        RoPE); `attend` expands the latent into per-head K/V with ``kv_b_proj``."""
        return (self.project_q(x), *self.project_kv(x))

    def apply_rope(self, q: jax.Array, k_pe: jax.Array,
                   positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rotate only the trailing Hr dims of q, and the shared rotary key (decoupled RoPE)."""
        n = self.qk_nope_head_dim
        q = jnp.concatenate([q[..., :n], self.rope.apply(q[..., n:], positions)], axis=-1)
        return q, self.rope.apply(k_pe, positions)

    def attend(self, q: jax.Array, k_pe: jax.Array, latent: jax.Array, *,
               positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """Attention under ``self.mask`` -> [B, L, N, Hv]: via `zoo.ops.mla_attention` (the
        latent and k_pe cross the wire, each shard expands them with ``kv_b_proj``), or with
        ``kv_wire="expanded"`` via `zoo.ops.attention` over `expand_kv`'s local K/V."""
        dtype = self.kv_b_proj.dtype or latent.dtype
        if self.kv_wire == "expanded":
            k, v = self.expand_kv(k_pe, latent)
            return self.run_op(attention, q, k, v, positions=positions, segment_ids=segment_ids)
        kv_up = self.kv_b_proj.kernel[...].astype(dtype)
        if self.fp8 == "blockwise":  # the op expands the latent per shard: count it here
            # the kernel as every FP8 Linear quantises it (in the compute dtype), or its copy
            r = latent.shape[-1]
            pre = prequantized(self.kv_b_proj, "kernel")
            kv_up = kv_up if pre is None else pre
            w_stats = (kv_up.stats if isinstance(kv_up, fp8_ops.QuantizedWeight) else
                       fp8_ops.quantize_stats(kv_up.reshape(r, -1), block=fp8_ops.WEIGHT_BLOCK))
            record_fp8_stats(self.kv_b_proj, fp8_ops.quantize_stats(
                latent.astype(dtype).reshape(-1, r)), w_stats)
        return self.run_op(mla_attention, q, latent.astype(dtype), k_pe[:, :, 0].astype(dtype),
                           kv_up,
                           qk_nope_head_dim=self.qk_nope_head_dim, positions=positions,
                           segment_ids=segment_ids, fp8=self.fp8)

    # -- DeepSeek sparse attention (index_topk) ----------------------------------------------
    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """x [B, L, D], positions [B, L] (int), segment_ids [B, L] (0 = padding) -> [B, L, D];
        with ``index_topk`` each query attends to its selected keys only (module docstring)."""
        if self.indexer is None:
            return super().__call__(x, positions=positions, segment_ids=segment_ids)
        if self.index_stage != "off":
            return self.index_training_call(x, positions=positions,
                                            segment_ids=segment_ids)[0]
        return self.sparse_call(x, positions=positions, segment_ids=segment_ids)[0]

    def index_training_call(self, x: jax.Array, *, positions: jax.Array,
                            segment_ids: jax.Array | None
                            ) -> tuple[jax.Array, jax.Array | None]:
        """The forward pass of a training stage (``index_stage``: the dense one for
        ``"warmup"``, the sparse one for ``"sparse"``) -> (out [B, L, D], the selection
        [B, L, k] it attended to, None in ``"warmup"``), sowing the indexer's `distillation`
        loss as an `IndexerLoss` named ``indexer_loss``."""
        check_call(self, x, positions, segment_ids)
        with jax.named_scope(self.block_name):
            x = self.partitioner.constrain(x, ("batch", "length", "act_embed"), SCOPE)
            with jax.named_scope("project"):
                q_latent, q, k_pe, latent = self.project_all(x)
            indices = None
            if self.index_stage == "sparse":
                with jax.named_scope("select"):
                    indices = self.indexer.select(x, q_latent, self.index_topk,
                                                  positions=positions, segment_ids=segment_ids)
            with jax.named_scope("rope"):
                q, k_pe = self.apply_rope(q, k_pe, positions)
            with jax.named_scope("attend"):
                if indices is None:
                    o = self.attend(q, k_pe, latent, positions=positions,
                                    segment_ids=segment_ids)
                else:
                    o = self.attend_selected(q, k_pe, latent, indices, positions=positions,
                                             segment_ids=segment_ids)
            with jax.named_scope("indexer_loss"):
                self.indexer_loss = IndexerLoss(self.distillation(
                    x, q_latent, q, k_pe, latent, indices, positions=positions,
                    segment_ids=segment_ids))  # the model pops it
            with jax.named_scope("out"):
                return self.out(o), indices

    def distillation(self, x: jax.Array, q_latent: jax.Array, q: jax.Array, k_pe: jax.Array,
                     latent: jax.Array, indices: jax.Array | None, *, positions: jax.Array,
                     segment_ids: jax.Array | None,
                     query_chunk: int | str | None = "auto") -> jax.Array:
        """The indexer's `zoo.layers.indexer.distillation_loss`, a float32 scalar: over every
        visible key (``indices=None``, the warm-up) or each query's selected ones (``indices``
        [B, L, k] into the row). ``x`` [B, L, D] and ``q_latent`` are the indexer's input
        (detached here: only the indexer's parameters get a gradient); ``q``, ``k_pe``
        (rotated) and ``latent`` give the target (`absorbed_target`, under
        ``stop_gradient``).

        Under context parallelism it runs under `jax.shard_map` over the attention sequence
        axes: each shard all-gathers the index keys (H values per token), the latent and
        ``k_pe`` (Rkv + Hr) with positions and segment ids, as the sparse forward does, and
        computes the KL of its own queries over the whole row of keys -- exact for any token
        order (`zoo.data.load_balance`); the index keys' gradient is reduce-scattered back. The
        queries go in chunks (``query_chunk``: ``"auto"`` bounds a chunk's float32 values by
        `zoo.layers.indexer.SELECT_VALUES`; None: all at once), each rematerialised in the
        backward pass, so [chunk, N, S] scores live at a time, never [L, N, S]."""
        B, L = x.shape[:2]
        seg = jnp.ones((B, L), jnp.int32) if segment_ids is None else segment_ids
        pos, seg = positions.astype(jnp.int32), seg.astype(jnp.int32)
        x, q_latent = jax.lax.stop_gradient((x, q_latent))
        with jax.named_scope("indexer"):
            iq, iw = self.indexer.queries(x, q_latent, positions)
            ik = self.indexer.keys(x, positions)
        q_abs, kv = self.absorbed_target(q, k_pe, latent)
        p = self.partitioner
        seq_axes = tuple(p.sequence_axes("attention")) if p.mesh is not None else ()
        per_query = (iq, iw, q_abs, pos, seg) + (() if indices is None else (indices,))

        def local(ik, kv, *per_query):
            kpos, kseg = per_query[3:5]
            if seq_axes:  # the whole row's keys: indices name places in it
                ik, kv, kpos, kseg = (jax.lax.all_gather(a, seq_axes, axis=1, tiled=True)
                                      for a in (ik, kv, kpos, kseg))
            return self.local_distillation(ik, kv, kpos, kseg, *per_query,
                                           query_chunk=query_chunk)

        if not seq_axes:
            kl = local(ik, kv, *per_query)
        else:
            batch_axes = p.batch_axes("attention")
            while batch_axes and B % p.axis_size(batch_axes):  # the largest prefix dividing B
                batch_axes = batch_axes[:-1]
            b = None if not batch_axes else batch_axes[0] if len(batch_axes) == 1 else batch_axes
            s = seq_axes[0] if len(seq_axes) == 1 else seq_axes
            tok, vec, heads = P(b, s), P(b, s, None), P(b, s, None, None)
            specs = (vec, vec, heads, vec, heads, tok, tok) + (() if indices is None else (vec,))
            with jax.named_scope("indexer_loss_cp"):
                kl = jax.shard_map(local, mesh=p.mesh, in_specs=specs, out_specs=vec,
                                   check_vma=False)(ik, kv, *per_query)
        return jnp.sum(kl[..., 0]) / jnp.maximum(jnp.sum(kl[..., 1]), 1.0)

    def local_distillation(self, ik: jax.Array, kv: jax.Array, kv_positions: jax.Array,
                           kv_segment_ids: jax.Array, iq: jax.Array, iw: jax.Array,
                           q_abs: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                           indices: jax.Array | None = None, *,
                           query_chunk: int | str | None = "auto") -> jax.Array:
        """`distillation`'s work on one shard's queries against the whole row's keys (index
        keys ``ik`` [B, S, H], absorbed keys ``kv`` [B, S, Rkv + Hr], their positions and
        segment ids) -> [B, L, 2] float32: each query's KL and whether it counts
        (`zoo.layers.indexer.distillation_kl`)."""
        mask = default_mask(None, None, self.mask)
        N, Ni = q_abs.shape[2], iq.shape[2]
        width = ik.shape[1] if indices is None else indices.shape[2]
        values = (N + Ni + SORT_VALUES) * width + (
            0 if indices is None else width * (kv.shape[-1] + ik.shape[-1]))
        if query_chunk == "auto":
            query_chunk = choose_query_chunk(iq.shape[1], values, SELECT_VALUES)

        def chunk(args):
            iq, iw, q_abs, pos, seg, *sel = args
            if not sel:  # every visible key of the row
                logits = jnp.einsum("blnc,bsc->blns", q_abs, kv) * self.scale
                scores = self.indexer.score(iq, iw, ik, q_positions=pos,
                                            kv_positions=kv_positions, q_segment_ids=seg,
                                            kv_segment_ids=kv_segment_ids)
                visible = attention_mask(pos, kv_positions, seg, kv_segment_ids, mask=mask)
            else:  # the selected keys only
                kv_sel, ik_sel = gather_keys(sel[0], kv, ik)  # [B, C, k, ...]
                logits = jnp.einsum("blnc,bljc->blnj", q_abs, kv_sel) * self.scale
                scores = self.indexer.score_selected(iq, iw, ik_sel)
                visible = sel[0] >= 0
            return jnp.stack(distillation_kl(logits, scores, visible, seg != 0), axis=-1)

        per_query = (iq, iw, q_abs, positions, segment_ids) + (
            () if indices is None else (indices,))
        return map_query_chunks(chunk, query_chunk, per_query,
                                what="MLA.distillation")

    def absorbed_target(self, q: jax.Array, k_pe: jax.Array, latent: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
        """The main attention in the absorbed form, float32 under ``stop_gradient`` (the
        indexer's target): ``q`` [B, L, N, Hqk] and ``k_pe`` [B, S, 1, Hr] rotated, ``latent``
        [B, S, Rkv] -> queries [B, L, N, Rkv + Hr] (the no-position part through
        ``kv_b_proj``'s key half) and shared keys [B, S, Rkv + Hr], whose dot product times
        ``self.scale`` is each head's score."""
        q, k_pe, latent = jax.lax.stop_gradient((q, k_pe, latent))
        f32 = jnp.float32
        Hn = self.qk_nope_head_dim
        w_uk = jax.lax.stop_gradient(self.kv_b_proj.kernel[...])[..., :Hn].astype(f32)
        q_lat = jnp.einsum("blnh,rnh->blnr", q[..., :Hn].astype(f32), w_uk)
        q_abs = jnp.concatenate([q_lat, q[..., Hn:].astype(f32)], -1)
        return q_abs, jnp.concatenate([latent.astype(f32), k_pe[:, :, 0].astype(f32)], -1)

    def sparse_call(self, x: jax.Array, *, positions: jax.Array,
                    segment_ids: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The DSA forward pass: (out [B, L, D], the cache arrays it leaves: ``latent_pe``
        and ``index_k`` [B, 1, L, F])."""
        check_call(self, x, positions, segment_ids)
        with jax.named_scope(self.block_name):
            x = self.partitioner.constrain(x, ("batch", "length", "act_embed"), SCOPE)
            with jax.named_scope("project"):
                q_latent, q, k_pe, latent = self.project_all(x)
            with jax.named_scope("select"):
                indices = self.indexer.select(x, q_latent, self.index_topk, positions=positions,
                                              segment_ids=segment_ids)
            with jax.named_scope("rope"):
                q, k_pe = self.apply_rope(q, k_pe, positions)
            with jax.named_scope("attend"):
                o = self.attend_selected(q, k_pe, latent, indices, positions=positions,
                                         segment_ids=segment_ids)
            with jax.named_scope("out"):
                out = self.out(o)
            entry = self.cache_entry(k_pe, latent)
            entry["index_k"] = jax.lax.stop_gradient(
                self.indexer.keys(x, positions))[:, None].astype(latent.dtype)
            return out, entry

    def prefill_cache(self, x: jax.Array, *, positions: jax.Array,
                      segment_ids: jax.Array | None = None
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
        if self.indexer is None:
            return super().prefill_cache(x, positions=positions, segment_ids=segment_ids)
        return self.sparse_call(x, positions=positions, segment_ids=segment_ids)

    def decode_step(self, x: jax.Array, put: CachePut, *, q_positions: jax.Array,
                    kv_positions: jax.Array, kv_segment_ids: jax.Array,
                    partitioner: Partitioner | None = None) -> jax.Array:
        """`AttentionBlock.decode_step`; with DSA the new tokens' index keys go into the
        ``index_k`` cache, each new query selects its ``index_topk`` best cached keys (the
        layer's mask over the slots' positions and segment ids) and attends to those in the
        absorbed form over ``latent_pe``."""
        if self.indexer is None:
            return super().decode_step(x, put, q_positions=q_positions,
                                       kv_positions=kv_positions, kv_segment_ids=kv_segment_ids,
                                       partitioner=partitioner)
        p = resolve(partitioner)
        with jax.named_scope(self.block_name):
            q_latent, q, k_pe, latent = self.project_all(x)
            q, k_pe = self.apply_rope(q, k_pe, q_positions)
            iq, iw = self.indexer.queries(x, q_latent, q_positions)
            new_k = self.indexer.keys(x, q_positions)[:, None].astype(latent.dtype)
            index_k = put("index_k", reshard(p, new_k, ("batch", None, None, None)))
            new = self.cache_entry(k_pe, latent)["latent_pe"]
            cache = put("latent_pe", reshard(p, new, ("batch", None, None, None)))
            q_seg = jnp.ones(q_positions.shape, jnp.int32)
            scores = self.indexer.score(iq, iw, index_k[:, 0], q_positions=q_positions,
                                        kv_positions=kv_positions, q_segment_ids=q_seg,
                                        kv_segment_ids=kv_segment_ids)
            indices = self.indexer.topk(scores, self.index_topk, kv_positions)
            return self.attend_slots(q, cache, indices, q_positions=q_positions,
                                     kv_positions=kv_positions, kv_segment_ids=kv_segment_ids,
                                     partitioner=p)

    def attend_slots(self, q: jax.Array, cache: jax.Array, indices: jax.Array, *,
                     q_positions: jax.Array, kv_positions: jax.Array,
                     kv_segment_ids: jax.Array, partitioner: Partitioner) -> jax.Array:
        """Decode's sparse attention: the new queries ``q`` [B, T, N, Hn + Hr] (roped) over
        the cached ``latent_pe`` slots ``indices`` [B, T, k] selects (array indices into the
        slots, ``-1`` empty), in the absorbed form -> the output projection's result. What a
        layer that selects its own slots (`decode_step`) and one given them (GLM-5's shared
        layers) both run."""
        Hn, R = self.qk_nope_head_dim, self.kv_lora_rank
        dtype = self.kv_b_proj.dtype or cache.dtype
        w = self.kv_b_proj.kernel[...].astype(dtype)  # [Rkv, N, Hn + Hv]
        q_lat = jnp.einsum("blnh,rnh->blnr", q[..., :Hn].astype(dtype), w[..., :Hn])
        q_lat = reshard(partitioner, q_lat, ("batch", None, "act_heads", None))  # as attend_cache
        q_abs = jnp.concatenate([q_lat, q[..., Hn:].astype(dtype)], -1)
        o_lat = sparse_attention(
            q_abs, cache[:, 0].astype(dtype), None, indices, q_positions=q_positions,
            kv_positions=kv_positions, q_segment_ids=jnp.ones(q_positions.shape, jnp.int32),
            kv_segment_ids=kv_segment_ids, mask=default_mask(None, None, self.mask),
            scale=self.scale, v_head_dim=R, implementation="gather")
        o = jnp.einsum("blnr,rnv->blnv", o_lat, w[..., Hn:])
        return self.out(o.astype(q.dtype))

    def attend_selected(self, q: jax.Array, k_pe: jax.Array, latent: jax.Array,
                        indices: jax.Array, *, positions: jax.Array,
                        segment_ids: jax.Array | None) -> jax.Array:
        """Attention of each query over its selected keys ``indices`` [B, L, k] (array
        indices into the row, ``-1`` empty) -> [B, L, N, Hv]: the dense reference under
        ``mask & TopK`` when ``implementation="reference"``, else
        `zoo.ops.sparse_mla_attention`."""
        mask = default_mask(None, None, self.mask)
        dtype = self.kv_b_proj.dtype or latent.dtype
        if self.implementation == "reference":
            k, v = self.expand_kv(k_pe, latent)
            seg = (jnp.ones(positions.shape, jnp.int32) if segment_ids is None
                   else segment_ids)
            top = TopK.from_indices(indices, positions, seg)
            o = dot_product_attention(q, k, v, q_positions=positions, kv_positions=positions,
                                      q_segment_ids=seg, kv_segment_ids=seg, mask=mask & top,
                                      scale=self.scale)
        else:
            o = sparse_mla_attention(
                q, latent.astype(dtype), k_pe[:, :, 0].astype(dtype),
                self.kv_b_proj.kernel[...].astype(dtype), indices,
                qk_nope_head_dim=self.qk_nope_head_dim, positions=positions,
                segment_ids=segment_ids, mask=mask, scale=self.scale,
                partitioner=self.partitioner, fetch=self.index_fetch)
        return self.partitioner.constrain(o, _HEADS, SCOPE)

    def expand_kv(self, k_pe: jax.Array, latent: jax.Array) -> tuple[jax.Array, jax.Array]:
        """k_pe [B, L, 1, Hr] (rotated), latent [B, L, Rkv] -> per-head k [B, L, N, Hqk]
        (``concat(k_nope, k_pe)``) and v [B, L, N, Hv], on the tokens' own shards."""
        dtype = self.kv_b_proj.dtype or latent.dtype
        kv = self.partitioner.constrain(self.kv_b_proj(latent.astype(dtype)), _HEADS, SCOPE)
        k_nope, v = kv[..., :self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim:]
        k_pe = jnp.broadcast_to(k_pe.astype(k_nope.dtype), (*k_nope.shape[:3], k_pe.shape[-1]))
        return jnp.concatenate([k_nope, k_pe], axis=-1), v


    # -- the cached call (zoo.inference) ------------------------------------------------------
    # one entry, ``latent_pe`` [B, 1, S, Rkv + Hr]: the normalised latent and the rotated
    # shared key, one "head" all heads read (576 values per token for DeepSeek-V3)
    # with DSA also ``index_k`` [B, 1, S, index_head_dim]: the indexer's rotated keys
    @property
    def cache_axes(self) -> dict[str, tuple[str | None, ...]]:
        axes = {"latent_pe": ("batch", None, "length", None)}
        if self.indexer is not None:
            axes["index_k"] = ("batch", None, "length", None)
        return axes

    def cache_shape(self, batch: int, max_length: int) -> dict[str, tuple[int, ...]]:
        width = self.kv_lora_rank + self.qk_rope_head_dim
        slots = self.cache_slots(max_length)
        shapes = {"latent_pe": (batch, 1, slots, width)}
        if self.indexer is not None:
            shapes["index_k"] = (batch, 1, slots, self.indexer.head_dim)
        return shapes

    def cache_entry(self, k_pe: jax.Array, latent: jax.Array) -> dict[str, jax.Array]:
        """k_pe [B, L, 1, Hr] (rotated), latent [B, L, Rkv] -> ``latent_pe`` [B, 1, L, Rkv+Hr]."""
        latent_pe = jnp.concatenate([latent, k_pe[:, :, 0].astype(latent.dtype)], -1)
        return {"latent_pe": latent_pe[:, None]}

    def attend_cache(self, q: jax.Array, k_pe: jax.Array, latent: jax.Array, put: CachePut,
                     p: Partitioner, **kw) -> jax.Array:
        """Absorbed MLA over the latent cache: scores ``q_nope W_uk . latent + q_pe . k_pe``,
        output ``(p . latent) W_uv``, as one shared-key head of width Rkv + Hr, so the
        expanded K/V are never built."""
        Hn, R = self.qk_nope_head_dim, self.kv_lora_rank
        new = self.cache_entry(k_pe, latent)["latent_pe"]  # [B, 1, T, Rkv + Hr]
        cache = put("latent_pe", reshard(p, new, ("batch", None, None, None)))
        dtype = self.kv_b_proj.dtype or cache.dtype
        w = self.kv_b_proj.kernel[...].astype(dtype)  # [Rkv, N, Hn + Hv]
        w_uk, w_uv = w[..., :Hn], w[..., Hn:]
        # weight-stationary: the product is split over kv_lora as w_uk is (FSDP) and moves to
        # the cache's batch sharding -- [B, 1, N, Rkv] is far smaller than w_uk
        q_lat = jnp.einsum("blnh,rnh->blnr", q[..., :Hn].astype(dtype), w_uk)
        q_lat = reshard(p, q_lat, ("batch", None, "act_heads", None))
        q_abs = jnp.concatenate([q_lat, q[..., Hn:].astype(dtype)], -1)  # [B, T, N, Rkv + Hr]
        kv = cache.astype(dtype)
        o_lat = dot_product_attention(q_abs, kv, kv[..., :R], **kw)  # [B, T, N, Rkv]
        return jnp.einsum("blnr,rnv->blnv", o_lat, w_uv)


def check_index_stage(index_stage, index_topk) -> None:
    """Construction checks of MLA's ``index_stage``."""
    if index_stage not in INDEX_STAGES:
        raise ValueError(f"MLA: index_stage={index_stage!r} must be one of {INDEX_STAGES} "
                         f"(how the DSA indexer trains: off, the dense warm-up, or sparse)")
    if index_stage != "off" and index_topk is None:
        raise ValueError(f"MLA: index_stage={index_stage!r} trains an indexer, but index_topk "
                         f"is None (no indexer); set index_topk or index_stage='off'")


def check_index(index_topk, q_lora_rank, logits_soft_cap, sinks) -> None:
    """Construction checks of MLA's DSA options (``index_topk`` and what it needs)."""
    if index_topk is None:
        return
    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or index_topk < 1:
        raise ValueError(f"MLA: index_topk={index_topk!r} must be a positive int (the keys each "
                         f"query attends to; DeepSeek-V3.2: 2048) or None for dense MLA")
    if q_lora_rank is None:
        raise ValueError("MLA: index_topk needs q_lora_rank (the indexer reads the query "
                         "latent q_a_layernorm(q_a_proj(x))); set q_lora_rank or "
                         "index_topk=None")
    if logits_soft_cap is not None or sinks:
        raise ValueError(f"MLA: index_topk={index_topk} does not combine with "
                         f"logits_soft_cap={logits_soft_cap!r} or sinks={sinks!r} (the sparse "
                         f"attention has neither); drop them or set index_topk=None")

