"""Qwen3.5-MoE (Alibaba's hybrid linear-attention MoE, the language model): a thin Qwen3-Next.

* The architecture of `zoo.models.qwen3_next` (gated DeltaNet and gated attention 3:1,
  zero-centred norms, a sigmoid-gated shared expert) with two differences: gated DeltaNet's
  input projections are separate (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``:
  `zoo.layers.GatedDeltaNet` with ``projections="separate"``), and every layer is sparse with
  renormalised top-k weights (no ``mlp_only_layers``, ``decoder_sparse_step`` or
  ``norm_topk_prob`` in its config). Text positions make its interleaved multimodal RoPE the
  plain partial RoPE.
* `Qwen3_5MoeConfig` uses the Hugging Face field names and defaults of ``Qwen3_5MoeTextConfig``
  (``model_type`` ``qwen3_5_moe_text``). Presets: `qwen3_5_35b_a3b`, `qwen3_5_397b_a17b`,
  `mini`.
* `from_hf(path)` also reads the language model of a multimodal ``qwen3_5_moe`` checkpoint
  (``text_config``; tensors under ``model.language_model.``), ignoring the vision tower with one
  warning; `to_hf` writes the text-only layout.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, ClassVar

from zoo.models import hf, registry
from zoo.models.decoder import count_params, family_io
from zoo.models.qwen3_next import Qwen3Next, Qwen3NextConfig, Qwen3NextDecoderLayer

__all__ = ["Qwen3_5MoeConfig", "Qwen3_5MoeDecoderLayer", "Qwen3_5Moe", "from_hf", "to_hf"]

MULTIMODAL = "qwen3_5_moe"
FIXED = {"decoder_sparse_step": 1, "mlp_only_layers": (), "norm_topk_prob": True}
_warned = set()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3_5MoeConfig(Qwen3NextConfig):
    """Qwen3.5-MoE hyper-parameters (Hugging Face's ``Qwen3_5MoeTextConfig``); the inherited
    ``decoder_sparse_step``, ``mlp_only_layers`` and ``norm_topk_prob`` are fixed (every layer
    sparse, weights renormalised) and ``intermediate_size`` is unused."""

    hf_model_type: ClassVar[str] = "qwen3_5_moe_text"
    hf_architecture: ClassVar[str] = "Qwen3_5MoeForCausalLM"

    vocab_size: int = 248320
    num_hidden_layers: int = 40
    num_experts_per_tok: int = 8
    num_experts: int = 256

    def __post_init__(self):
        super().__post_init__()
        bad = {k: getattr(self, k) for k, v in FIXED.items() if getattr(self, k) != v}
        if bad:
            raise ValueError(f"{type(self).__name__}: {bad} cannot change: every Qwen3.5-MoE "
                             f"layer is sparse with renormalised top-k weights ({FIXED}); use "
                             f"zoo.models.qwen3_next for dense layers or raw top-k weights")

    @classmethod
    def qwen3_5_35b_a3b(cls, **overrides) -> Qwen3_5MoeConfig:
        """Qwen/Qwen3.5-35B-A3B's language model: 40 layers, 256 experts top-8 + a shared
        one; 34,660,610,688 parameters (transformers' count)."""
        return cls(**{**dict(max_position_embeddings=262144, rope_theta=1e7,
                             remat_policy="full"), **overrides})

    @classmethod
    def qwen3_5_397b_a17b(cls, **overrides) -> Qwen3_5MoeConfig:
        """Qwen/Qwen3.5-397B-A17B's language model: 60 layers of 4096, 512 experts top-10 + a
        shared one, 32 heads, linear attention 16/64 heads; 396,346,350,336 parameters
        (transformers' count)."""
        return cls(**{**dict(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                             linear_num_value_heads=64, moe_intermediate_size=1024,
                             shared_expert_intermediate_size=1024, num_experts=512,
                             num_experts_per_tok=10, max_position_embeddings=262144,
                             rope_theta=1e7, remat_policy="full"), **overrides})

    @classmethod
    def mini(cls, **overrides) -> Qwen3_5MoeConfig:
        """Qwen3-Next's `mini` shape (4 layers, 16 experts top-4, vocab 264), Qwen3.5's layout."""
        base = dataclasses.asdict(Qwen3NextConfig.mini())
        keep = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{**{k: v for k, v in base.items() if k in keep
                         and k not in ("dtype", "param_dtype")}, **overrides})

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> Qwen3_5MoeConfig:
        """A ``qwen3_5_moe_text`` config.json, or a multimodal ``qwen3_5_moe`` one (its
        ``text_config``; the vision tower is ignored, with one warning)."""
        if cfg.get("model_type") == MULTIMODAL:
            if MULTIMODAL not in _warned:
                _warned.add(MULTIMODAL)
                warnings.warn("Qwen3_5MoeConfig: a multimodal qwen3_5_moe checkpoint; zoo "
                              "loads its language model and ignores the vision tower "
                              "(model.visual.*)", UserWarning, stacklevel=2)
            text = dict(cfg.get("text_config") or {})
            if "tie_word_embeddings" in cfg:
                text.setdefault("tie_word_embeddings", cfg["tie_word_embeddings"])
            cfg = text
        return super().from_hf_config(cfg, **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        out = super().to_hf_config()
        for key in (*FIXED, "intermediate_size"):
            out.pop(key, None)
        return out

    def num_params(self) -> int:
        return count_params(Qwen3_5Moe.abstract(self.for_counting()))


class Qwen3_5MoeDecoderLayer(Qwen3NextDecoderLayer):
    """`Qwen3NextDecoderLayer` with gated DeltaNet's separate input projections."""

    def make_attention(self, config, *, inputs_shape, partitioner, rngs):
        if config.kinds[self.layer_idx] != "linear_attention":
            return super().make_attention(config, inputs_shape=inputs_shape,
                                          partitioner=partitioner, rngs=rngs)
        return self.linear_attention_cls(
            num_key_heads=config.linear_num_key_heads,
            num_value_heads=config.linear_num_value_heads,
            key_head_dim=config.linear_key_head_dim, value_head_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim, norm_eps=config.rms_norm_eps,
            projections="separate", max_pieces=config.linear_max_pieces,
            inputs_shape=inputs_shape, partitioner=partitioner,
            dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)


def _renamed(row, old: str, new: str):
    if isinstance(row, hf.LayerStack):
        return dataclasses.replace(row, rows=tuple(_renamed(r, old, new) for r in row.rows))
    return dataclasses.replace(row, keys=tuple(new + k[len(old):] if k.startswith(old) else k
                                               for k in row.keys))


class Qwen3_5Moe(Qwen3Next):
    """The Qwen3.5-MoE causal LM; see `zoo.models.qwen3_next.Qwen3Next`."""

    config_cls: ClassVar[type] = Qwen3_5MoeConfig
    decoder_layer_cls: ClassVar[type] = Qwen3_5MoeDecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("qwen3_5_moe_text", MULTIMODAL)

    def hf_load_map(self, keys):
        """The text-only key map, or, for a multimodal checkpoint (tensors under
        ``model.language_model.``), the same rows under that prefix."""
        rows = self.hf_key_map()
        if not any(k.startswith("model.language_model.") for k in keys):
            return rows
        return [_renamed(r, "model.", "model.language_model.") for r in rows]


from_hf, to_hf = family_io(Qwen3_5Moe, "Qwen3.5-MoE", "qwen3_5_moe_text, or a multimodal "
                                                      "qwen3_5_moe (language model only)")

registry.register(registry.Family(
    name="qwen3_5_moe", config_cls=Qwen3_5MoeConfig, model_cls=Qwen3_5Moe,
    presets={"qwen3_5_35b_a3b": Qwen3_5MoeConfig.qwen3_5_35b_a3b,
             "qwen3_5_397b_a17b": Qwen3_5MoeConfig.qwen3_5_397b_a17b,
             "mini": Qwen3_5MoeConfig.mini}))
