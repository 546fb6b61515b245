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
* `Qwen3MoeConfig` (a `zoo.models.config.DecoderConfig`) uses the Hugging Face field names;
  its defaults are transformers' ``Qwen3MoeConfig`` defaults (not 30B-A3B's: 24 layers,
  head_dim 64, ``norm_topk_prob=False``), so a ``config.json`` that omits a field means the
  same here as there. ``sliding_window`` applies only with ``use_sliding_window``, as there.
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


from zoo.layers.attention import Attention
from zoo.layers.rope import RoPE
from zoo.models.config import DecoderConfig, check_positive, nullable
from zoo.models import registry
from zoo.models.decoder import CausalLM, DecoderLayer, count_params, family_io

__all__ = ["Qwen3MoeConfig", "Qwen3MoeDecoderLayer", "Qwen3Moe", "from_hf", "to_hf"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(DecoderConfig):
    """Qwen3-MoE hyper-parameters; field names and defaults are Hugging Face's
    ``Qwen3MoeConfig`` (the shared ones and the zoo-only fields are
    `zoo.models.config.DecoderConfig`'s)."""

    hf_model_type: ClassVar[str] = "qwen3_moe"
    hf_architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    hf_supported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **DecoderConfig.hf_supported, "attention_bias": (False,)}
    hf_constants: ClassVar[dict[str, Any]] = {**DecoderConfig.hf_constants,
                                              "attention_bias": False}
    hf_aliases: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}  # as saved
    aux_loss_field: ClassVar[str] = "router_aux_loss_coef"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # the dense MLP layers' width
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    max_position_embeddings: int = 32768
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    moe_intermediate_size: int = 768  # each expert's width
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    use_sliding_window: bool = False
    sliding_window: int | None = nullable(4096)  # in effect only with use_sliding_window
    router_aux_loss_coef: float = 0.001  # weight of aux["load_balance_loss"] in the loss

    def __post_init__(self):
        what = type(self).__name__
        if self.head_dim is None and self.num_attention_heads:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        super().__post_init__()
        check_positive(self, ("head_dim", "moe_intermediate_size", "num_experts_per_tok",
                              "decoder_sparse_step"), optional=("sliding_window",))
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) \
                or self.num_experts < 0:
            raise ValueError(f"{what}: num_experts={self.num_experts!r} must be an int >= 0 "
                             f"(0: every layer a dense MLP)")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{what}: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}; lower it or add experts")
        bad = [i for i in self.mlp_only_layers
               if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"{what}: mlp_only_layers holds {bad}, not layer indices of a "
                             f"{self.num_hidden_layers}-layer model (0.."
                             f"{self.num_hidden_layers - 1})")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def qwen3_30b_a3b(cls, **overrides) -> Qwen3MoeConfig:
        """Qwen/Qwen3-30B-A3B: 30,532,122,624 parameters, 3.3B active per token (48 layers of
        128 experts top-8; layers rematerialised: ``remat_policy="full"``)."""
        return cls(**{**dict(num_hidden_layers=48, head_dim=128, norm_topk_prob=True,
                             max_position_embeddings=40960, rope_theta=1e6,
                             remat_policy="full"),
                      **overrides})

    @classmethod
    def mini(cls, **overrides) -> Qwen3MoeConfig:
        """A Qwen3-MoE-shaped reduction that trains on a CPU: 4 layers, 16 experts top-4 of
        width 64, GQA 8/2 heads of 16 with q/k norms, vocab 264 (the byte tokenizer's 259 ids,
        padded to a multiple of 8)."""
        return cls(**{**dict(vocab_size=264, hidden_size=128, intermediate_size=256,
                             moe_intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                             num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                             max_position_embeddings=4096, router_aux_loss_coef=0.01),
                      **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """The inherited mapping, with ``mlp_only_layers`` as the list transformers checks for."""
        return {**super().to_hf_config(), "mlp_only_layers": list(self.mlp_only_layers)}

    # -- derived quantities --------------------------------------------------------------------
    @property
    def window(self) -> int | None:
        """The attention window in effect (transformers drops it unless use_sliding_window)."""
        return self.sliding_window if self.use_sliding_window else None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule (``Qwen3MoeDecoderLayer``) for which layers are sparse."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def num_params(self) -> int:
        """Parameter count from `nnx.eval_shape` (allocates nothing)."""
        return count_params(Qwen3Moe.abstract(self.for_counting()))

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
        window). The q/k norms' elementwise work is left out, as the other norms'."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        if self.window is not None:
            keys = min(keys, self.window)
        attn = 2 * self.num_attention_heads * 2 * self.head_dim * keys
        return 3 * (2 * self.active_matmul_params() + self.num_hidden_layers * attn)


class Qwen3MoeDecoderLayer(DecoderLayer):
    """GQA attention with q/k norms + (softmax-routed MoE, or a dense MLP where
    `Qwen3MoeConfig.is_moe_layer` says no). Swap a piece with ``attention_cls = ...`` etc."""

    attention_cls: ClassVar[type] = Attention

    @classmethod
    def uses_moe(cls, config: Qwen3MoeConfig, layer_idx: int) -> bool:
        return config.is_moe_layer(layer_idx)

    def make_attention(self, config: Qwen3MoeConfig, *, inputs_shape, partitioner, rngs):
        return self.attention_cls(
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, inputs_shape=inputs_shape, partitioner=partitioner,
            rope=RoPE(theta=config.rope_theta), sliding_window=config.window,
            qk_norm=True, qk_norm_eps=config.rms_norm_eps, **config.attention_options(),
            rngs=rngs)

    def make_moe(self, config: Qwen3MoeConfig, *, inputs_shape, partitioner, rngs):
        return self.moe_cls(
            num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.moe_intermediate_size, inputs_shape=inputs_shape,
            partitioner=partitioner, scoring="softmax", norm_topk_prob=config.norm_topk_prob,
            **config.moe_options(), rngs=rngs)


class Qwen3Moe(CausalLM):
    """The Qwen3-MoE causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``.

    ``Qwen3Moe(config, *, inputs_shape=(batch, length), partitioner=None, rngs,
    decoder_layer_cls=None)``; see `zoo.models.decoder.CausalLM`. The checkpoint names are the
    layers' own (`MoE`'s defaults are the Qwen layout), so there is no key map here.
    """

    config_cls: ClassVar[type] = Qwen3MoeConfig
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = Qwen3MoeDecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("qwen3_moe",)


from_hf, to_hf = family_io(Qwen3Moe, "Qwen3-MoE", "Hub layout; either rope spelling in config.json")

registry.register(registry.Family(
    name="qwen3_moe", config_cls=Qwen3MoeConfig, model_cls=Qwen3Moe,
    presets={"qwen3_30b_a3b": Qwen3MoeConfig.qwen3_30b_a3b, "mini": Qwen3MoeConfig.mini}))
