"""Qwen3-MoE (Alibaba's Qwen3 mixture of experts): config presets, model, Hugging Face interop.

* Decoder-only transformer, pre-norm (RMSNorm), untied embedding and ``lm_head``.
* Attention: grouped-query (``num_key_value_heads`` kv heads of ``head_dim``), an RMSNorm over
  ``head_dim`` on every q and k head before RoPE (``q_norm``/``k_norm``: `zoo.layers.Attention`
  with ``qk_norm=True``), RoPE in the half-split layout with ``rope_theta``.
* Feed-forward: layer ``i`` is an MoE iff ``i not in mlp_only_layers`` and ``num_experts > 0``
  and ``(i + 1) % decoder_sparse_step == 0`` (transformers' rule), else a dense SwiGLU MLP of
  width ``intermediate_size``. The MoE: softmax over ``num_experts`` router logits, the top
  ``num_experts_per_tok`` kept, their probabilities renormalised when ``norm_topk_prob`` (else
  used as they are); SwiGLU experts of width ``moe_intermediate_size``; no shared experts.
  With ``scan_layers`` each maximal run of one kind is one scanned stack.
* `Qwen3MoeConfig` uses the Hugging Face field names; its defaults are transformers'
  ``Qwen3MoeConfig`` defaults, so a ``config.json`` that omits a field means the same here.
  Presets: `qwen3_30b_a3b` (30,532,122,624 parameters, 3.3B active per token) and `mini`
  (vocab 264 = the byte tokenizer's 259 ids padded to a multiple of 8).
* `from_hf(path)` / `to_hf(model, path)`: the published layout (per-expert
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj``), tensor by tensor into sharded parameters.

Legend: B batch, L length, D hidden_size, N heads, K kv heads, H head_dim, E experts,
F moe_intermediate_size, V vocab.
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

__all__ = ["Qwen3MoeConfig", "Qwen3MoeDecoderLayer", "Qwen3Moe", "from_hf", "to_hf"]


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """Qwen3-MoE hyper-parameters; field names and defaults are Hugging Face's
    ``Qwen3MoeConfig`` (``sliding_window`` is the effective window: None unless
    ``use_sliding_window`` in config.json)."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # the dense MLP layers' width
    moe_intermediate_size: int = 768  # each expert's width
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    sliding_window: int | None = None
    router_aux_loss_coef: float = 0.001  # weight of aux["load_balance_loss"] in the loss
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
        what = "Qwen3MoeConfig"
        if self.head_dim is None and self.num_attention_heads:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        check_config(self, what=what, positive=(
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_experts_per_tok", "decoder_sparse_step", "max_position_embeddings"),
            optional_positive=("sliding_window",))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{what}: num_attention_heads={self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads={self.num_key_value_heads}")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"{what}: num_experts={self.num_experts!r} must be an int >= 0 "
                             f"(0: every layer a dense MLP)")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{what}: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}")
        bad = [i for i in self.mlp_only_layers
               if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"{what}: mlp_only_layers holds {bad}, not layer indices of a "
                             f"{self.num_hidden_layers}-layer model (0..."
                             f"{self.num_hidden_layers - 1})")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def qwen3_30b_a3b(cls, **overrides) -> Qwen3MoeConfig:
        """Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token (48 layers of 128
        experts top-8; layers rematerialised: ``remat_policy="full"``)."""
        return cls(**{**dict(num_hidden_layers=48, head_dim=128, norm_topk_prob=True,
                             max_position_embeddings=40960, rope_theta=1e6,
                             remat_policy="full"),
                      **overrides})

    @classmethod
    def mini(cls, **overrides) -> Qwen3MoeConfig:
        """A Qwen3-MoE-shaped reduction that trains on a CPU: 4 layers, 16 experts top-4 of
        width 64, GQA 8/2 heads of 16 with q/k norms, vocab 264 (the byte tokenizer's ids)."""
        return cls(**{**dict(vocab_size=264, hidden_size=128, intermediate_size=256,
                             moe_intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                             num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                             max_position_embeddings=4096, router_aux_loss_coef=0.01),
                      **overrides})

    # -- derived quantities --------------------------------------------------------------------
    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule (``Qwen3MoeDecoderLayer``) for which layers are sparse."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def num_params(self) -> int:
        """Parameter count from `nnx.eval_shape` (allocates nothing)."""
        return count_params(Qwen3Moe.abstract(self))

    def active_matmul_params(self) -> int:
        """Weights one token multiplies with (routed: the top-k experts; embedding lookup
        excluded)."""
        D, H, N, K = self.hidden_size, self.head_dim, self.num_attention_heads, \
            self.num_key_value_heads
        attn = D * H * (2 * N + 2 * K)
        moe = D * self.num_experts + self.num_experts_per_tok * 3 * D * self.moe_intermediate_size
        dense = 3 * D * self.intermediate_size
        n_moe = self.num_moe_layers
        return (self.num_hidden_layers * attn + n_moe * moe
                + (self.num_hidden_layers - n_moe) * dense + D * self.vocab_size)

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training (forward + backward = 3x forward) FLOPs per token at this sequence length:
        ``6 * active_matmul_params`` plus attention ``3 * 2 * N * (H + H) * S`` per layer, with
        ``S`` the keys a query sees on average (``(seq_len + 1) / 2`` when causal, capped by the
        sliding window). The q/k norms' elementwise work is left out, as the other norms'."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        if self.sliding_window is not None:
            keys = min(keys, self.sliding_window)
        attn = 2 * self.num_attention_heads * 2 * self.head_dim * keys
        return 3 * (2 * self.active_matmul_params() + self.num_hidden_layers * attn)

    # -- Hugging Face config.json ----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> Qwen3MoeConfig:
        """A config from a parsed Qwen3-MoE ``config.json`` (either rope spelling)."""
        what = "Qwen3MoeConfig.from_hf_config"
        hf.check_fields(cfg, {"hidden_act": ("silu",), "tie_word_embeddings": (False,),
                              "attention_bias": (False,)}, what=what)
        theta, scaling = hf.rope_from_hf(cfg, default_theta=cls.rope_theta, what=what)
        if scaling is not None:
            raise ValueError(f"{what}: Qwen3-MoE with rope scaling {scaling} is not supported")
        zoo_only = {"rope_theta", "sliding_window", "attention_implementation",
                    "capacity_factor", "moe_dispatch", "moe_grouped_matmul", "moe_buffer_factor",
                    "remat_policy", "scan_layers", "dtype", "param_dtype"}
        names = {f.name for f in dataclasses.fields(cls)} - zoo_only
        if "num_experts" not in cfg and "num_local_experts" in cfg:  # transformers' alias
            cfg = {**cfg, "num_experts": cfg["num_local_experts"]}
        kwargs = {k: cfg[k] for k in names if cfg.get(k) is not None}
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        return cls(**{**kwargs, "rope_theta": theta, "sliding_window": window, **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers' ``Qwen3MoeForCausalLM`` loads."""
        fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
                  "max_position_embeddings", "rms_norm_eps", "router_aux_loss_coef")
        out = {k: getattr(self, k) for k in fields}
        out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                   mlp_only_layers=list(self.mlp_only_layers),
                   rope_parameters=hf.rope_to_hf(self.rope_theta, None),
                   use_sliding_window=self.sliding_window is not None,
                   sliding_window=self.sliding_window, hidden_act="silu",
                   tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0,
                   dtype=dtype_name(self.param_dtype))
        return out


class Qwen3MoeDecoderLayer(DecoderLayer):
    """GQA attention with q/k norms + (softmax-routed MoE, or a dense MLP where
    `Qwen3MoeConfig.is_moe_layer` says). Swap a piece with ``attention_cls = ...`` etc."""

    attention_cls: ClassVar[type] = Attention

    @classmethod
    def uses_moe(cls, config: Qwen3MoeConfig, layer_idx: int) -> bool:
        return config.is_moe_layer(layer_idx)

    def make_attention(self, config: Qwen3MoeConfig, *, inputs_shape, partitioner, rngs):
        return self.attention_cls(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, inputs_shape=inputs_shape, partitioner=partitioner,
            rope=RoPE(theta=config.rope_theta), sliding_window=config.sliding_window,
            implementation=config.attention_implementation, qk_norm=True,
            qk_norm_eps=config.rms_norm_eps, dtype=config.dtype,
            param_dtype=config.param_dtype, rngs=rngs)

    def make_moe(self, config: Qwen3MoeConfig, *, inputs_shape, partitioner, rngs):
        return self.moe_cls(
            num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.moe_intermediate_size, inputs_shape=inputs_shape,
            partitioner=partitioner, scoring="softmax", norm_topk_prob=config.norm_topk_prob,
            capacity_factor=config.capacity_factor, dispatch=config.moe_dispatch,
            grouped_matmul=config.moe_grouped_matmul, buffer_factor=config.moe_buffer_factor,
            dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)


class Qwen3Moe(CausalLM):
    """The Qwen3-MoE causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``.

    ``Qwen3Moe(config, *, inputs_shape=(batch, length), partitioner=None, rngs,
    decoder_layer_cls=None)``; see `zoo.models.decoder.CausalLM`.
    """

    config_cls: ClassVar[type] = Qwen3MoeConfig
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = Qwen3MoeDecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("qwen3_moe",)

    def hf_layer_keys(self, layer_idx: int, is_moe: bool) -> list[hf.Tensor]:
        pre, E = f"model.layers.{layer_idx}", self.config.num_experts
        rows = [hf.linear(("self_attn", name, "kernel"), f"{pre}.self_attn.{name}.weight")
                for name in ("q_proj", "k_proj", "v_proj")]
        rows.append(hf.linear(("self_attn", "o_proj", "kernel"), f"{pre}.self_attn.o_proj.weight",
                              in_ndim=2))
        rows += [hf.copy(("self_attn", name, "scale"), f"{pre}.self_attn.{name}.weight")
                 for name in ("q_norm", "k_norm")]
        if not is_moe:
            return rows + [hf.linear(("mlp", name, "kernel"), f"{pre}.mlp.{name}_proj.weight")
                           for name in ("gate", "up", "down")]
        rows.append(hf.linear(("mlp", "router"), f"{pre}.mlp.gate.weight"))
        for zoo_name, hf_name in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"),
                                  ("wo", "down_proj")):
            rows.append(hf.stacked_linear(
                ("mlp", zoo_name),
                [f"{pre}.mlp.experts.{e}.{hf_name}.weight" for e in range(E)]))
        return rows


def from_hf(path, *, partitioner=None, inputs_shape=None, dtype=jnp.float32, param_dtype=None,
            config_overrides: dict[str, Any] | None = None, model_cls: type[Qwen3Moe] = Qwen3Moe,
            decoder_layer_cls: type[DecoderLayer] | None = None) -> Qwen3Moe:
    """Load a local Qwen3-MoE checkpoint folder (``config.json`` + ``*.safetensors``).

    Args:
      path: the folder (Hub layout; either rope spelling in config.json).
      partitioner: shards the parameters as they are read (None: one device).
      inputs_shape: ``(batch, length)``, or None for any shape the partitioner divides.
      dtype: computation dtype; param_dtype: storage dtype (None: float32).
      config_overrides: config fields to replace, e.g. ``{"remat_policy": "full"}`` or
        ``{"scan_layers": False}`` (the unrolled layout).
      model_cls, decoder_layer_cls: load into a subclass.
    """
    return model_cls.from_hf(path, partitioner=partitioner, inputs_shape=inputs_shape,
                             dtype=dtype, param_dtype=param_dtype,
                             config_overrides=config_overrides,
                             decoder_layer_cls=decoder_layer_cls)


def to_hf(model: Qwen3Moe, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` as a Hugging Face checkpoint folder (safetensors + config.json)."""
    model.to_hf(path, max_shard_bytes=max_shard_bytes)
