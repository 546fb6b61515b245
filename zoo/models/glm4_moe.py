"""GLM-4.5 (Zhipu AI's GLM-4-MoE): config presets, model, Hugging Face interop.

* Decoder-only transformer, pre-norm (RMSNorm), untied embedding and ``lm_head``.
* Attention: grouped-query (``num_key_value_heads`` kv heads of ``head_dim``), biases on the
  q/k/v projections (``attention_bias``; none on ``o_proj``), an optional RMSNorm over
  ``head_dim`` on every q and k head (``use_qk_norm``: GLM-4.5 on, Air off), partial rotary
  embeddings: only the first ``partial_rotary_factor * head_dim`` dims of a head rotate
  (half-split layout within that slice, `zoo.layers.RoPE`'s ``partial_rotary_factor``).
* Feed-forward: the first ``first_k_dense_replace`` layers a dense SwiGLU MLP of width
  ``intermediate_size``; the rest an MoE routed as DeepSeek-V3's: sigmoid scores, a
  selection-only ``e_score_correction_bias`` (aux-loss-free balancing, updated after each step
  by the registered hook), group-limited top-k (``n_group``/``topk_group``, 1 in the
  published models), weights normalised and scaled by ``routed_scaling_factor``, plus
  ``n_shared_experts`` shared experts of width ``moe_intermediate_size``.
* `Glm4MoeConfig` (a `zoo.models.config.DecoderConfig`) uses the Hugging Face field names;
  its defaults are transformers' ``Glm4MoeConfig`` defaults (GLM-4.5-Air's shape).
  ``partial_rotary_factor`` is read from config.json's top level or its ``rope_parameters``
  and written to both. The published checkpoints' multi-token-prediction layer
  (``num_nextn_predict_layers=1``: ``model.layers.{num_hidden_layers}.*``) is not part of
  transformers' model, nor of this one: `from_hf` skips its tensors with a warning naming
  them (`Glm4Moe.hf_load_map`).
  Presets: `glm4_5`, `glm4_5_air`, `mini` (vocab 264 = the byte tokenizer's ids padded).
* `from_hf(path)` / `to_hf(model, path)`: the published layout (per-expert
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, router ``mlp.gate``), tensor by tensor.

Legend: B batch, L length, D hidden_size, N heads, K kv heads, H head_dim, E routed experts,
F moe_intermediate_size, V vocab.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

from zoo.layers.attention import Attention
from zoo.layers.rope import RoPE
from zoo.models import deepseek3, registry
from zoo.models.config import DecoderConfig, check_positive
from zoo.models.decoder import CausalLM, DecoderLayer, count_params, family_io
from zoo.models.deepseek3 import DeepSeek3DecoderLayer

__all__ = ["Glm4MoeConfig", "Glm4MoeDecoderLayer", "Glm4Moe", "from_hf", "to_hf"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Glm4MoeConfig(DecoderConfig):
    """GLM-4.5 hyper-parameters; field names and defaults are Hugging Face's
    ``Glm4MoeConfig`` (the shared ones and the zoo-only fields are `DecoderConfig`'s)."""

    hf_model_type: ClassVar[str] = "glm4_moe"
    hf_architecture: ClassVar[str] = "Glm4MoeForCausalLM"
    hf_aliases: ClassVar[dict[str, str]] = {"num_local_experts": "n_routed_experts"}

    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944  # the dense layers' width
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    max_position_embeddings: int = 131072
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    partial_rotary_factor: float = 0.5
    attention_bias: bool = False
    use_qk_norm: bool = False
    moe_intermediate_size: int = 1408  # each routed (and shared) expert's width
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True

    def __post_init__(self):
        what = type(self).__name__
        if self.head_dim is None and self.num_attention_heads:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        super().__post_init__()
        check_positive(self, ("head_dim", "moe_intermediate_size", "num_experts_per_tok",
                              "n_routed_experts", "n_group", "topk_group"))
        self.rope().rotary_dim(self.head_dim)  # factor in (0, 1], an even number of rotary dims
        for name in ("attention_bias", "use_qk_norm", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{what}: {name}={getattr(self, name)!r} must be True or False")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"{what}: first_k_dense_replace={self.first_k_dense_replace} must "
                             f"be between 0 and num_hidden_layers={self.num_hidden_layers}")
        if self.n_shared_experts < 0:
            raise ValueError(f"{what}: n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"{what}: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"n_routed_experts={self.n_routed_experts}; lower it or add experts")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def glm4_5(cls, **overrides) -> Glm4MoeConfig:
        """zai-org/GLM-4.5: 92 layers (3 dense), 160 experts top-8 + 1 shared, 96 heads of 128
        with q/k norms; 352,797,814,784 parameters without the MTP layer. Rematerialised."""
        return cls(**{**dict(
            hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
            num_hidden_layers=92, head_dim=128, n_routed_experts=160, first_k_dense_replace=3,
            routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, rope_theta=1e6,
            remat_policy="full"), **overrides})

    @classmethod
    def glm4_5_air(cls, **overrides) -> Glm4MoeConfig:
        """zai-org/GLM-4.5-Air: 46 layers (1 dense), 128 experts top-8 + 1 shared, 96 heads of
        128; 106,852,245,504 parameters without the MTP layer. Rematerialised."""
        return cls(**{**dict(head_dim=128, attention_bias=True, rope_theta=1e6,
                             remat_policy="full"), **overrides})

    @classmethod
    def mini(cls, **overrides) -> Glm4MoeConfig:
        """A GLM-4.5-shaped reduction that trains on a CPU: 3 layers (1 dense), 16 experts top-4
        + 1 shared, GQA 8/2 heads of 16 with biases, q/k norms and half-rotary heads, vocab 264
        (the byte tokenizer's 259 ids, padded to a multiple of 8)."""
        return cls(**{**dict(
            vocab_size=264, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
            n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5,
            attention_bias=True, use_qk_norm=True, max_position_embeddings=4096),
            **overrides})

    # -- Hugging Face config.json --------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> Glm4MoeConfig:
        """The inherited mapping; ``partial_rotary_factor`` from ``rope_parameters``
        (transformers 5.x keeps it there, and it wins) or the top level (the Hub's spelling)."""
        rope = cfg.get("rope_parameters") or {}
        if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
            cfg = {**cfg, "partial_rotary_factor": rope["partial_rotary_factor"]}
        return super().from_hf_config(cfg, **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        out = super().to_hf_config()
        out["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        return out

    # -- derived quantities --------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def rope(self) -> RoPE:
        return RoPE(theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor)

    def num_params(self) -> int:
        """Parameter count from `nnx.eval_shape` (allocates nothing; bias buffers excluded)."""
        return count_params(Glm4Moe.abstract(self.for_counting()))

    def active_matmul_params(self) -> int:
        """Weights one token multiplies with (top-k + shared experts; no embedding lookup)."""
        D, H, N, K = self.hidden_size, self.head_dim, self.num_attention_heads, \
            self.num_key_value_heads
        attn = D * H * (2 * N + 2 * K)
        moe = D * self.n_routed_experts + 3 * D * self.moe_intermediate_size * (
            self.num_experts_per_tok + self.n_shared_experts)
        return (self.num_hidden_layers * attn + self.num_moe_layers * moe
                + self.first_k_dense_replace * 3 * D * self.intermediate_size
                + D * self.vocab_size)

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training (3x forward) FLOPs per token: ``6 * active_matmul_params`` plus attention
        ``3 * 2 * N * 2H * S`` per layer, ``S`` the keys a query sees on average."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        attn = 2 * self.num_attention_heads * 2 * self.head_dim * keys
        return 3 * (2 * self.active_matmul_params() + self.num_hidden_layers * attn)


class Glm4MoeDecoderLayer(DeepSeek3DecoderLayer):
    """GQA attention (q/k/v biases, optional q/k norms, partial rotary) + (dense MLP for the
    first ``first_k_dense_replace`` layers, else a sigmoid-routed MoE with shared experts:
    DeepSeek-V3's, whose config fields GLM-4.5 shares, so `uses_moe` and `make_moe` are its)."""

    attention_cls: ClassVar[type] = Attention

    def make_attention(self, config: Glm4MoeConfig, *, inputs_shape, partitioner, rngs):
        return self.attention_cls(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, inputs_shape=inputs_shape, partitioner=partitioner,
            rope=config.rope(), use_bias=config.attention_bias, out_bias=False,
            qk_norm=config.use_qk_norm, qk_norm_eps=config.rms_norm_eps,
            **config.attention_options(), rngs=rngs)


class Glm4Moe(CausalLM):
    """The GLM-4.5 causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``;
    see `zoo.models.decoder.CausalLM`. The checkpoint names are the layers' own."""

    config_cls: ClassVar[type] = Glm4MoeConfig
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = Glm4MoeDecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("glm4_moe",)

    def hf_load_map(self, keys: Sequence[str]):
        """`hf_key_map`; the published MTP layers (``model.layers.{L}.*`` past the last decoder
        layer) are skipped with a warning that names them: zoo's GLM-4.5 has no MTP module."""
        L = self.config.num_hidden_layers
        layer_of = {k: int(m[1]) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))}
        mtp = [k for k, i in layer_of.items() if i >= L]
        if mtp:
            names = ", ".join(f"model.layers.{i}.*" for i in sorted({layer_of[k] for k in mtp}))
            warnings.warn(f"GLM-4.5 from_hf: skipping {len(mtp)} tensor(s) of the checkpoint's "
                          f"multi-token-prediction layer(s) {names} (config.json's "
                          f"num_nextn_predict_layers): zoo's glm4_moe has no MTP module, so the "
                          f"{L} decoder layers load without them", stacklevel=4)
        return self.hf_key_map()


from_hf, to_hf = family_io(Glm4Moe, "GLM-4.5", "Hub layout; either rope spelling in config.json")


registry.register(registry.Family(
    name="glm4_moe", config_cls=Glm4MoeConfig, model_cls=Glm4Moe,
    presets={"glm4_5": Glm4MoeConfig.glm4_5, "glm4_5_air": Glm4MoeConfig.glm4_5_air,
             "mini": Glm4MoeConfig.mini},
    after_step=deepseek3.update_selection_bias))  # the selection-bias update, as DeepSeek-V3's
