"""Mixtral (Mistral AI's sparse mixture of experts): config presets, model, Hugging Face interop.

* Decoder-only transformer, pre-norm (RMSNorm), untied embedding and ``lm_head``.
* Attention: grouped-query (``num_key_value_heads`` kv heads), RoPE in the half-split layout
  with ``rope_theta``, optional ``sliding_window``; context-parallel via `zoo.layers.Attention`.
* Every layer's feed-forward is an MoE: softmax router, top-``num_experts_per_tok`` of
  ``num_local_experts`` SwiGLU experts of width ``intermediate_size`` (weights = softmax over the
  selected logits), dropless by default.
* `MixtralConfig` uses the Hugging Face field names (``config.json`` maps one-to-one) plus a
  few zoo fields (``dtype``, ``param_dtype``, ``remat_policy``, ``attention_implementation``,
  ``capacity_factor``). Presets: `mixtral_8x7b` (46,702,792,704 parameters), `mixtral_8x22b`
  (140,630,071,296) and `mini` (vocab 264 = the byte tokenizer's 259 ids padded to a multiple
  of 8).
* `from_hf(path)` / `to_hf(model, path)`: the published checkpoint layout (per-expert
  ``block_sparse_moe.experts.{e}.w1/w2/w3``), loaded tensor by tensor into sharded parameters.

Legend: B batch, L length, D hidden_size, N heads, K kv heads, H head_dim, E experts,
F intermediate_size, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from zoo.layers.attention import Attention
from zoo.layers.rope import RoPE
from zoo.models import hf
from zoo.models.decoder import (CausalLM, DecoderLayer, check_config, count_params,
                                dtype_name)

__all__ = ["MixtralConfig", "MixtralDecoderLayer", "Mixtral", "from_hf", "to_hf"]


@dataclasses.dataclass(frozen=True)
class MixtralConfig:
    """Mixtral hyper-parameters; field names are those of Hugging Face's ``MixtralConfig``."""

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
    sliding_window: int | None = None
    router_aux_loss_coef: float = 0.02  # weight of aux["load_balance_loss"] in the loss
    # zoo fields (not in config.json)
    attention_implementation: str = "auto"
    capacity_factor: float | None = None  # None: dropless MoE
    moe_dispatch: str = "auto"  # MoE(dispatch=): "all_to_all", "all_gather" or "auto"
    moe_grouped_matmul: str = "auto"  # MoE(grouped_matmul=): blocked on CPU, tokamax elsewhere
    moe_buffer_factor: float | None = None  # all_to_all receive buffers; None: dropless
    remat_policy: str | None = None  # None, "full", "dots_saveable", ... (decoder.REMAT_POLICIES)
    scan_layers: bool = True  # runs of identical layers as one jax.lax.scan over stacked params
    dtype: Any = jnp.float32  # computation dtype
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_config(self, what="MixtralConfig", positive=(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
            "num_experts_per_tok", "max_position_embeddings"),
            optional_positive=("sliding_window",))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"MixtralConfig: num_attention_heads={self.num_attention_heads} is "
                             f"not a multiple of num_key_value_heads={self.num_key_value_heads}")
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
        return count_params(Mixtral.abstract(self))

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

    # -- Hugging Face config.json ----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> MixtralConfig:
        """A config from a parsed Mixtral ``config.json`` (either rope spelling)."""
        what = "MixtralConfig.from_hf_config"
        hf.check_fields(cfg, {"hidden_act": ("silu",), "tie_word_embeddings": (False,)},
                        what=what)
        theta, scaling = hf.rope_from_hf(cfg, default_theta=1e6, what=what)
        if scaling is not None:
            raise ValueError(f"{what}: Mixtral with rope scaling {scaling} is not supported")
        names = {f.name for f in dataclasses.fields(cls)} - {
            "rope_theta", "dtype", "param_dtype", "attention_implementation", "capacity_factor",
            "remat_policy", "scan_layers"}
        if "num_local_experts" not in cfg and "num_experts" in cfg:
            cfg = {**cfg, "num_local_experts": cfg["num_experts"]}
        kwargs = {k: cfg[k] for k in names if cfg.get(k) is not None}
        kwargs["sliding_window"] = cfg.get("sliding_window")
        return cls(**{**kwargs, "rope_theta": theta, **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers' ``MixtralForCausalLM`` loads."""
        return dict(
            architectures=["MixtralForCausalLM"], model_type="mixtral",
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            num_local_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=hf.rope_to_hf(self.rope_theta, None),
            sliding_window=self.sliding_window, router_aux_loss_coef=self.router_aux_loss_coef,
            hidden_act="silu", tie_word_embeddings=False, attention_dropout=0.0,
            router_jitter_noise=0.0, bos_token_id=1, eos_token_id=2,
            dtype=dtype_name(self.param_dtype))


class MixtralDecoderLayer(DecoderLayer):
    """GQA attention + softmax-routed MoE. Swap a piece with ``attention_cls = ...`` etc."""

    attention_cls: ClassVar[type] = Attention

    def make_attention(self, config: MixtralConfig, *, inputs_shape, partitioner, rngs):
        return self.attention_cls(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, inputs_shape=inputs_shape, partitioner=partitioner,
            rope=RoPE(theta=config.rope_theta), sliding_window=config.sliding_window,
            implementation=config.attention_implementation, dtype=config.dtype,
            param_dtype=config.param_dtype, rngs=rngs)

    def make_moe(self, config: MixtralConfig, *, inputs_shape, partitioner, rngs):
        return self.moe_cls(
            num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.intermediate_size, inputs_shape=inputs_shape, partitioner=partitioner,
            scoring="softmax", capacity_factor=config.capacity_factor,
            dispatch=config.moe_dispatch, grouped_matmul=config.moe_grouped_matmul,
            buffer_factor=config.moe_buffer_factor,
            dtype=config.dtype,
            param_dtype=config.param_dtype, rngs=rngs)


class Mixtral(CausalLM):
    """The Mixtral causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``.

    ``Mixtral(config, *, inputs_shape=(batch, length), partitioner=None, rngs,
    decoder_layer_cls=None)``; see `zoo.models.decoder.CausalLM`.
    """

    config_cls: ClassVar[type] = MixtralConfig
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = MixtralDecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("mixtral",)

    def hf_layer_keys(self, layer_idx: int, is_moe: bool) -> list[hf.Tensor]:
        pre, E = f"model.layers.{layer_idx}", self.config.num_local_experts
        rows = [hf.linear(("self_attn", name, "kernel"), f"{pre}.self_attn.{name}.weight")
                for name in ("q_proj", "k_proj", "v_proj")]
        rows.append(hf.linear(("self_attn", "o_proj", "kernel"), f"{pre}.self_attn.o_proj.weight",
                              in_ndim=2))
        hf_moe = f"{pre}.block_sparse_moe"
        rows.append(hf.linear(("mlp", "router"), f"{hf_moe}.gate.weight"))
        for zoo_name, hf_name in (("wi_gate", "w1"), ("wi_up", "w3"), ("wo", "w2")):
            rows.append(hf.stacked_linear(
                ("mlp", zoo_name), [f"{hf_moe}.experts.{e}.{hf_name}.weight" for e in range(E)]))
        return rows


def from_hf(path, *, partitioner=None, inputs_shape=None, dtype=jnp.float32, param_dtype=None,
            config_overrides: dict[str, Any] | None = None, model_cls: type[Mixtral] = Mixtral,
            decoder_layer_cls: type[DecoderLayer] | None = None) -> Mixtral:
    """Load a local Mixtral checkpoint folder (``config.json`` + ``*.safetensors``).

    Args:
      path: the folder (Hub layout; either rope spelling in config.json).
      partitioner: shards the parameters as they are read (None: one device).
      inputs_shape: ``(batch, length)``, or None for any shape the partitioner divides.
      dtype: computation dtype; param_dtype: storage dtype (None: float32).
      config_overrides: config fields to replace, e.g. ``{"remat_policy": "full"}`` or
        ``{"scan_layers": False}`` (the unrolled layout).
      model_cls, decoder_layer_cls: load into a subclass (its extra parameters need key-map
        rows: extend ``hf_layer_keys`` or ``hf_key_map``).
    """
    return model_cls.from_hf(path, partitioner=partitioner, inputs_shape=inputs_shape,
                             dtype=dtype, param_dtype=param_dtype,
                             config_overrides=config_overrides,
                             decoder_layer_cls=decoder_layer_cls)


def to_hf(model: Mixtral, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` as a Hugging Face checkpoint folder (safetensors + config.json)."""
    model.to_hf(path, max_shard_bytes=max_shard_bytes)
