"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's sparse attention with top-k shared across layers.

* Everything of `zoo.models.deepseek_v32` (MLA with a query LoRA, dense first layers, the
  sigmoid-routed MoE with a selection bias and a shared expert, a lightning indexer picking
  each query's ``index_topk`` keys), with GLM-5's differences as transformers'
  ``GlmMoeDsaForCausalLM`` has them:
  - the indexer rotates its leading ``qk_rope_head_dim`` dims in the *interleaved* layout
    (`zoo.layers.Indexer`'s ``rope_interleaved=True``; DeepSeek-V3.2's is half-split);
  - MLA's ``q_a_layernorm`` / ``kv_a_layernorm`` keep eps 1e-6 whatever ``rms_norm_eps``;
  - ``indexer_types`` (one per layer): a ``"full"`` layer runs its indexer; a ``"shared"``
    layer has no indexer parameters and attends to the keys the previous full layer selected
    (the cross-layer top-k sharing of arXiv 2603.12201). ``None`` (the default, GLM-5 as
    published): every layer full.
* The selection travels from layer to layer with the residual stream: inside the trunk each
  layer takes and returns ``(hidden [B, L, D], indices [B, L, k])`` (`GlmMoeDsaDecoderLayer`),
  so a scanned stack (`zoo.models.stacks.run_layers` / `run_cycle`) carries it through
  `jax.lax.scan` with no change there; full and shared layers are different layer kinds, so a
  repeating pattern (full, shared, ...) is scanned as a cycle. Under context parallelism the
  indices name places in the whole row (`zoo.layers.Indexer.select`) and sit with their
  queries, so a shared layer reads them as its own.
* `GlmMoeDsaConfig` (a `DeepSeekV32Config`) has Hugging Face's ``GlmMoeDsaConfig`` names and
  defaults (no YaRN: ``rope_scaling=None``); ``from_hf_config`` also reads the
  ``index_topk_pattern`` / ``index_topk_freq`` / ``index_skip_topk_offset`` spellings that
  transformers turns into ``indexer_types``. Presets: `glm5` (zai-org/GLM-5 and GLM-5.1:
  743,911,199,232 parameters as transformers builds it, plus one MTP module as published) and
  `mini` (alternating full and shared layers).
* `from_hf(path)` / `to_hf(model, path)`: DeepSeek-V3.2's keys; a shared layer has no
  ``self_attn.indexer.*``.
* Training the indexer (``index_stage``, as `zoo.models.deepseek_v32`): each full layer trains
  its own indexer (`GlmMoeDsaAttention.train_with`); a shared layer has none and runs dense in
  ``"warmup"``, over the carried selection in ``"sparse"``.
* Generation (`zoo.inference`): the same stream, ``(hidden [B, T, D], selection [B, T,
  index_topk])`` (`GlmMoeDsa.stream_in`), runs through the cached calls: at prefill and at
  each decode step a full layer selects among its own ``index_k`` cache and the shared layers
  after it attend to those slots of their ``latent_pe`` cache (every layer's cache has the
  same slots), so a shared layer caches no index keys. A model whose layers are all full
  (GLM-5 as published) streams the plain hidden state and generates as DeepSeek-V3.2 does.
  Speculative decoding (``speculative="mtp"``) runs the same stream; its MTP layer is full.

Legend: as `zoo.models.deepseek_v32`; k = ``min(index_topk, L)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from zoo.layers.attention import SCOPE, check_call, reshard
from zoo.layers.mla import MLA
from zoo.layers.rope import YaRN
from zoo.models import registry
from zoo.models.config import nullable
from zoo.models.decoder import count_params, family_io
from zoo.models.deepseek3 import FULL_SIZE_MOE, DeepSeek3Config, update_selection_bias
from zoo.models.deepseek_v32 import DeepSeekV32, DeepSeekV32Config, DeepSeekV32DecoderLayer
from zoo.models.stacks import layer_groups
from zoo.partitioning import Partitioner, resolve

__all__ = ["GlmMoeDsaConfig", "GlmMoeDsaAttention", "GlmMoeDsaDecoderLayer", "GlmMoeDsa",
           "INDEXER_TYPES", "from_hf", "to_hf"]

INDEXER_TYPES = ("full", "shared")
# MLA's q_a_layernorm and kv_a_layernorm in transformers' GLM-5 (their RMSNorm's default eps)
MLA_NORM_EPS = 1e-6
_INDICES = ("batch", "length", None)


def indexer_pattern(num_layers: int, *, pattern: Any = None, freq: Any = 1,
                    offset: Any = 2) -> tuple[str, ...]:
    """transformers' rule for the per-layer indexer types when config.json has no
    ``indexer_types``: ``pattern`` ("FSSF...", or a list) wins; else layer ``i`` is full when
    ``max(i - offset + 1, 0) % max(freq, 1) == 0``."""
    if pattern is not None:
        if isinstance(pattern, str):
            table = {"F": "full", "S": "shared"}
            if set(pattern) - set(table):
                raise ValueError(f"index_topk_pattern={pattern!r} must hold only 'F' (full) "
                                 f"and 'S' (shared)")
            return tuple(table[c] for c in pattern)
        return tuple(pattern)
    freq = max(int(freq), 1)
    return tuple("full" if max(i - int(offset) + 1, 0) % freq == 0 else "shared"
                 for i in range(num_layers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GlmMoeDsaConfig(DeepSeekV32Config):
    """GLM-5 hyper-parameters: `DeepSeekV32Config`'s with Hugging Face's ``GlmMoeDsaConfig``
    defaults, plus ``indexer_types`` (None: every layer ``"full"``)."""

    hf_model_type: ClassVar[str] = "glm_moe_dsa"
    hf_architecture: ClassVar[str] = "GlmMoeDsaForCausalLM"

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_routed_experts: int = 256
    kv_lora_rank: int = 512
    q_lora_rank: int | None = nullable(2048)
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 3
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    rope_scaling: YaRN | None = None
    index_n_heads: int = 32
    # per layer "full" (runs its indexer) or "shared" (reuses the previous full layer's top-k)
    indexer_types: tuple[str, ...] | None = None

    def __post_init__(self):
        if isinstance(self.indexer_types, list):
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        super().__post_init__()
        what = type(self).__name__
        kinds, n = self.indexer_types, self.num_hidden_layers
        if kinds is not None:
            if not isinstance(kinds, tuple) or any(k not in INDEXER_TYPES for k in kinds):
                raise ValueError(f"{what}: indexer_types={kinds!r} must be a list of "
                                 f"{INDEXER_TYPES} (one per layer), or None for all 'full'")
            if len(kinds) != n:
                raise ValueError(f"{what}: indexer_types has {len(kinds)} entries but "
                                 f"num_hidden_layers={n}; give one per layer (e.g. --set "
                                 f"indexer_types='[\"full\", \"shared\", ...]') or None (all "
                                 f"full)")
            if kinds and kinds[0] != "full":
                raise ValueError(f"{what}: indexer_types[0]={kinds[0]!r}; the first layer must "
                                 f"be 'full' (a 'shared' layer reuses an earlier layer's top-k)")

    def indexer_type(self, layer_idx: int) -> str:
        """``"full"`` or ``"shared"`` for layer `layer_idx` (MTP layers, past the trunk: full)."""
        if self.indexer_types is None or layer_idx >= self.num_hidden_layers:
            return "full"
        return self.indexer_types[layer_idx]

    @property
    def num_full_layers(self) -> int:
        """Layers (of the trunk) that run an indexer."""
        return sum(self.indexer_type(i) == "full" for i in range(self.num_hidden_layers))

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def glm5(cls, **overrides) -> GlmMoeDsaConfig:
        """zai-org/GLM-5 (and GLM-5.1, the same shape) as published: 78 layers (3 dense), 256
        routed experts of width 2048 (top 8) + 1 shared, MLA (q/kv LoRA 2048/512, heads of
        192 + 64 / 256), a 32-head indexer of width 128 keeping 2048 keys in every layer,
        RoPE theta 1e6 without scaling, plus one MTP module. ``num_nextn_predict_layers=0``
        is what transformers builds: 743,911,199,232 parameters. Layers rematerialised, MoE
        as `DeepSeek3Config.deepseek_v3`'s."""
        return cls(**{"rope_theta": 1_000_000.0, "remat_policy": "full",
                      "num_nextn_predict_layers": 1, **FULL_SIZE_MOE, **overrides})

    @classmethod
    def mini(cls, **overrides) -> GlmMoeDsaConfig:
        """`DeepSeekV32Config.mini`'s widths (8-head indexer of width 32, top-64 keys) with 5
        layers whose indexers alternate full and shared (the MoE layers 1-4 scan as a cycle
        of two); with another ``num_hidden_layers`` the alternation is kept."""
        v32 = DeepSeekV32Config.mini()
        base = {f.name: getattr(v32, f.name) for f in dataclasses.fields(DeepSeek3Config)
                if f.init}
        base.update(index_topk=64, index_n_heads=8, index_head_dim=32, num_hidden_layers=5,
                    rms_norm_eps=1e-5)
        n = overrides.get("num_hidden_layers", base["num_hidden_layers"])
        base["indexer_types"] = tuple("full" if i % 2 == 0 else "shared" for i in range(n))
        return cls(**{**base, **overrides})

    # -- Hugging Face config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> GlmMoeDsaConfig:
        """A ``glm_moe_dsa`` config.json; without ``indexer_types``, transformers' pattern
        keys (``index_topk_pattern``, ``index_topk_freq``, ``index_skip_topk_offset``)."""
        if cfg.get("indexer_types") is None and "indexer_types" not in overrides:
            n = overrides.get("num_hidden_layers", cfg.get("num_hidden_layers",
                                                           cls.num_hidden_layers))
            cfg = {**cfg, "indexer_types": list(indexer_pattern(
                n, pattern=cfg.get("index_topk_pattern"), freq=cfg.get("index_topk_freq", 1),
                offset=cfg.get("index_skip_topk_offset", 2)))}
        return super().from_hf_config(cfg, **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        out = super().to_hf_config()
        out["indexer_types"] = [self.indexer_type(i) for i in range(self.num_hidden_layers)]
        return out

    # -- derived quantities --------------------------------------------------------------------
    def num_params(self) -> int:
        return count_params(GlmMoeDsa.abstract(self.for_counting()))

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """`DeepSeekV32Config.flops_per_token` with the indexer's work only in the full layers
        (and the MTP layers, which are full)."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        index = 2 * self.index_params() + 2 * self.index_n_heads * self.index_head_dim * keys
        all_full = super().flops_per_token(seq_len, causal=causal)
        return all_full - (self.num_hidden_layers - self.num_full_layers) * index


class GlmMoeDsaAttention(MLA):
    """`MLA` with DSA whose top-k may come from an earlier layer.

    ``index_shared=False``: a full layer, `MLA` with its indexer (interleaved RoPE for GLM-5).
    ``index_shared=True``: no indexer; it attends to the ``selection`` it is given.
    In the model each call takes the selection carried to it and returns, beside its output,
    the one to carry on (`share`): ``attend_with`` (training), ``prefill_cache`` /
    ``decode_step`` with the selection after their own arguments (`zoo.inference`, through
    `GlmMoeDsaDecoderLayer.block`). Without one they are `MLA`'s (a full layer alone).
    """

    def __init__(self, *, index_shared: bool = False, **kwargs):
        topk = kwargs.get("index_topk")
        if index_shared and topk is None:
            raise ValueError("GlmMoeDsaAttention: index_shared=True needs index_topk (the "
                             "number of keys the shared selection holds)")
        stage = kwargs.get("index_stage", "off")  # a shared layer has no indexer to train
        super().__init__(**{**kwargs, "index_topk": None if index_shared else topk,
                            "index_stage": "off" if index_shared else stage})
        self.index_stage = stage
        self.index_shared = bool(index_shared)
        self.index_topk = topk

    def share(self, selection: jax.Array | None, n_keys: int, select
              ) -> tuple[jax.Array, jax.Array]:
        """(the keys this layer attends to [B, T, k], k = ``min(index_topk, n_keys)``; the
        selection it carries on): a full layer's own (``select()``), carried padded with -1
        (empty) to the incoming ``selection``'s width; a shared layer's the incoming one, cut
        to k and carried unchanged. The carried width is fixed for the whole stack
        (`GlmMoeDsa.stream_in`: ``index_topk``, while a layer's k shrinks with fewer keys)."""
        k = min(self.index_topk, n_keys)
        width = None if selection is None else selection.shape[-1]
        if width is not None and width < k:
            raise ValueError(f"GlmMoeDsaAttention: the carried selection holds {width} keys "
                             f"per query, fewer than this layer's {k} (min(index_topk, "
                             f"{n_keys} keys)); carry index_topk={self.index_topk} columns")
        if self.indexer is not None:
            own = select()
            if selection is None:
                return own, own
            pad = [(0, 0)] * (own.ndim - 1) + [(0, width - own.shape[-1])]
            return own, jnp.pad(own, pad, constant_values=-1)
        if selection is None:
            raise ValueError("GlmMoeDsaAttention: a shared layer (index_shared=True) "
                             "needs the selection of a full layer before it; the model's "
                             "first layer must be 'full' (indexer_types)")
        return selection[..., :k], selection

    def sparse_with(self, x: jax.Array, selection: jax.Array | None, *, positions: jax.Array,
                    segment_ids: jax.Array | None
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The DSA forward pass over the selection `share` gives -> (out [B, L, D], the
        selection carried on, k_pe [B, L, 1, Hr] rotated, latent [B, L, Rkv])."""
        check_call(self, x, positions, segment_ids)
        c = self.partitioner.constrain
        with jax.named_scope(self.block_name):
            x = c(x, ("batch", "length", "act_embed"), SCOPE)
            with jax.named_scope("project"):
                q_latent, q, k_pe, latent = self.project_all(x)
            with jax.named_scope("select"):
                indices, carried = self.share(selection, x.shape[1], lambda: self.indexer.select(
                    x, q_latent, self.index_topk, positions=positions, segment_ids=segment_ids))
            indices, carried = c(indices, _INDICES, SCOPE), c(carried, _INDICES, SCOPE)
            with jax.named_scope("rope"):
                q, k_pe = self.apply_rope(q, k_pe, positions)
            with jax.named_scope("attend"):
                o = self.attend_selected(q, k_pe, latent, indices, positions=positions,
                                         segment_ids=segment_ids)
            with jax.named_scope("out"):
                return self.out(o), carried, k_pe, latent

    def attend_with(self, x: jax.Array, selection: jax.Array | None, *, positions: jax.Array,
                    segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [B, L, D] and the previous full layer's ``selection`` [B, L, >= k] (None before
        any) -> (out [B, L, D], the selection carried on: `share`)."""
        if self.index_stage != "off":
            return self.train_with(x, selection, positions=positions, segment_ids=segment_ids)
        return self.sparse_with(x, selection, positions=positions, segment_ids=segment_ids)[:2]

    def train_with(self, x: jax.Array, selection: jax.Array | None, *, positions: jax.Array,
                   segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """`attend_with` in a training stage (``index_stage``): a full layer runs
        `MLA.index_training_call` (its indexer's KL sown) and carries its selection on as
        `share` does ("sparse") or the incoming one ("warmup", which selects nothing); a
        shared layer runs dense attention in "warmup" and attends to the carried selection in
        "sparse"."""
        if self.indexer is not None:
            out, own = self.index_training_call(x, positions=positions,
                                                segment_ids=segment_ids)
            if own is None:
                return out, selection
            _, carried = self.share(selection, x.shape[1], lambda: own)
            return out, self.partitioner.constrain(carried, _INDICES, SCOPE)
        if self.index_stage == "warmup":
            return MLA.__call__(self, x, positions=positions, segment_ids=segment_ids), selection
        return self.sparse_with(x, selection, positions=positions, segment_ids=segment_ids)[:2]

    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """A full layer alone (`attend_with` with no incoming selection); a shared layer has
        nothing to attend with and raises."""
        return self.attend_with(x, None, positions=positions, segment_ids=segment_ids)[0]

    @staticmethod
    def _one(selection: tuple) -> jax.Array | None:
        if len(selection) > 1:
            raise TypeError(f"GlmMoeDsaAttention: one carried selection expected, got "
                            f"{len(selection)} arrays")
        return selection[0] if selection else None

    def prefill_cache(self, x: jax.Array, *selection: jax.Array, positions: jax.Array,
                      segment_ids: jax.Array | None = None):
        """`MLA.prefill_cache`; with the carried ``selection``: ((out, the selection carried
        on), cache arrays: ``latent_pe``, and a full layer's ``index_k``)."""
        if not selection and not self.index_shared:
            return super().prefill_cache(x, positions=positions, segment_ids=segment_ids)
        out, carried, k_pe, latent = self.sparse_with(x, self._one(selection),
                                                      positions=positions,
                                                      segment_ids=segment_ids)
        entry = self.cache_entry(k_pe, latent)
        if self.indexer is not None:
            x = self.partitioner.constrain(x, ("batch", "length", "act_embed"), SCOPE)
            entry["index_k"] = jax.lax.stop_gradient(
                self.indexer.keys(x, positions))[:, None].astype(latent.dtype)
        return (out, carried), entry

    def decode_step(self, x: jax.Array, put, *selection: jax.Array, q_positions: jax.Array,
                    kv_positions: jax.Array, kv_segment_ids: jax.Array,
                    partitioner: Partitioner | None = None):
        """`MLA.decode_step`; with the carried ``selection`` [B, T, >= k] (array indices into
        the cache's slots): (out, the selection carried on). A full layer selects among its
        ``index_k`` cache as `MLA` does; either kind then attends to its selected slots of
        ``latent_pe`` in the absorbed form."""
        if not selection and not self.index_shared:
            return super().decode_step(x, put, q_positions=q_positions,
                                       kv_positions=kv_positions, kv_segment_ids=kv_segment_ids,
                                       partitioner=partitioner)
        p = resolve(partitioner)
        rows = ("batch", None, None, None)
        q_seg = jnp.ones(q_positions.shape, jnp.int32)
        with jax.named_scope(self.block_name):
            q_latent, q, k_pe, latent = self.project_all(x)
            q, k_pe = self.apply_rope(q, k_pe, q_positions)

            def select():
                iq, iw = self.indexer.queries(x, q_latent, q_positions)
                new_k = self.indexer.keys(x, q_positions)[:, None].astype(latent.dtype)
                index_k = put("index_k", reshard(p, new_k, rows))
                scores = self.indexer.score(iq, iw, index_k[:, 0], q_positions=q_positions,
                                            kv_positions=kv_positions, q_segment_ids=q_seg,
                                            kv_segment_ids=kv_segment_ids)
                return self.indexer.topk(scores, self.index_topk, kv_positions)

            indices, carried = self.share(self._one(selection), kv_positions.shape[1], select)
            new = self.cache_entry(k_pe, latent)["latent_pe"]
            cache = put("latent_pe", reshard(p, new, rows))
            out = self.attend_slots(q, cache, indices, q_positions=q_positions,
                                    kv_positions=kv_positions, kv_segment_ids=kv_segment_ids,
                                    partitioner=p)
            return out, carried


class GlmMoeDsaDecoderLayer(DeepSeekV32DecoderLayer):
    """DeepSeek-V3.2's layer with GLM-5's attention; full and shared layers are different
    kinds (`layer_kind`). On a stream ``(hidden, selection)`` it returns ``((hidden,
    selection), aux)``, the selection carried on (`block`); on a plain hidden state (a full
    layer alone, e.g. an MTP module's) a plain hidden state."""

    attention_cls: ClassVar[type] = GlmMoeDsaAttention

    @classmethod
    def layer_kind(cls, config: GlmMoeDsaConfig, layer_idx: int) -> Any:
        return cls.uses_moe(config, layer_idx), config.indexer_type(layer_idx)

    def attention_kwargs(self, config: GlmMoeDsaConfig) -> dict:
        return super().attention_kwargs(config) | dict(
            rms_norm_eps=MLA_NORM_EPS, index_rope_interleaved=True,
            index_shared=config.indexer_type(self.layer_idx) == "shared")

    def block(self, x, attention, **kwargs):
        """`DecoderLayer.block`; on a stream ``(hidden, selection)`` the attention is called
        as ``attention(h, selection) -> (out, selection carried on)`` (`__call__` passes
        `GlmMoeDsaAttention.attend_with`, `zoo.inference` its cached calls) and the layer
        returns ``((hidden, selection), aux)``."""
        if not isinstance(x, tuple):
            return super().block(x, attention, **kwargs)
        h, selection = x
        carried = {}

        def attend(y):
            out, carried["selection"] = attention(y, selection)
            return out

        h, aux = super().block(h, attend, **kwargs)
        return (h, carried["selection"]), aux

    def __call__(self, x, *, positions: jax.Array, segment_ids: jax.Array | None = None):
        def attention(y, *selection):
            if selection:
                return self.self_attn.attend_with(y, *selection, positions=positions,
                                                  segment_ids=segment_ids)
            return self.self_attn(y, positions=positions, segment_ids=segment_ids)

        return self.block(x, attention)


class GlmMoeDsa(DeepSeekV32):
    """The GLM-5 causal LM; see `zoo.models.deepseek_v32.DeepSeekV32`. The trunk carries the
    top-k selection from layer to layer beside the residual stream (module docstring)."""

    config_cls: ClassVar[type] = GlmMoeDsaConfig
    decoder_layer_cls: ClassVar[type] = GlmMoeDsaDecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("glm_moe_dsa",)

    def trunk(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None
              ) -> tuple[jax.Array, list[dict[str, jax.Array]]]:
        """`CausalLM.trunk` with ``(hidden, indices)`` through the layers; the first layer is
        full, so the initial indices (zeros of the selection's shape) are never read."""
        B, L = tokens.shape
        k = min(self.config.index_topk, L)
        indices = self.partitioner.constrain(jnp.zeros((B, L, k), jnp.int32), _INDICES,
                                             SCOPE)
        carry = (self.embed_tokens(tokens), indices)
        auxes = []
        for group in layer_groups(self.layers):
            carry, aux = self.run_group(group, carry, positions, segment_ids)
            if aux is not None:
                auxes.append(aux)
        return carry[0], auxes

    def stream_in(self, tokens: jax.Array) -> tuple[Any, dict[str, Any]]:
        """`CausalLM.stream_in` for `zoo.inference`: with shared layers the stream is
        ``(embedding [B, T, D], selection [B, T, index_topk])``, the selection empty (-1) until
        the first (full) layer fills it: a prompt of L tokens, or a cache of S slots, gives each
        layer ``min(index_topk, L or S)`` keys, which `GlmMoeDsaAttention.share` pads to this
        fixed width. Without shared layers, the plain embedding."""
        x, kwargs = super().stream_in(tokens)
        if self.config.num_full_layers == self.config.num_hidden_layers:
            return x, kwargs
        empty = jnp.full((*tokens.shape, self.config.index_topk), -1, jnp.int32)
        return (x, self.partitioner.constrain(empty, _INDICES, SCOPE)), kwargs

    def stream_out(self, x: Any) -> jax.Array:
        """The hidden state of `stream_in`'s stream (the selection dropped)."""
        return x[0] if isinstance(x, tuple) else x


from_hf, to_hf = family_io(GlmMoeDsa, "GLM-5", "Hub layout, bf16/fp32 or block-FP8")

registry.register(registry.Family(
    name="glm_moe_dsa", config_cls=GlmMoeDsaConfig, model_cls=GlmMoeDsa,
    presets={"glm5": GlmMoeDsaConfig.glm5, "mini": GlmMoeDsaConfig.mini},
    after_step=update_selection_bias))
