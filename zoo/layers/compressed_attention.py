"""DeepSeek-V4 attention: sliding window, compressed sparse (CSA) and heavily compressed (HCA).

Follows Hugging Face ``DeepseekV4Attention`` (attribute names match its checkpoint keys under
``self_attn``):

* queries: ``q_a_proj`` D -> Rq, ``q_a_norm`` (RMSNorm), ``q_b_proj`` Rq -> (N, H), then an
  unweighted RMS norm per head; the query latent ``q_a_norm(q_a_proj(x))`` also feeds the CSA
  indexer.
* one key/value head shared by all query heads (single-KV-head MQA, keys = values):
  ``kv_proj`` D -> H, ``kv_norm`` (RMSNorm).
* RoPE on the *trailing* ``rope_head_dim`` dims of each head, interleaved pairs; sliding layers
  use the main base, CSA/HCA layers the compressed branches' base (the model passes the
  `RoPE`). Because values are the rotated keys, the output's rotary dims are rotated back by
  the query's position (the conjugate rotation) before the output projection.
* the attention of each query: the tokens of its document within ``sliding_window`` (causal;
  gathered per query through `zoo.ops.compressed_attention.sliding_band`, O(L * window)),
  the compressed entries it may see (a `Compressor` over windows of ``compress_rate`` tokens:
  all complete entries of its document for HCA, the ``index_topk`` a `CompressedIndexer` picks
  for CSA), and a learned sink logit per head (``sinks``), in one float32 softmax with scale
  ``H**-0.5`` (`zoo.ops.compressed_attention.attend`).
* ``GroupedOutputProjection``: heads in ``o_groups`` groups, each group's ``N*H/o_groups``
  values projected to ``o_lora_rank`` (``o_a_proj``, block diagonal), then ``o_b_proj``
  ``o_groups*o_lora_rank`` -> D.

Documents: compression windows follow each document from its first token (positions and
segment ids, 0 = padding; `zoo.ops.compressed_attention`), so packed rows and lengths that are
not multiples of the rate are exact; transformers has no packed rows (its windows start at the
row's first token).

Context parallelism (a partitioner whose attention sequence axes are > 1): per-token projections
run sharded; then, under `jax.shard_map`, each shard all-gathers the positions and segment ids
(2 int32 per token) to number the row's windows, reduces its own tokens into the row's entry
slots and all-reduces the partial softmax sums (pmax + psum of ``[B, L/rate, H]``: a window
that straddles shards is completed from its neighbours, every shard gets all entries; for CSA
the indexer's entries ``[B, L/rate, index_head_dim]`` too), so the indexer's top-k is global
over the row; and fetches the sliding keys (the sliding branch needs each query's previous
``sliding_window - 1`` tokens, whichever shard holds them). With a declared ``layout``
(``"contiguous"`` or ``"balanced"``, `zoo.ops.attention`'s; `DecoderConfig.attention_layout`)
only the ring offsets a window can reach move (`sliding_hops`, `zoo.ops.ring.hop_plan`: one
``ppermute`` of ``[B, L/cp, H]`` keys each), when the batch satisfies the plan
(`zoo.ops.ring.sequence_order_ok`, checked per batch); otherwise, and without a layout, the
keys ``[B, L, H]`` are all-gathered.
Backward, the all-gather's transpose reduce-scatters the keys' gradient and the all-reduce's
transpose all-reduces the entries'. Exact for every `zoo.data.load_balance` order.

Training CSA's indexer (``index_stage``, DeepSeek-V3.2's two stages; `__call__` only, the
cached calls always select): ``"off"`` (default) is the above, with no indexer loss.
``"warmup"``: each query attends to every compressed entry it may see (as HCA does; beside the
sliding window and the sinks), and the indexer, reading ``x`` and the query latent under
``stop_gradient``, learns by `zoo.layers.indexer.distillation_kl` the main attention's
distribution over those entries: each head's probabilities of them in the layer's own softmax
(`zoo.ops.compressed_attention.attention_logits`: sliding keys, entries and sink together),
summed over the heads and renormalised over the entries, under ``stop_gradient``.
``"sparse"``: the sparse forward, and the same KL over each query's selected entries only. The
per-layer mean over the queries that see an entry is sown as a `zoo.layers.indexer.IndexerLoss`
(the model collects it); its gradient reaches only the indexer's parameters (its compressor's
included), in query chunks (`local_distillation`). Under context parallelism each shard
computes the KL of its own queries inside the same `jax.shard_map`, from what the attention
already gathered (the row's entries and index keys, the sliding keys); only the queries with
every head (and the whole sinks) enter it besides, so it is exact for every order too.

Generation (`CompressedAttention.prefill` / `decode`, one document per row from position 0):
the cache is the layer's state as a dict of arrays (`cache_shape`): the last
``sliding_window`` rotated keys in a ring by position, the compressed entries written as their
windows close, the open window's per-token projections (the partial window), CSA's carried
``Ca`` half of the last complete window (the overlap), and for CSA the indexer's own entries,
partial window and overlap (the index keys). A decode step that closes a window writes its
entry before the query attends, as transformers does. Per token at long context that is
``H / rate`` values of entries (plus ``index_head_dim / rate`` for CSA) and a constant window.

Legend: B batch, L length, D embed, Rq q_lora_rank, N heads, H head dim, Hr rotary dims,
E entry slots (L // rate), G o_groups, Ro o_lora_rank, Ni/Hi index heads / head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.layers import hf_keys as hfk
from zoo.layers.compressor import (F32, SCOPE, CompressedIndexer, Compressor, check_positive,
                                   rotate_trailing, v4_rope)
from zoo.layers.indexer import INDEX_STAGES, IndexerLoss, distillation_kl
from zoo.layers.linear import Linear
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import RoPE
from zoo.ops import compressed_attention as ca
from zoo.ops import ring
from zoo.ops.masks import Causal, Document, SlidingWindow
from zoo.ops.sparse_attention import choose_query_chunk, gather_keys, map_query_chunks
from zoo.partitioning import Partitioner, resolve

KINDS = ("sliding", "csa", "hca")
DEFAULT_RATES = {"csa": 4, "hca": 128}
_HEADS = ("batch", "length", "act_heads", "act_head_dim")
class GroupedOutputProjection(nnx.Module):
    """Heads [B, L, N, H] -> [B, L, D]: ``o_groups`` groups of ``N/G`` heads, each group's
    ``N*H/G`` values projected to ``o_lora_rank`` by its own block of ``o_a_proj`` (kernel
    [N*H/G, G, Ro], Hugging Face ``[G*Ro, N*H/G]``), then ``o_b_proj`` (G, Ro) -> D."""

    def __init__(self, *, num_heads: int, head_dim: int, o_groups: int, o_lora_rank: int,
                 embed: int, partitioner: Partitioner | None, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        p = resolve(partitioner)
        check_positive("GroupedOutputProjection", num_heads=num_heads, head_dim=head_dim,
                        o_groups=o_groups, o_lora_rank=o_lora_rank, embed=embed)
        if num_heads % o_groups:
            raise ValueError(f"GroupedOutputProjection: num_heads={num_heads} is not divisible "
                             f"by o_groups={o_groups}; each group takes whole heads (pick "
                             f"o_groups dividing num_heads)")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.o_groups, self.o_lora_rank = o_groups, o_lora_rank
        kw = dict(partitioner=p, scope=SCOPE, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # the rank is FSDP-sharded (``o_lora``) where the shards divide it (every published
        # size); a small rank that they do not divide stays whole
        rank_axis = "o_lora" if o_lora_rank % p.size("o_lora", SCOPE) == 0 else None
        self.o_a_proj = Linear(num_heads * head_dim // o_groups, (o_groups, o_lora_rank),
                               in_axes=(None,), out_axes=(None, rank_axis), **kw)
        self.o_b_proj = Linear((o_groups, o_lora_rank), embed, in_axes=(None, None),
                               out_axes=("embed",), **kw)

    def __call__(self, o: jax.Array) -> jax.Array:
        B, L, N, H = o.shape
        G = self.o_groups
        dtype = self.o_a_proj.dtype or o.dtype
        grouped = o.reshape(B, L, G, N * H // G).astype(dtype)
        y = jnp.einsum("blgi,igr->blgr", grouped, self.o_a_proj.kernel[...].astype(dtype))
        return self.o_b_proj(y)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return hfk.children(self, prefix, ("o_a_proj", "o_b_proj"))


class CompressedAttention(nnx.Module):
    """DeepSeek-V4's attention of one layer kind (module docstring).

    Args:
      kind: ``"sliding"``, ``"csa"`` or ``"hca"``.
      num_heads: N; head_dim: H (V4: 512); rope_head_dim: Hr (V4: 64), the trailing dims that
        rotate.
      q_lora_rank: Rq; o_groups, o_lora_rank: the grouped output projection.
      sliding_window: how many tokens (the query's included) each query sees directly.
      compress_rate: tokens per entry (default 4 for CSA, 128 for HCA; unused when sliding).
      index_n_heads, index_head_dim, index_topk: CSA's indexer.
      inputs_shape: ``(batch, length, embed)``; partitioner: how the mesh cuts it (None:
        unsharded).
      rope: this layer kind's `RoPE` (main base for sliding, compressed base for CSA/HCA);
        used interleaved on the trailing Hr dims.
      rms_norm_eps: of every RMS norm.
      query_chunk: queries per step of the attention (`zoo.ops.compressed_attention.attend`;
        ``"auto"``: `choose_query_chunk`, all at once at short lengths).
      index_stage: ``"off"`` (default), ``"warmup"`` or ``"sparse"``: how CSA's indexer
        trains (module docstring; ``"off"`` for sliding and HCA layers, which have none).
      layout: how the sequence lies on the context shards (`zoo.ops.attention`'s
        ``"contiguous"`` / ``"balanced"``, or None: unknown): with one, the sliding branch
        under context parallelism fetches only the ring hops its window can reach (module
        docstring).
      dtype / param_dtype: computation / storage.
    """

    def __init__(self, *, kind: str, num_heads: int, head_dim: int, rope_head_dim: int,
                 q_lora_rank: int, o_groups: int, o_lora_rank: int, sliding_window: int,
                 inputs_shape: Sequence[int], partitioner: Partitioner | None,
                 compress_rate: int | None = None, index_n_heads: int = 64,
                 index_head_dim: int = 128, index_topk: int = 512, rope: RoPE | None = None,
                 rms_norm_eps: float = 1e-6, query_chunk: int | str = "auto",
                 index_stage: str = "off", layout: str | None = None, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        p = resolve(partitioner)
        if kind not in KINDS:
            raise ValueError(f"CompressedAttention: kind={kind!r} must be one of {KINDS}")
        if index_stage not in INDEX_STAGES:
            raise ValueError(f"CompressedAttention: index_stage={index_stage!r} must be one of "
                             f"{INDEX_STAGES} (how the CSA indexer trains: off, the dense "
                             f"warm-up, or sparse)")
        if index_stage != "off" and kind != "csa":
            raise ValueError(f"CompressedAttention: index_stage={index_stage!r} trains CSA's "
                             f"indexer, but kind={kind!r} has none; pass index_stage='off' for "
                             f"sliding and HCA layers")
        check_positive("CompressedAttention", num_heads=num_heads, head_dim=head_dim,
                        q_lora_rank=q_lora_rank, sliding_window=sliding_window)
        if not isinstance(rope_head_dim, int) or rope_head_dim < 2 or rope_head_dim % 2 \
                or rope_head_dim > min(head_dim, index_head_dim if kind == "csa" else head_dim):
            raise ValueError(f"CompressedAttention: rope_head_dim={rope_head_dim!r} must be an "
                             f"even int in 2..head_dim={head_dim} (and index_head_dim for CSA)")
        batch, length, embed = p.check_inputs_shape(inputs_shape, what="CompressedAttention")
        p.check_tokens(batch, length, SCOPE, what="CompressedAttention", balanced=True)
        rate = None
        if kind != "sliding":
            rate = DEFAULT_RATES[kind] if compress_rate is None else compress_rate
            check_positive("CompressedAttention", compress_rate=rate)
        if kind == "csa":
            check_positive("CompressedAttention", index_n_heads=index_n_heads,
                            index_head_dim=index_head_dim, index_topk=index_topk)
        if query_chunk != "auto" and (not isinstance(query_chunk, int) or query_chunk < 1):
            raise ValueError(f"CompressedAttention: query_chunk={query_chunk!r} must be a "
                             f"positive int dividing each shard's queries, or 'auto'")
        if layout not in ring.LAYOUTS:
            raise ValueError(f"CompressedAttention: layout={layout!r}; valid values are "
                             f"{ring.LAYOUTS} (how the sequence lies on the context shards; "
                             f"None: unknown)")
        self.kind, self.rate, self.query_chunk, self.layout = kind, rate, query_chunk, layout
        self.index_stage = index_stage
        self.num_heads, self.head_dim, self.rope_head_dim = num_heads, head_dim, rope_head_dim
        self.q_lora_rank, self.sliding_window = q_lora_rank, sliding_window
        self.index_topk = index_topk if kind == "csa" else None
        self.inputs_shape = (batch, length, embed)
        self.partitioner = p
        self.rope = v4_rope(rope)
        self.eps = rms_norm_eps
        self.scale = head_dim ** -0.5
        kw = dict(partitioner=p, scope=SCOPE, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm_kw = dict(eps=rms_norm_eps, partitioner=p, param_dtype=param_dtype, rngs=rngs)
        self.q_a_proj = Linear(embed, q_lora_rank, in_axes=("embed",), out_axes=(None,), **kw)
        self.q_a_norm = RMSNorm(q_lora_rank, **norm_kw)
        self.q_b_proj = Linear(q_lora_rank, (num_heads, head_dim), in_axes=("q_lora",),
                               out_axes=("heads", "head_dim"), **kw)
        self.kv_proj = Linear(embed, head_dim, in_axes=("embed",), out_axes=(None,), **kw)
        self.kv_norm = RMSNorm(head_dim, **norm_kw)
        self.output = GroupedOutputProjection(
            num_heads=num_heads, head_dim=head_dim, o_groups=o_groups, o_lora_rank=o_lora_rank,
            embed=embed, partitioner=p, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.sinks = nnx.Param(p.param(nnx.initializers.zeros_init(), ("heads",), SCOPE)(
            rngs.params(), (num_heads,), jnp.float32))
        indexer = None
        if kind == "csa":
            indexer = CompressedIndexer(
                num_heads=index_n_heads, head_dim=index_head_dim, rope_head_dim=rope_head_dim,
                q_lora_rank=q_lora_rank, rate=rate, inputs_shape=inputs_shape, partitioner=p,
                rope=self.rope, rms_norm_eps=rms_norm_eps, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs)
        self.compressor = None if kind == "sliding" else Compressor(
            rate=rate, head_dim=head_dim, rope_head_dim=rope_head_dim, overlap=kind == "csa",
            inputs_shape=inputs_shape, partitioner=p, rope=self.rope,
            rms_norm_eps=rms_norm_eps, indexer=indexer, dtype=dtype, param_dtype=param_dtype,
            rngs=rngs)

    # -- steps a subclass may override ----------------------------------------------------------
    def q_latent(self, x: jax.Array) -> jax.Array:
        """``q_a_norm(q_a_proj(x))`` [B, L, Rq] (also the indexer's input)."""
        return self.q_a_norm(self.q_a_proj(x))

    def project(self, x: jax.Array, q_latent: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rotated queries [B, L, N, H] and the shared rotated key/value [B, L, H]."""
        q = self.q_b_proj(q_latent)
        q32 = q.astype(F32)
        q = q * jax.lax.rsqrt(jnp.mean(q32 * q32, -1, keepdims=True) + self.eps).astype(q.dtype)
        q = self.partitioner.constrain(rotate_trailing(self.rope, q, positions,
                                                       self.rope_head_dim), _HEADS, SCOPE)
        kv = self.kv_norm(self.kv_proj(x))
        kv = rotate_trailing(self.rope, kv[:, :, None], positions, self.rope_head_dim)[:, :, 0]
        return q, kv

    def out(self, o: jax.Array, positions: jax.Array) -> jax.Array:
        """Undo the values' rotation at the query position, then the grouped projection."""
        o = rotate_trailing(self.rope, o, positions, self.rope_head_dim, inverse=True)
        return self.partitioner.constrain(self.output(o), ("batch", "length", "act_embed"),
                                          SCOPE)

    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """x [B, L, D] -> [B, L, D]; positions and segment ids [B, L] (None: one document). In
        a training stage (``index_stage``) CSA also sows its indexer's loss as an
        `IndexerLoss` named ``indexer_loss`` (the model collects it)."""
        return self.forward(x, positions, segment_ids, index_stage=self.index_stage)[0]

    def forward(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, *,
                index_stage: str = "off") -> tuple[jax.Array, jax.Array]:
        """`__call__` that also returns the shared rotated key/value [B, L, H] (`project`'s,
        what `prefill` caches for the sliding window); ``index_stage`` (`__call__` passes the
        layer's; the cached calls always select, ``"off"``): module docstring."""
        B, L, _ = x.shape
        if positions.shape != (B, L) or (segment_ids is not None
                                          and segment_ids.shape != (B, L)):
            raise ValueError(f"CompressedAttention: positions {positions.shape} and segment_ids "
                             f"{None if segment_ids is None else segment_ids.shape} must be "
                             f"[B, L] = [{B}, {L}] as x {x.shape}")
        seg = jnp.ones((B, L), jnp.int32) if segment_ids is None else segment_ids
        pos, seg = positions.astype(jnp.int32), seg.astype(jnp.int32)
        with jax.named_scope(f"compressed_attention_{self.kind}"):
            q_lat = self.q_latent(x)
            q, kv = self.project(x, q_lat, pos)
            comp = idx = ()
            params = {"sinks": self.sinks[...]}
            if self.compressor is not None:
                comp = self.compressor.project(x)
                params["bias"] = self.compressor.position_bias[...]
                params["norm"] = self.compressor.kv_norm.scale[...]
            target = ()
            if self.kind == "csa":
                ix = self.compressor.indexer
                iq, iw = ix.queries(jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_lat), pos)
                idx = (iq, iw, *ix.compressor.project(jax.lax.stop_gradient(x)))
                ibias, inorm = ix.compressor.position_bias[...], ix.compressor.kv_norm.scale[...]
                if index_stage == "off":  # the selection alone trains nothing
                    ibias, inorm = jax.lax.stop_gradient((ibias, inorm))
                params["ibias"], params["inorm"] = ibias, inorm
                if index_stage != "off":  # the indexer's target: every head, whole sinks
                    target = (jax.lax.stop_gradient(q),)
                    params["target_sinks"] = jax.lax.stop_gradient(params["sinks"])
            o = self._attend(q, kv, comp, idx, params, pos, seg, target, index_stage)
            if index_stage != "off":
                o, kl = o
                with jax.named_scope("indexer_loss"):
                    self.indexer_loss = IndexerLoss(  # the model pops it
                        jnp.sum(kl[..., 0]) / jnp.maximum(jnp.sum(kl[..., 1]), 1.0))
            return self.out(o, pos), kv

    # -- the cross-token part: one shard's queries (or the whole row) -----------------------------
    def _attend(self, q, kv, comp, idx, params, pos, seg, target=(), index_stage="off"):
        p = self.partitioner
        seq_axes = tuple(p.sequence_axes(SCOPE)) if p.mesh is not None else ()
        if not seq_axes:
            return self.attend_local(q, kv, comp, idx, params, pos, seg, target,
                                     index_stage=index_stage)
        hops = self.sliding_hops(p.axis_size(seq_axes), pos.shape[1])
        # the plan's assumption, checked on the whole batch (one scalar all shards agree on)
        ok = (ring.sequence_order_ok(self.layout, p.axis_size(seq_axes), pos, pos, seg, seg)
              if hops is not None else jnp.ones((), bool))
        local = functools.partial(self.attend_local, axes=seq_axes, index_stage=index_stage,
                                  hops=hops)
        B, _, N, _ = q.shape
        batch_axes = p.batch_axes(SCOPE)
        while batch_axes and B % p.axis_size(batch_axes):
            batch_axes = batch_axes[:-1]
        head_axes = p.mesh_axes("act_heads", SCOPE)
        if N % p.axis_size(head_axes):
            head_axes = ()
        b, s, h = (None if not a else a[0] if len(a) == 1 else tuple(a)
                   for a in (batch_axes, seq_axes, head_axes))
        tok3, tok4 = P(b, s, None), P(b, s, None, None)
        par = {k: P(h) if k == "sinks" else P() for k in params}
        specs = (P(b, s, h, None), tok3, tuple(tok3 for _ in comp),
                 tuple((tok4, tok3, tok3, tok3)[:len(idx)]), par, P(b, s), P(b, s),
                 tuple(tok4 for _ in target), P())
        out = P(b, s, h, None) if index_stage == "off" else (P(b, s, h, None), tok3)
        with jax.named_scope("compressed_attention_cp"):
            return jax.shard_map(local, mesh=p.mesh, in_specs=specs, out_specs=out,
                                 check_vma=False)(q, kv, comp, idx, params, pos, seg, target,
                                                  ok)

    def sliding_hops(self, cp: int, length: int) -> tuple[int, ...] | None:
        """The ring offsets (`zoo.ops.ring.hop_plan`) whose shards hold keys of some query's
        sliding window under this layer's ``layout``, over ``cp`` shards of a ``length``-token
        row; None: every offset (or no layout), and the sliding keys are all-gathered."""
        window = SlidingWindow(self.sliding_window) & Causal() & Document()
        return ring.hop_plan(window.reach(), self.layout, cp, length)

    def attend_local(self, q, kv, comp, idx, params, pos, seg, target=(), ok=None, *,
                     axes=(), index_stage="off", hops=None):
        """Attention of these queries (one shard's, or the row's when ``axes`` is empty) over
        their sliding window and the row's compressed entries (module docstring); in a
        training stage also (out, `local_distillation`'s [B, L, 2]), ``target`` holding the
        queries with every head (under ``stop_gradient``). ``hops`` (`sliding_hops`) and
        ``ok`` (the batch satisfies their plan): the sliding keys come from those ring
        offsets alone, else from the all-gather."""
        kv_pos, kv_seg = pos, seg
        if axes:  # the row's positions and segment ids number its compression windows
            kv_pos, kv_seg = (jax.lax.all_gather(a, axes, axis=1, tiled=True)
                              for a in (pos, seg))
        entries = start = eseg = indices = None
        if self.compressor is not None:
            c = self.compressor
            E = kv_pos.shape[1] // self.rate
            table = ca.window_table(kv_pos, kv_seg, self.rate, E)
            slots, nxt = ca.window_slots(table, pos, seg, self.rate)
            pooled = c.pool(*comp, pos, slots, nxt, bias=params["bias"], num_entries=E,
                            axes=axes)
            entries = c.finish(pooled, table.entry_start, params["norm"], kv.dtype)
            start, eseg = table.entry_start, table.entry_segment_ids
            if self.kind == "csa":
                ix = c.indexer
                iq, iw, ikv, igate = idx
                ipooled = ix.compressor.pool(ikv, igate, pos, slots, nxt, bias=params["ibias"],
                                             num_entries=E, axes=axes)
                ikeys = ix.compressor.finish(ipooled, start, params["inorm"], ikv.dtype)
                if index_stage != "warmup":  # the warm-up attends to every visible entry
                    indices = ix.select_entries(iq, iw, ikeys, start, eseg, self.index_topk,
                                                positions=pos, segment_ids=seg,
                                                query_chunk=self.query_chunk)
        L = pos.shape[1]
        chunk = self.query_chunk
        if chunk == "auto":
            per_query = self.sliding_window + (0 if entries is None else indices.shape[2]
                                               if indices is not None else entries.shape[1])
            chunk = choose_query_chunk(L, per_query)

        def attend(keys, keys_pos, keys_seg, first):  # over these sliding keys
            query_index = jnp.broadcast_to(first + jnp.arange(L, dtype=jnp.int32), pos.shape)
            band = ca.sliding_band(query_index, keys_pos, keys_seg, self.sliding_window)
            o = ca.attend(q, keys, entries, q_positions=pos, q_segment_ids=seg,
                          kv_positions=keys_pos, kv_segment_ids=keys_seg,
                          window=self.sliding_window, entry_start=start,
                          entry_segment_ids=eseg, rate=self.rate or 1, indices=indices,
                          sinks=params["sinks"], scale=self.scale, band=band,
                          query_chunk=chunk)
            if index_stage == "off":
                return o
            with jax.named_scope("indexer_loss"):
                kl = self.local_distillation(
                    target[0], keys, entries, iq, iw, ikeys, params["target_sinks"], pos,
                    seg, kv_positions=keys_pos, kv_segment_ids=keys_seg, entry_start=start,
                    entry_segment_ids=eseg, band=band, indices=indices)
            return o, kl

        def gathered(kv):  # the whole row's sliding keys
            with jax.named_scope("sliding_all_gather"):
                keys = jax.lax.all_gather(kv, axes, axis=1, tiled=True) if axes else kv
            return attend(keys, kv_pos, kv_seg, jax.lax.axis_index(axes) * L if axes else 0)

        if not axes or hops is None:
            return gathered(kv)

        def hopped(kv):  # this shard's keys, then each planned offset's shard's
            blocks = [(kv, pos, seg)]
            with jax.named_scope("sliding_ring_hops"):
                for d in hops:
                    names, pairs = ring.ring_perm(axes, d)
                    blocks.append(tuple(jax.lax.ppermute(a, names, pairs)
                                        for a in (kv, pos, seg)))
            keys, keys_pos, keys_seg = (jnp.concatenate(a, axis=1) for a in zip(*blocks))
            return attend(keys, keys_pos, keys_seg, 0)

        return jax.lax.cond(ok, hopped, gathered, kv)

    def local_distillation(self, q, kv, entries, iq, iw, index_keys, sinks, positions,
                           segment_ids, *, kv_positions, kv_segment_ids, entry_start,
                           entry_segment_ids, band=None, indices=None,
                           query_chunk: int | str | None = "auto") -> jax.Array:
        """The indexer's KL of these queries (`zoo.layers.indexer.distillation_kl`) -> [B, L, 2]
        float32: each query's KL and whether it counts (not padding, some entry visible).

        The target is the main attention's distribution over the compressed entries -- every
        visible one (``indices`` None: the warm-up, attended densely) or the query's selected
        ones (``indices`` [B, L, k]) -- taken from `attend`'s own softmax (sliding keys, those
        entries and the sinks; `zoo.ops.compressed_attention.attention_logits`), each head's
        probabilities of the entries summed over the heads and renormalised over them, under
        ``stop_gradient``: ``q`` [B, L, N, H] (every head), ``kv`` [B, S, H] with its positions
        and segment ids, ``entries`` [B, E, H], ``sinks`` [N], ``band`` (`sliding_band`). The
        indexer's side: its queries ``iq`` [B, L, Ni, Hi], weights ``iw`` [B, L, Ni] and
        compressed keys ``index_keys`` [B, E, Hi] (gradient flows there only). Queries go in
        chunks (``"auto"``: `choose_query_chunk`), each rematerialised in the backward pass."""
        q, kv, entries, sinks = jax.lax.stop_gradient((q, kv, entries, sinks))
        ix = self.compressor.indexer
        L, N = q.shape[1], q.shape[2]
        width = entries.shape[1] if indices is None else indices.shape[2]
        if query_chunk == "auto":
            sliding = kv.shape[1] if band is None else band.shape[2]
            query_chunk = choose_query_chunk(L, (N + 1) * (sliding + width) + ix.num_heads
                                             * width)

        def chunk(args):
            q_c, iq_c, iw_c, pos_c, seg_c, band_c, idx_c = args
            lg = ca.attention_logits(
                q_c, kv, entries, q_positions=pos_c, q_segment_ids=seg_c,
                kv_positions=kv_positions, kv_segment_ids=kv_segment_ids,
                window=self.sliding_window, entry_start=entry_start,
                entry_segment_ids=entry_segment_ids, rate=self.rate, indices=idx_c,
                sinks=sinks, scale=self.scale, band=band_c)
            if idx_c is None:  # every entry of the row
                scores = ix.entry_scores(iq_c, iw_c, index_keys, entry_start,
                                         entry_segment_ids, positions=pos_c,
                                         segment_ids=seg_c)
            else:  # the selected ones, gathered
                (keys,) = gather_keys(idx_c, index_keys)
                scores = ix.score_selected(iq_c, iw_c, keys)
            return jnp.stack(distillation_kl(lg.entries, scores, lg.entry_visible, seg_c != 0,
                                             log_norm=lg.log_norm()), axis=-1)

        return map_query_chunks(chunk, query_chunk,
                                (q, iq, iw, positions, segment_ids, band, indices),
                                what="CompressedAttention.local_distillation")

    # -- generation ----------------------------------------------------------------------------
    # The cache is a dict of arrays, each the layer's state for a batch of single-document
    # rows: ``window_kv`` [B, W, H] / ``window_pos`` [B, W] (the last W tokens' rotated keys at
    # slot ``position % W``, -1: empty), then the compressor's state (`Compressor.state_shape`)
    # and for CSA the indexer's, its names prefixed ``index_``.
    def cache_shape(self, batch: int, max_length: int) -> dict[str, tuple[int, ...]]:
        W = self.sliding_window
        shapes = {"window_kv": (batch, W, self.head_dim), "window_pos": (batch, W)}
        if self.compressor is not None:
            shapes |= self.compressor.state_shape(batch, max_length)
        if self.kind == "csa":
            ix = self.compressor.indexer.compressor
            shapes |= {f"index_{k}": v for k, v in ix.state_shape(batch, max_length).items()}
        return shapes

    def prefill(self, x: jax.Array, *, max_length: int, segment_ids: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The prompts ``x [B, P, D]``, one document per row, left-padded where
        ``segment_ids [B, P]`` is 0 (None: no padding; positions count each row's tokens from
        0) -> (their outputs [B, P, D], the cache for decoding up to ``max_length`` tokens)."""
        B, P, _ = x.shape
        if not 0 < P <= max_length:
            raise ValueError(f"CompressedAttention.prefill: prompt length {P} must be in "
                             f"1..max_length={max_length}")
        if segment_ids is None:
            pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
            seg = jnp.ones((B, P), jnp.int32)
        else:
            seg = (segment_ids != 0).astype(jnp.int32)
            pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0).astype(jnp.int32)
        out, kv = self.forward(x, pos, seg)
        W, rows = self.sliding_window, jnp.arange(B)[:, None]
        # the last W tokens of each row, at slot position % W (padding and older: dropped)
        keep = (seg != 0) & (pos >= jnp.sum(seg, axis=1, keepdims=True) - W)
        slot = jnp.where(keep, pos % W, W)
        cache = {"window_kv": jnp.zeros((B, W, self.head_dim), kv.dtype).at[rows, slot].set(
                     kv, mode="drop"),
                 "window_pos": jnp.full((B, W), -1, jnp.int32).at[rows, slot].set(
                     pos, mode="drop")}
        if self.compressor is not None:
            cache |= self.compressor.prefill_state(x, max_length, segment_ids)
        if self.kind == "csa":
            ix = self.compressor.indexer.compressor
            cache |= {f"index_{k}": v
                      for k, v in ix.prefill_state(x, max_length, segment_ids).items()}
        return out, cache

    def decode(self, x: jax.Array, cache: dict[str, jax.Array], *,
               positions: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One token per row, ``x [B, 1, D]`` at ``positions [B, 1]`` (the next position of
        each row) -> (its output [B, 1, D], the cache after it)."""
        B = x.shape[0]
        if x.shape[1] != 1 or positions.shape != (B, 1):
            raise ValueError(f"CompressedAttention.decode: x {x.shape} and positions "
                             f"{positions.shape} must be [B, 1, D] and [B, 1] (one token a row)")
        pos = positions.astype(jnp.int32)
        t, rows, W = pos[:, 0], jnp.arange(B), self.sliding_window
        q_lat = self.q_latent(x)
        q, kv = self.project(x, q_lat, pos)
        new = dict(cache)
        new["window_kv"] = cache["window_kv"].at[rows, t % W].set(
            kv[:, 0].astype(cache["window_kv"].dtype))
        new["window_pos"] = cache["window_pos"].at[rows, t % W].set(t)
        ones = jnp.ones((B, 1), jnp.int32)
        entries = start = eseg = indices = None
        if self.compressor is not None:
            names = self.compressor.state_shape(B, 1)
            new |= self.compressor.decode_state({k: cache[k] for k in names}, x, pos)
            entries = new["entries"]
            E = entries.shape[1]
            start = jnp.broadcast_to(jnp.arange(E, dtype=jnp.int32) * self.rate, (B, E))
            eseg = jnp.ones((B, E), jnp.int32)
        if self.kind == "csa":
            ix = self.compressor.indexer
            state = ix.compressor.decode_state({k: cache[f"index_{k}"] for k in names}, x, pos)
            new |= {f"index_{k}": v for k, v in state.items()}
            iq, iw = ix.queries(x, q_lat, pos)
            scores = ix.entry_scores(iq, iw, state["entries"], start, eseg, positions=pos,
                                     segment_ids=ones)
            indices = ix.topk(scores, self.index_topk, start)
        o = ca.attend(q, new["window_kv"], entries, q_positions=pos, q_segment_ids=ones,
                      kv_positions=new["window_pos"],
                      kv_segment_ids=(new["window_pos"] >= 0).astype(jnp.int32),
                      window=W, entry_start=start, entry_segment_ids=eseg,
                      rate=self.rate or 1, indices=indices, sinks=self.sinks[...],
                      scale=self.scale)
        return self.out(o, pos), new

    # -- the cached call of zoo.inference (`zoo.layers.attention.LayerCache`) ----------------
    # Every array above is the layer's state (no per-token slots, `zoo.inference.cache.slotted`):
    # the compressed entries grow with ``max_length`` but one per ``rate`` tokens, written as
    # their windows close; prefill returns them for the prompt and the cache pads them.
    @property
    def cache_axes(self) -> dict[str, tuple[str | None, ...]]:
        """Each cache array's logical axes: rows over ``batch``, the rest whole."""
        return {k: ("batch", *(None,) * (len(s) - 1))
                for k, s in self.cache_shape(1, self.rate or 1).items()}

    @property
    def cache_dtypes(self) -> dict[str, jnp.dtype]:
        """Arrays kept in their own dtype: the ring's positions (int32) and the open windows'
        gates (float32, as the compressor pools them)."""
        own = {"window_pos": jnp.dtype(jnp.int32)}
        return own | {k: jnp.dtype(F32) for k in self.cache_axes if k.endswith("_gate")}

    def cache_slots(self, max_length: int) -> int:
        """No per-token slots (see `cache_axes`)."""
        del max_length
        return 0

    # `decode_step` takes T tokens in turn, replacing the state after each: a speculative
    # verify step keeps the state after the first for rows whose draft it rejects
    # (`zoo.layers.attention.LayerCache.replace`)
    replaces_state_per_token = True

    def prefill_cache(self, x: jax.Array, *, positions: jax.Array,
                      segment_ids: jax.Array | None = None
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`prefill` for `zoo.inference`: left-padded prompts (``segment_ids`` 0 before each
        row's tokens; the positions count them from 0) -> (out [B, P, D], the state after
        them, its entries sized for the prompt)."""
        del positions  # one document per row: prefill derives them from the segment ids
        return self.prefill(x, max_length=x.shape[1], segment_ids=segment_ids)

    def decode_step(self, x: jax.Array, cache, *, q_positions: jax.Array,
                    kv_positions: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None,
                    partitioner: Partitioner | None = None) -> jax.Array:
        """T tokens per row from the cache's state (``cache.read`` / ``cache.replace``,
        `zoo.layers.attention.LayerCache`), each a `decode` step in turn: x [B, T, D] at
        ``q_positions [B, T]`` (each row's own) -> [B, T, D], the state replaced after each
        token. The positions and segment ids of other layers' slots are not needed."""
        del kv_positions, kv_segment_ids, partitioner
        state = {k: cache.read(k) for k in self.cache_axes}
        out = []
        for j in range(x.shape[1]):
            y, state = self.decode(x[:, j:j + 1], state, positions=q_positions[:, j:j + 1])
            for k in self.cache_axes:
                cache.replace(k, state[k])
            out.append(y)
        return jnp.concatenate(out, axis=1)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """Hugging Face ``DeepseekV4Attention``'s keys under ``prefix`` (``...self_attn``)."""
        out = [dataclasses.replace(r, path=("output", *r.path))
               for r in self.output.hf_keys(prefix)]
        return (hfk.children(self, prefix, ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj",
                                            "kv_norm"))
                + out + [hfk.copy(("sinks",), hfk.join(prefix, "sinks"))]
                + hfk.child(self, "compressor", prefix))
