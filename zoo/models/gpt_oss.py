"""gpt-oss (OpenAI's open-weight MoE): config presets, model, Hugging Face interop.

* Decoder-only transformer, pre-norm (RMSNorm), untied embedding and ``lm_head``.
* Attention: grouped-query (``num_key_value_heads`` kv heads of ``head_dim``) with biases on
  q/k/v/o, a learned sink logit per head in every softmax (`zoo.layers.Attention`'s
  ``sinks=True``), RoPE (half-split) with YaRN; ``layer_types`` alternates
  ``"sliding_attention"`` (a window of ``sliding_window`` = 128 keys; under ring context
  parallelism the hop plan moves only the hops the window can see) and ``"full_attention"``.
  Layers of different kinds never share a stack; scanned, the alternating layers are one
  cycle of two stacks, a (sliding, full) pair a scan step (`zoo.models.stacks.layer_cycles`).
* Feed-forward: every layer an MoE of ``num_local_experts`` experts of width
  ``intermediate_size``: router logits with a bias, softmax over the top
  ``num_experts_per_tok`` logits; experts with biases and the clamped SwiGLU
  ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``, ``gate <= swiglu_limit``, ``up`` in
  ``[-swiglu_limit, swiglu_limit]`` (`zoo.ops.grouped.GLU`); gate and up interleaved in one
  weight (``gate_up_proj``, gate in the even columns), as the checkpoints store them.
* `GptOssConfig` (a `zoo.models.config.DecoderConfig`) uses the Hugging Face field names and
  defaults (gpt-oss-120b's shape). Presets: `gpt_oss_20b`, `gpt_oss_120b`, `mini`.
* `from_hf(path)`: bf16/fp32 checkpoints (transformers' ``save_pretrained``) and the published
  MXFP4 ones (``*_blocks``/``*_scales`` experts, dequantized tensor by tensor while loading,
  `zoo.models.hf_quant.dequantize_mxfp4`); `to_hf(model, path)` writes bf16/fp32, never MXFP4.

Legend: B batch, L length, D hidden_size, N heads, K kv heads, H head_dim, E experts,
F intermediate_size, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from zoo.layers.attention import Attention
from zoo.layers.moe import MoE
from zoo.layers.rope import RoPE, YaRN
from zoo.models import registry
from zoo.models.config import DecoderConfig, check_positive
from zoo.models.decoder import CausalLM, DecoderLayer, count_params, family_io
from zoo.ops.grouped import GLU

__all__ = ["GptOssConfig", "GptOssDecoderLayer", "GptOssMoE", "GptOss", "from_hf", "to_hf"]

LAYER_TYPES = ("sliding_attention", "full_attention")
# 4k pre-training context stretched 32x; no ramp truncation (transformers' default for gpt-oss)
OSS_YARN = YaRN(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                beta_slow=1.0, truncate=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssConfig(DecoderConfig):
    """gpt-oss hyper-parameters; field names and defaults are Hugging Face's ``GptOssConfig``
    (``layer_types`` None: sliding and full layers alternate, sliding first; that pattern
    given explicitly is stored as None too, see `kinds`)."""

    hf_model_type: ClassVar[str] = "gpt_oss"
    hf_architecture: ClassVar[str] = "GptOssForCausalLM"
    hf_supported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **DecoderConfig.hf_supported, "attention_bias": (True,)}
    hf_constants: ClassVar[dict[str, Any]] = {**DecoderConfig.hf_constants,
                                              "attention_bias": True}
    hf_aliases: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts",
                                            "experts_per_token": "num_experts_per_tok"}
    aux_loss_field: ClassVar[str] = "router_aux_loss_coef"

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880  # each expert's width
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    max_position_embeddings: int = 131072
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: YaRN | None = OSS_YARN
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001  # weight of aux["load_balance_loss"] in the loss

    def __post_init__(self):
        what = type(self).__name__
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", YaRN(**self.rope_scaling))
        if self.layer_types is not None:  # the default pattern is stored as None, so a
            types = tuple(self.layer_types)  # changed num_hidden_layers re-derives it
            object.__setattr__(self, "layer_types", None if types == tuple(
                LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)) else types)
        super().__post_init__()
        check_positive(self, ("head_dim", "num_local_experts", "num_experts_per_tok",
                              "sliding_window"))
        if len(self.kinds) != self.num_hidden_layers or not set(self.kinds) <= set(LAYER_TYPES):
            raise ValueError(f"{what}: layer_types={list(self.kinds)} must name one of "
                             f"{LAYER_TYPES} for each of the {self.num_hidden_layers} layers "
                             f"(or be None: alternating, sliding first)")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"{what}: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_local_experts={self.num_local_experts}; lower it or add "
                             f"experts")
        if not self.swiglu_limit > 0:
            raise ValueError(f"{what}: swiglu_limit={self.swiglu_limit!r} must be > 0 (the "
                             f"experts' clamp; gpt-oss: 7.0)")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def gpt_oss_20b(cls, **overrides) -> GptOssConfig:
        """openai/gpt-oss-20b: 24 layers, 32 experts top-4; 20,914,757,184 parameters."""
        return cls(**{**dict(num_hidden_layers=24, num_local_experts=32), **overrides})

    @classmethod
    def gpt_oss_120b(cls, **overrides) -> GptOssConfig:
        """openai/gpt-oss-120b: 36 layers, 128 experts top-4; 116,829,156,672 parameters.
        Layers rematerialised (``remat_policy="full"``)."""
        return cls(**{"remat_policy": "full", **overrides})

    @classmethod
    def mini(cls, **overrides) -> GptOssConfig:
        """A gpt-oss-shaped reduction that trains on a CPU: 4 layers (sliding window 32 and
        full, alternating), 16 experts top-4 of width 64, GQA 8/2 heads of 16 with sinks,
        vocab 264 (the byte tokenizer's 259 ids, padded to a multiple of 8)."""
        return cls(**{**dict(vocab_size=264, hidden_size=128, intermediate_size=64,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=16, num_local_experts=16, sliding_window=32,
                             max_position_embeddings=4096, router_aux_loss_coef=0.01),
                      **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """The inherited mapping, with ``layer_types`` as the list transformers checks for."""
        return {**super().to_hf_config(), "layer_types": list(self.kinds)}

    # -- derived quantities --------------------------------------------------------------------
    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind (``layer_types``, or the alternating default)."""
        return self.layer_types or tuple(LAYER_TYPES[i % 2]
                                         for i in range(self.num_hidden_layers))

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    def window(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s attention window (None: full attention)."""
        return self.sliding_window if self.kinds[layer_idx] == LAYER_TYPES[0] else None

    def num_params(self) -> int:
        """Parameter count from `nnx.eval_shape` (allocates nothing)."""
        return count_params(GptOss.abstract(self.for_counting()))

    def active_matmul_params(self) -> int:
        """Weights one token multiplies with (the top-k experts; no embedding lookup)."""
        D, H, N, K = self.hidden_size, self.head_dim, self.num_attention_heads, \
            self.num_key_value_heads
        moe = D * self.num_local_experts + self.num_experts_per_tok * 3 * D * \
            self.intermediate_size
        return self.num_hidden_layers * (D * H * (2 * N + 2 * K) + moe) + D * self.vocab_size

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training (3x forward) FLOPs per token: ``6 * active_matmul_params`` plus attention
        ``3 * 2 * N * 2H * S`` per layer, ``S`` the keys a query sees on average (capped by a
        sliding layer's window)."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        per_layer = [min(keys, w) if (w := self.window(i)) else keys
                     for i in range(self.num_hidden_layers)]
        attn = 2 * self.num_attention_heads * 2 * self.head_dim * sum(per_layer)
        return 3 * (2 * self.active_matmul_params() + attn)


class GptOssMoE(MoE):
    """`MoE` with gpt-oss's Hugging Face names: router ``mlp.router``, experts fused as
    ``mlp.experts.gate_up_proj`` / ``down_proj`` (+ ``_bias``)."""

    hf_names: ClassVar[dict[str, str]] = {**MoE.hf_names, "router": "router",
                                          "wi_gate_up": "gate_up_proj", "wo": "down_proj"}


class GptOssDecoderLayer(DecoderLayer):
    """GQA attention with biases and sinks (sliding or full, per ``layer_types``) + the
    biased, clamped-SwiGLU MoE. Swap a piece with ``attention_cls = ...`` etc."""

    attention_cls: ClassVar[type] = Attention
    moe_cls: ClassVar[type] = GptOssMoE

    @classmethod
    def layer_kind(cls, config: GptOssConfig, layer_idx: int) -> Any:
        return (cls.uses_moe(config, layer_idx), config.window(layer_idx))

    def make_attention(self, config: GptOssConfig, *, inputs_shape, partitioner, rngs):
        return self.attention_cls(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, inputs_shape=inputs_shape, partitioner=partitioner,
            rope=RoPE(theta=config.rope_theta, scaling=config.rope_scaling),
            sliding_window=config.window(self.layer_idx), sinks=True, use_bias=True,
            **config.attention_options(), rngs=rngs)

    def make_moe(self, config: GptOssConfig, *, inputs_shape, partitioner, rngs):
        return self.moe_cls(
            num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.intermediate_size, inputs_shape=inputs_shape, partitioner=partitioner,
            scoring="softmax", norm_topk_prob=True, router_bias=True, expert_bias=True,
            activation=GLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit, up_offset=1.0),
            gate_up="interleaved", **config.moe_options(), rngs=rngs)


class GptOss(CausalLM):
    """The gpt-oss causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``;
    see `zoo.models.decoder.CausalLM`."""

    config_cls: ClassVar[type] = GptOssConfig
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = GptOssDecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("gpt_oss",)


from_hf, to_hf = family_io(GptOss, "gpt-oss", "Hub layout, MXFP4 or bf16/fp32 experts; "
                                              "to_hf writes bf16/fp32")

registry.register(registry.Family(
    name="gpt_oss", config_cls=GptOssConfig, model_cls=GptOss,
    presets={"gpt_oss_20b": GptOssConfig.gpt_oss_20b, "gpt_oss_120b": GptOssConfig.gpt_oss_120b,
             "mini": GptOssConfig.mini}))
