"""Qwen3-Next (Alibaba's hybrid linear-attention MoE): config presets, model, Hugging Face interop.

* Decoder-only transformer, pre-norm with zero-centred RMSNorms (``(1 + w)``,
  `zoo.layers.ZeroCentredRMSNorm`, the final norm too), untied embedding and ``lm_head``.
* Token mixers by ``layer_types``: ``"linear_attention"`` layers are gated DeltaNet
  (`zoo.layers.GatedDeltaNet`, Hugging Face name ``linear_attn``), ``"full_attention"`` layers
  the gated attention (`zoo.layers.GatedAttention`: sigmoid output gate, zero-centred q/k
  norms, RoPE on the leading ``partial_rotary_factor`` of each head). Default pattern
  (``layer_types`` None, config.json's ``full_attention_interval`` 4): three linear layers,
  then one full. Scanned, the 3:1 pattern is one cycle of four stacks
  (`zoo.models.stacks.layer_cycles`).
* Feed-forward: transformers' rule (``mlp_only_layers``, ``decoder_sparse_step``) picks
  sparse layers: softmax top-``num_experts_per_tok`` routing (``norm_topk_prob``) over
  ``num_experts`` SwiGLU experts plus one shared expert behind a sigmoid gate
  (`zoo.layers.SharedExpertMoE`); other layers a dense SwiGLU of ``intermediate_size``.
* `Qwen3NextConfig` uses the Hugging Face field names and defaults. Presets:
  `qwen3_next_80b_a3b` and `mini` (vocab 264).
* `from_hf(path)` / `to_hf(model, path)`: the layout transformers saves (per-expert
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj``). A Hub checkpoint's ``mtp.*`` tensors
  (multi-token prediction) are not read (transformers' model has no MTP module either);
  `Qwen3Next.from_hf` says so with a warning naming them.

Legend: B batch, L length, D hidden_size, N heads, K kv heads, H head_dim, E experts,
F moe_intermediate_size, V vocab.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, ClassVar

from zoo.layers import hf_keys as hfk
from zoo.layers.gated_attention import GatedAttention
from zoo.layers.gated_deltanet import GatedDeltaNet
from zoo.layers.norm import ZeroCentredRMSNorm
from zoo.layers.rope import RoPE
from zoo.layers.shared_expert import SharedExpertMoE
from zoo.models import hf, registry
from zoo.models.config import DecoderConfig, check_positive, zoo_field
from zoo.models.decoder import CausalLM, DecoderLayer, count_params, family_io

__all__ = ["Qwen3NextConfig", "Qwen3NextDecoderLayer", "Qwen3Next", "from_hf", "to_hf"]

LAYER_TYPES = ("linear_attention", "full_attention")


def default_layer_types(n: int, interval: int = 4) -> tuple[str, ...]:
    """transformers' pattern: layer ``i`` is full attention iff ``(i + 1) % interval == 0``."""
    return tuple(LAYER_TYPES[(i + 1) % interval == 0] for i in range(n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(DecoderConfig):
    """Qwen3-Next hyper-parameters; field names and defaults are Hugging Face's
    ``Qwen3NextConfig`` (``layer_types`` None: the default 3:1 pattern, stored as None when
    given explicitly too, so a changed num_hidden_layers re-derives it)."""

    hf_model_type: ClassVar[str] = "qwen3_next"
    hf_architecture: ClassVar[str] = "Qwen3NextForCausalLM"
    hf_supported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **DecoderConfig.hf_supported, "attention_bias": (False,)}
    hf_constants: ClassVar[dict[str, Any]] = {**DecoderConfig.hf_constants,
                                              "attention_bias": False}
    aux_loss_field: ClassVar[str] = "router_aux_loss_coef"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632  # the dense MLP layers' width
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    max_position_embeddings: int = 32768
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512  # each expert's width
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001  # weight of aux["load_balance_loss"] in the loss
    mlp_only_layers: tuple[int, ...] = ()
    layer_types: tuple[str, ...] | None = None
    # state slots per context shard and row in the linear layers (zoo.ops.gated_delta_rule's
    # max_pieces): "row" balancing needs 2, "document" 2 per document a shard holds
    linear_max_pieces: int = zoo_field(4)

    def __post_init__(self):
        what = type(self).__name__
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", None if types == default_layer_types(
                self.num_hidden_layers) else types)
        super().__post_init__()
        check_positive(self, ("head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                              "linear_value_head_dim", "linear_num_key_heads",
                              "linear_num_value_heads", "decoder_sparse_step",
                              "moe_intermediate_size", "shared_expert_intermediate_size",
                              "num_experts_per_tok", "linear_max_pieces"))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"{what}: linear_num_value_heads={self.linear_num_value_heads} is "
                             f"not a multiple of linear_num_key_heads="
                             f"{self.linear_num_key_heads}")
        if len(self.kinds) != self.num_hidden_layers or not set(self.kinds) <= set(LAYER_TYPES):
            raise ValueError(f"{what}: layer_types={list(self.kinds)} must name one of "
                             f"{LAYER_TYPES} for each of the {self.num_hidden_layers} layers "
                             f"(or be None: three linear layers, then one full)")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) \
                or self.num_experts < 0:
            raise ValueError(f"{what}: num_experts={self.num_experts!r} must be an int >= 0")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{what}: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}; lower it or add experts")
        bad = [i for i in self.mlp_only_layers
               if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"{what}: mlp_only_layers holds {bad}, not layer indices of a "
                             f"{self.num_hidden_layers}-layer model")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def qwen3_next_80b_a3b(cls, **overrides) -> Qwen3NextConfig:
        """Qwen/Qwen3-Next-80B-A3B: 48 layers (36 gated DeltaNet, 12 gated attention), 512
        experts top-10 + a shared expert; 79,674,391,296 parameters (transformers' count,
        without the multi-token-prediction layer).
        Layers rematerialised (``remat_policy="full"``)."""
        return cls(**{**dict(intermediate_size=5120, max_position_embeddings=262144,
                             rope_theta=1e7, remat_policy="full"), **overrides})

    @classmethod
    def mini(cls, **overrides) -> Qwen3NextConfig:
        """A Qwen3-Next-shaped reduction that trains on a CPU: 4 layers (3 linear, 1 full), 16
        experts top-4 of width 64 + a shared one, full attention 8/2 heads of 16, linear
        attention 4/8 heads of 16, vocab 264 (the byte tokenizer's 259 ids, padded)."""
        return cls(**{**dict(vocab_size=264, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_num_key_heads=4, linear_num_value_heads=8,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64,
                             num_experts=16, num_experts_per_tok=4,
                             max_position_embeddings=4096, router_aux_loss_coef=0.01),
                      **overrides})

    # -- Hugging Face config.json --------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> Qwen3NextConfig:
        """The inherited mapping; ``partial_rotary_factor`` from ``rope_parameters`` or the
        top level; without ``layer_types``, the pattern of ``full_attention_interval``."""
        cfg = dict(cfg)
        rope = cfg.get("rope_parameters") or {}
        if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
            cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
        if cfg.get("layer_types") is None and "num_hidden_layers" in cfg:
            cfg["layer_types"] = default_layer_types(
                cfg["num_hidden_layers"], cfg.get("full_attention_interval") or 4)
        return super().from_hf_config(cfg, **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        out = super().to_hf_config()
        out["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        return {**out, "layer_types": list(self.kinds),
                "mlp_only_layers": list(self.mlp_only_layers)}

    # -- derived quantities --------------------------------------------------------------------
    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's token mixer (``layer_types``, or the default 3:1 pattern)."""
        return self.layer_types or default_layer_types(self.num_hidden_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule for which layers are sparse."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def num_params(self) -> int:
        """Parameter count from `nnx.eval_shape` (allocates nothing)."""
        return count_params(Qwen3Next.abstract(self.for_counting()))

    def active_matmul_params(self) -> int:
        """Weights one token multiplies with (the top-k experts, the shared one and its gate;
        no embedding lookup)."""
        D, H, N, K = self.hidden_size, self.head_dim, self.num_attention_heads, \
            self.num_key_value_heads
        Hk, Hv = self.linear_num_key_heads, self.linear_num_value_heads
        Dk, Dv = self.linear_key_head_dim, self.linear_value_head_dim
        full = D * H * (3 * N + 2 * K)  # q and its gate, k, v, o
        linear = D * (2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv) + Hv * Dv * D
        moe = D * self.num_experts + self.num_experts_per_tok * 3 * D * \
            self.moe_intermediate_size + 3 * D * self.shared_expert_intermediate_size + D
        total = D * self.vocab_size
        for i, kind in enumerate(self.kinds):
            total += full if kind == "full_attention" else linear
            total += moe if self.is_moe_layer(i) else 3 * D * self.intermediate_size
        return total

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training (3x forward) FLOPs per token: ``6 * active_matmul_params``, full attention
        ``3 * 2 * N * 2H * S`` per full layer (``S`` the keys a query sees on average), and
        the recurrence's ``3 * 2 * 3 * Hv * Dk * Dv`` per linear layer (state decay-and-write
        and read; the convolution and the chunked form's extra work left out)."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        n_full = sum(k == "full_attention" for k in self.kinds)
        full = 2 * self.num_attention_heads * 2 * self.head_dim * keys
        linear = 2 * 3 * self.linear_num_value_heads * self.linear_key_head_dim * \
            self.linear_value_head_dim
        n_linear = self.num_hidden_layers - n_full
        return 3 * (2 * self.active_matmul_params() + n_full * full + n_linear * linear)


class Qwen3NextDecoderLayer(DecoderLayer):
    """Gated DeltaNet or gated attention (``layer_types``), then the shared-expert MoE or a
    dense MLP. Swap a piece with ``attention_cls`` / ``linear_attention_cls`` /
    ``moe_cls`` (the routed experts) / ``sparse_cls`` (their wrapper) etc."""

    attention_cls: ClassVar[type] = GatedAttention
    linear_attention_cls: ClassVar[type] = GatedDeltaNet
    sparse_cls: ClassVar[type] = SharedExpertMoE
    norm_cls: ClassVar[type] = ZeroCentredRMSNorm

    @classmethod
    def uses_moe(cls, config: Qwen3NextConfig, layer_idx: int) -> bool:
        return config.is_moe_layer(layer_idx)

    @classmethod
    def layer_kind(cls, config: Qwen3NextConfig, layer_idx: int) -> Any:
        return (cls.uses_moe(config, layer_idx), config.kinds[layer_idx])

    @property
    def is_linear(self) -> bool:
        return isinstance(self.self_attn, GatedDeltaNet)

    def make_attention(self, config: Qwen3NextConfig, *, inputs_shape, partitioner, rngs):
        if config.kinds[self.layer_idx] == "linear_attention":
            return self.linear_attention_cls(
                num_key_heads=config.linear_num_key_heads,
                num_value_heads=config.linear_num_value_heads,
                key_head_dim=config.linear_key_head_dim,
                value_head_dim=config.linear_value_head_dim,
                conv_kernel=config.linear_conv_kernel_dim, norm_eps=config.rms_norm_eps,
                max_pieces=config.linear_max_pieces, inputs_shape=inputs_shape,
                partitioner=partitioner, dtype=config.dtype,
                param_dtype=config.param_dtype, rngs=rngs)
        return self.attention_cls(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, inputs_shape=inputs_shape, partitioner=partitioner,
            rope=RoPE(theta=config.rope_theta,
                      partial_rotary_factor=config.partial_rotary_factor),
            qk_norm=True, qk_norm_eps=config.rms_norm_eps, **config.attention_options(),
            rngs=rngs)

    def make_moe(self, config: Qwen3NextConfig, *, inputs_shape, partitioner, rngs):
        return self.sparse_cls(
            shared_mlp_dim=config.shared_expert_intermediate_size, moe_cls=self.moe_cls,
            num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.moe_intermediate_size, inputs_shape=inputs_shape,
            partitioner=partitioner, scoring="softmax", norm_topk_prob=config.norm_topk_prob,
            **config.moe_options(), rngs=rngs)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """`DecoderLayer`'s rows, the token mixer named ``linear_attn`` in linear layers."""
        rows = []
        for attr in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            name = "linear_attn" if attr == "self_attn" and self.is_linear else \
                hfk.hf_name(self, attr)
            rows += [dataclasses.replace(r, path=(attr, *r.path))
                     for r in hfk.keys_of(getattr(self, attr), hfk.join(prefix, name))]
        return rows


class Qwen3Next(CausalLM):
    """The Qwen3-Next causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``;
    see `zoo.models.decoder.CausalLM`."""

    config_cls: ClassVar[type] = Qwen3NextConfig
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = Qwen3NextDecoderLayer
    final_norm_cls: ClassVar[type] = ZeroCentredRMSNorm
    hf_model_types: ClassVar[tuple[str, ...]] = ("qwen3_next",)

    @classmethod
    def from_hf(cls, path, **kwargs):
        """`CausalLM.from_hf`, then one warning naming the checkpoint's multi-token-prediction
        tensors (``mtp.*``, published with Qwen3-Next and Qwen3.5), which no parameter takes:
        zoo's model, like transformers', has no MTP module, so they stay unread."""
        model = super().from_hf(path, **kwargs)
        mtp = sorted(k for k in hf.CheckpointReader(path).keys() if k.startswith("mtp."))
        if mtp:
            warnings.warn(f"{cls.__name__}.from_hf: checkpoint {os.fspath(path)!r} holds "
                          f"{len(mtp)} multi-token-prediction tensor(s) ({', '.join(mtp[:3])}"
                          f"{', ...' if len(mtp) > 3 else ''}); zoo's {cls.__name__} has no MTP "
                          f"module and does not load them (transformers ignores them too); the "
                          f"model loads whole without them", UserWarning, stacklevel=2)
        return model


from_hf, to_hf = family_io(Qwen3Next, "Qwen3-Next", "the layout transformers saves")

registry.register(registry.Family(
    name="qwen3_next", config_cls=Qwen3NextConfig, model_cls=Qwen3Next,
    presets={"qwen3_next_80b_a3b": Qwen3NextConfig.qwen3_next_80b_a3b,
             "mini": Qwen3NextConfig.mini}))
