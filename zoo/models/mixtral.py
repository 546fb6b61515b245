"""Mixtral (Mistral AI's sparse mixture of experts): config presets, model, Hugging Face interop.

* Decoder-only transformer, pre-norm (RMSNorm), embedding and ``lm_head`` (untied by default;
  ``tie_word_embeddings=True`` shares the table).
* Attention: grouped-query (``num_key_value_heads`` kv heads), RoPE in the half-split layout
  with ``rope_theta``, optional ``sliding_window``; context-parallel via `zoo.layers.Attention`.
* Every layer's feed-forward is an MoE: softmax router, top-``num_experts_per_tok`` of
  ``num_local_experts`` SwiGLU experts of width ``intermediate_size`` (weights = softmax over the
  selected logits), dropless by default.
* `MixtralConfig` (a `zoo.models.DecoderConfig`) uses the Hugging Face field names
  (``config.json`` maps one-to-one) plus the base's zoo-only fields (``dtype``,
  ``param_dtype``, ``remat_policy``, ``attention_implementation``, the MoE choices). Presets:
  `mixtral_8x7b` (46,702,792,704 parameters), `mixtral_8x22b` (140,630,071,296) and `mini`
  (vocab 264 = the byte tokenizer's 259 ids padded to a multiple of 8).
* `from_hf(path)` / `to_hf(model, path)`: the published checkpoint layout (per-expert
  ``block_sparse_moe.experts.{e}.w1/w2/w3``: `MixtralMoE` and ``MixtralDecoderLayer.hf_names``
  are the only Mixtral-specific names; every layer maps its own keys), loaded tensor by tensor
  into sharded parameters.

Legend: B batch, L length, D hidden_size, N heads, K kv heads, H head_dim, E experts,
F intermediate_size, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


from zoo.layers.attention import Attention
from zoo.layers.moe import MoE
from zoo.layers.rope import RoPE
from zoo.models.config import DecoderConfig, check_positive, nullable
from zoo.models import registry
from zoo.models.decoder import CausalLM, DecoderLayer, count_params, family_io

__all__ = ["MixtralConfig", "MixtralDecoderLayer", "MixtralMoE", "Mixtral", "from_hf", "to_hf"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtralConfig(DecoderConfig):
    """Mixtral hyper-parameters; field names are those of Hugging Face's ``MixtralConfig``
    (the shared ones and the zoo-only fields are `zoo.models.config.DecoderConfig`'s)."""

    hf_model_type: ClassVar[str] = "mixtral"
    hf_architecture: ClassVar[str] = "MixtralForCausalLM"
    hf_constants: ClassVar[dict[str, Any]] = {
        **DecoderConfig.hf_constants, "router_jitter_noise": 0.0, "bos_token_id": 1,
        "eos_token_id": 2}
    hf_aliases: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts"}
    aux_loss_field: ClassVar[str] = "router_aux_loss_coef"

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    sliding_window: int | None = nullable(None)
    router_aux_loss_coef: float = 0.02  # weight of aux["load_balance_loss"] in the loss

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        super().__post_init__()
        check_positive(self, ("head_dim", "num_local_experts", "num_experts_per_tok"),
                       optional=("sliding_window",))
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"MixtralConfig: num_experts_per_tok={self.num_experts_per_tok} "
                             f"exceeds num_local_experts={self.num_local_experts}")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def mixtral_8x7b(cls, **overrides) -> MixtralConfig:
        """mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active per token (layers
        rematerialised: ``remat_policy="full"``)."""
        return cls(**{"remat_policy": "full", **overrides})

    @classmethod
    def mixtral_8x22b(cls, **overrides) -> MixtralConfig:
        """mistralai/Mixtral-8x22B-v0.1: 140.6B parameters, 39B active per token."""
        return cls(**{**dict(vocab_size=32768, hidden_size=6144, intermediate_size=16384,
                             num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
                             max_position_embeddings=65536, router_aux_loss_coef=0.001,
                             remat_policy="full"),
                      **overrides})

    @classmethod
    def mini(cls, **overrides) -> MixtralConfig:
        """A Mixtral-shaped reduction that trains on a CPU: 4 layers, 8 experts top-2, GQA 8/2
        heads of 16, vocab 264 (the byte tokenizer's 259 ids, padded to a multiple of 8)."""
        return cls(**{**dict(vocab_size=264, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                             max_position_embeddings=4096, rope_theta=10000.0),
                      **overrides})

    # -- derived quantities --------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    def num_params(self) -> int:
        """Parameter count from `nnx.eval_shape` (allocates nothing)."""
        return count_params(Mixtral.abstract(self.for_counting()))

    def active_matmul_params(self) -> int:
        """Weights one token multiplies with (routed: top-k experts; embedding lookup excluded)."""
        D, H, N, K = self.hidden_size, self.head_dim, self.num_attention_heads, \
            self.num_key_value_heads
        attn = D * H * (2 * N + 2 * K)
        moe = D * self.num_local_experts + self.num_experts_per_tok * 3 * D * self.intermediate_size
        return self.num_hidden_layers * (attn + moe) + D * self.vocab_size

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training (forward + backward = 3x forward) FLOPs per token at this sequence length.

        ``6 * active_matmul_params`` plus attention ``3 * 2 * N * (H + H) * S`` per layer, with
        ``S`` the keys a query sees on average: ``(seq_len + 1) / 2`` when causal, capped by the
        sliding window.
        """
        keys = (seq_len + 1) / 2 if causal else seq_len
        if self.sliding_window is not None:
            keys = min(keys, self.sliding_window)
        attn = 2 * self.num_attention_heads * 2 * self.head_dim * keys
        return 3 * (2 * self.active_matmul_params() + self.num_hidden_layers * attn)


class MixtralMoE(MoE):
    """`MoE` with Mixtral's checkpoint names: experts ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

    hf_names: ClassVar[dict[str, str]] = {**MoE.hf_names, "wi_gate": "w1", "wi_up": "w3",
                                          "wo": "w2"}


class MixtralDecoderLayer(DecoderLayer):
    """GQA attention + softmax-routed MoE. Swap a piece with ``attention_cls = ...`` etc.
    (each piece maps its own Hugging Face keys; the MoE sits under ``block_sparse_moe``)."""

    attention_cls: ClassVar[type] = Attention
    moe_cls: ClassVar[type] = MixtralMoE
    hf_names: ClassVar[dict[str, str]] = {"mlp": "block_sparse_moe"}

    def make_attention(self, config: MixtralConfig, *, inputs_shape, partitioner, rngs):
        return self.attention_cls(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, inputs_shape=inputs_shape, partitioner=partitioner,
            rope=RoPE(theta=config.rope_theta), sliding_window=config.sliding_window,
            **config.attention_options(), rngs=rngs)

    def make_moe(self, config: MixtralConfig, *, inputs_shape, partitioner, rngs):
        return self.moe_cls(
            num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.intermediate_size, inputs_shape=inputs_shape, partitioner=partitioner,
            scoring="softmax", **config.moe_options(), rngs=rngs)


class Mixtral(CausalLM):
    """The Mixtral causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``.

    ``Mixtral(config, *, inputs_shape=(batch, length), partitioner=None, rngs,
    decoder_layer_cls=None)``; see `zoo.models.decoder.CausalLM`.
    """

    config_cls: ClassVar[type] = MixtralConfig
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = MixtralDecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("mixtral",)


from_hf, to_hf = family_io(Mixtral, "Mixtral", "Hub layout; either rope spelling in config.json")

registry.register(registry.Family(
    name="mixtral", config_cls=MixtralConfig, model_cls=Mixtral,
    presets={"mixtral_8x7b": MixtralConfig.mixtral_8x7b,
             "mixtral_8x22b": MixtralConfig.mixtral_8x22b, "mini": MixtralConfig.mini}))
