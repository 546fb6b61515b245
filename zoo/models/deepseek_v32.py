"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek sparse attention (DSA).

* Everything of `zoo.models.deepseek3` (MLA with a query LoRA and YaRN, dense first layers, the
  sigmoid-routed MoE with a selection bias and shared experts, multi-token prediction), plus a
  lightning indexer in every attention layer (`zoo.layers.Indexer`, under ``self_attn.indexer``
  as in transformers' keys): ``index_n_heads`` heads of ``index_head_dim`` read the query
  latent and the hidden state, score every key, and each query attends only to its
  ``index_topk`` best causal keys of its own document (`zoo.layers.MLA`'s ``index_topk``). The
  selection is computed under ``stop_gradient`` (transformers and DeepSeek's inference; the
  indexer's parameters get no gradient from the language-model loss). Under context
  parallelism (``cp``, ``ep_as_cp``) the top-k is global: index keys are all-gathered for
  the scoring and the selected latents come from an all-gather of the latent (see `MLA`).
* `DeepSeekV32Config` (a `DeepSeek3Config`) has Hugging Face's ``DeepseekV32Config`` field names
  (``model_type`` ``deepseek_v32``): ``index_topk``, ``index_n_heads``, ``index_head_dim``;
  RoPE is always DeepSeek's interleaved layout (``rope_interleave`` is not a V3.2 field), the
  query LoRA is required, and ``mlp_layer_types`` must be ``first_k_dense_replace`` dense
  layers then sparse ones. Presets: `deepseek_v3_2` (deepseek-ai/DeepSeek-V3.2(-Exp), with its
  MTP module) and `mini`.
* `from_hf(path)` / `to_hf(model, path)`: DeepSeek-V3's layout plus
  ``self_attn.indexer.{wq_b,wk,weights_proj}.weight`` and ``self_attn.indexer.k_norm.{weight,
  bias}``; the MTP layer (``model.layers.61``) as V3's.
* Generation (`zoo.inference`): each layer caches the indexer's rotated keys (``index_k``)
  beside MLA's latent; a decoded query selects its top-k cached keys and attends to them.
* Training the indexer as the DeepSeek-V3.2 report does (``index_stage``, zoo-only;
  ``--set index_stage=...``): ``"off"`` (default, and what `from_hf` gives) is the sparse
  forward with no indexer loss; ``"warmup"`` the dense forward, the indexer learning the main
  attention's head-summed distribution by KL (`zoo.layers.indexer.distillation_loss`) while
  the main model is frozen -- the model returns its logits and other aux entries under
  ``stop_gradient`` and `DeepSeekV32.frozen_state` names what the train step must leave
  unchanged (weight decay and the selection-bias update included); ``"sparse"`` the sparse
  forward, the main model on the language-model loss and the indexer (detached input) on the
  KL over its selected keys.
  ``aux["indexer_loss"]`` is the sum over layers (MTP's included) of each layer's mean KL per
  query; `zoo.train.step.loss_fn` adds ``index_loss_weight`` times it.

Legend: as `zoo.models.deepseek3`; Ni index heads, Hi index head dim, k ``index_topk``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.indexer import INDEX_STAGES, IndexerLoss
from zoo.layers.moe import RouterBias
from zoo.models import registry
from zoo.models.config import zoo_field
from zoo.models.decoder import count_params, family_io
from zoo.ops.sparse_attention import check_fetch
from zoo.models.deepseek3 import (FULL_SIZE_MOE, DeepSeek3, DeepSeek3Config,
                                  DeepSeek3DecoderLayer, update_selection_bias)

__all__ = ["DeepSeekV32Config", "DeepSeekV32DecoderLayer", "DeepSeekV32", "from_hf", "to_hf",
           "check_index_training", "index_stage_frozen", "index_stage_outputs"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeekV32Config(DeepSeek3Config):
    """DeepSeek-V3.2 hyper-parameters: `DeepSeek3Config`'s plus the indexer's (Hugging Face's
    ``DeepseekV32Config`` names and defaults)."""

    hf_model_type: ClassVar[str] = "deepseek_v32"
    hf_architecture: ClassVar[str] = "DeepseekV32ForCausalLM"

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    # how the indexer trains (module docstring): "off" | "warmup" | "sparse"
    index_stage: str = zoo_field("off")
    index_loss_weight: float = zoo_field(1.0)  # weight of aux["indexer_loss"] in the loss
    # how the selected keys reach each context shard (`zoo.ops.sparse_attention`'s ``fetch``):
    # "auto" (by bytes, at run time) | "all_gather" | "hops"
    index_fetch: str = zoo_field("auto")

    def __post_init__(self):
        super().__post_init__()
        what = type(self).__name__
        check_index_training(self)
        check_fetch(self.index_fetch, f"{what}: index_fetch")
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what}: {name}={value!r} must be a positive int")
        if self.q_lora_rank is None:
            raise ValueError(f"{what}: q_lora_rank=None; DeepSeek-V3.2's indexer reads the query "
                             f"latent, so q_lora_rank must be set (the checkpoints: 1536)")
        if not self.rope_interleave:
            raise ValueError(f"{what}: rope_interleave=False; DeepSeek-V3.2's MLA always "
                             f"rotates in the interleaved layout (its indexer in the "
                             f"half-split one)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"{what}: index_head_dim={self.index_head_dim} must be at least "
                             f"qk_rope_head_dim={self.qk_rope_head_dim} (the indexer rotates "
                             f"the leading qk_rope_head_dim dims of each head)")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def deepseek_v3_2(cls, **overrides) -> DeepSeekV32Config:
        """deepseek-ai/DeepSeek-V3.2 (and -Exp) as published: DeepSeek-V3's shape with a
        64-head indexer of width 128 and top-2048 keys in each of the 61 layers, plus one MTP
        module; ``num_nextn_predict_layers=0`` is what transformers builds (671,877,929,216
        parameters). Layers rematerialised, MoE as `DeepSeek3Config.deepseek_v3`'s."""
        return cls(**{"remat_policy": "full", "num_nextn_predict_layers": 1, **FULL_SIZE_MOE,
                      **overrides})

    @classmethod
    def mini(cls, **overrides) -> DeepSeekV32Config:
        """`DeepSeek3Config.mini`'s shape with an 8-head indexer of width 32 keeping 64 keys
        per query (a quarter of a 256-token row: the selection prunes)."""
        v3 = DeepSeek3Config.mini()
        base = {f.name: getattr(v3, f.name) for f in dataclasses.fields(DeepSeek3Config)
                if f.init}
        return cls(**{**base, "index_topk": 64, "index_n_heads": 8, "index_head_dim": 32,
                      **overrides})

    # -- Hugging Face config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> DeepSeekV32Config:
        """A ``deepseek_v32`` config.json; ``mlp_layer_types`` (if present) must be
        ``first_k_dense_replace`` dense layers then sparse ones."""
        config = super().from_hf_config(cfg, **overrides)
        kinds = cfg.get("mlp_layer_types")
        if kinds is not None and "first_k_dense_replace" not in overrides:
            k, n = config.first_k_dense_replace, config.num_hidden_layers
            if list(kinds) != ["dense"] * k + ["sparse"] * (n - k):
                raise ValueError(f"{cls.__name__}.from_hf_config: mlp_layer_types={kinds} is "
                                 f"not first_k_dense_replace={k} dense layers followed by "
                                 f"sparse ones, the only pattern zoo builds")
        return config

    def to_hf_config(self) -> dict[str, Any]:
        out = super().to_hf_config()
        out.pop("rope_interleave", None)  # not a DeepseekV32Config field: always interleaved
        return out

    # -- derived quantities --------------------------------------------------------------------
    def num_params(self) -> int:
        return count_params(DeepSeekV32.abstract(self.for_counting()))

    def index_params(self) -> int:
        """One layer's indexer weights (``wq_b``, ``wk``, ``weights_proj``; norms excluded)."""
        D, Ni, Hi = self.hidden_size, self.index_n_heads, self.index_head_dim
        return self.q_lora_rank * Ni * Hi + D * Hi + D * Ni

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training FLOPs per token: `DeepSeek3Config.flops_per_token`'s matmuls with each
        query attending to ``min(index_topk, keys seen)`` keys, plus the indexer forward only
        (its selection is under ``stop_gradient``): its projections and ``2 Ni Hi`` per key
        scored (all causal keys)."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        layers = self.num_hidden_layers + self.mtp_depth
        attn = 2 * self.num_attention_heads * (self.qk_head_dim + self.v_head_dim) * min(
            keys, self.index_topk)
        index = 2 * self.index_params() + 2 * self.index_n_heads * self.index_head_dim * keys
        return 3 * (2 * self.active_matmul_params() + layers * attn) + layers * index


class DeepSeekV32DecoderLayer(DeepSeek3DecoderLayer):
    """DeepSeek-V3's layer with DSA in its MLA (``index_topk`` and the indexer's shape)."""

    def attention_kwargs(self, config: DeepSeekV32Config) -> dict:
        return super().attention_kwargs(config) | dict(
            index_topk=config.index_topk, index_n_heads=config.index_n_heads,
            index_head_dim=config.index_head_dim, index_stage=config.index_stage,
            index_fetch=config.index_fetch)


class DeepSeekV32(DeepSeek3):
    """The DeepSeek-V3.2 causal LM; see `zoo.models.deepseek3.DeepSeek3`."""

    config_cls: ClassVar[type] = DeepSeekV32Config
    decoder_layer_cls: ClassVar[type] = DeepSeekV32DecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("deepseek_v32",)

    def __call__(self, tokens: jax.Array, **kwargs) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`DeepSeek3.__call__`; in a training stage (``config.index_stage``) also
        ``aux["indexer_loss"]``, the layers' sown losses summed (and popped: the model keeps
        no intermediates), and in ``"warmup"`` everything else under ``stop_gradient``."""
        return index_stage_outputs(self, *super().__call__(tokens, **kwargs))

    @property
    def frozen_state(self):
        """`index_stage_frozen` of the config's stage."""
        return index_stage_frozen(self.config.index_stage)


def check_index_training(config) -> None:
    """Construction checks of a config that trains an indexer (``index_stage``,
    ``index_loss_weight``: DeepSeek-V3.2's, GLM-5's, DeepSeek-V4's CSA)."""
    what = type(config).__name__
    if config.index_stage not in INDEX_STAGES:
        raise ValueError(f"{what}: index_stage={config.index_stage!r} must be one of "
                         f"{INDEX_STAGES}: 'off' (sparse forward, no indexer loss), "
                         f"'warmup' (dense forward, only the indexer trains) or 'sparse' "
                         f"(sparse forward, indexer on its KL); --set index_stage=warmup")
    w = config.index_loss_weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
        raise ValueError(f"{what}: index_loss_weight={w!r} must be a finite number >= 0 "
                         f"(the weight of the indexer's KL in the loss)")


def index_stage_outputs(model: nnx.Module, logits: jax.Array, aux: dict[str, jax.Array]
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A model's ``(logits, aux)`` in its ``config.index_stage``: unchanged when ``"off"``;
    else with ``aux["indexer_loss"]``, its layers' sown `IndexerLoss` values summed (and
    popped: the model keeps no intermediates), and in ``"warmup"`` everything else under
    ``stop_gradient`` (the main model is frozen: only the KL has a gradient)."""
    stage = model.config.index_stage
    if stage == "off":
        return logits, aux
    losses = jax.tree.leaves(nnx.pop(model, IndexerLoss))
    if stage == "warmup":
        logits, aux = jax.lax.stop_gradient((logits, aux))
    aux["indexer_loss"] = sum((jnp.sum(v) for v in losses), jnp.zeros((), jnp.float32))
    return logits, aux


def index_stage_frozen(stage: str):
    """The `nnx` filter of variables a train step must leave unchanged in ``stage`` (None:
    none): in ``"warmup"`` every parameter outside the indexers (any path through a module
    named ``indexer``) and the routers' selection bias (DeepSeek's after-step update would
    otherwise move it)."""
    if stage != "warmup":
        return None
    return nnx.All(nnx.Any(nnx.Param, RouterBias), nnx.Not(nnx.PathContains("indexer")))


from_hf, to_hf = family_io(DeepSeekV32, "DeepSeek-V3.2", "Hub layout, bf16/fp32 or block-FP8")

registry.register(registry.Family(
    name="deepseek_v32", config_cls=DeepSeekV32Config, model_cls=DeepSeekV32,
    presets={"deepseek_v3_2": DeepSeekV32Config.deepseek_v3_2, "mini": DeepSeekV32Config.mini},
    after_step=update_selection_bias))
