"""DeepSeek-V3: config presets, model and Hugging Face interop.

* Decoder-only transformer, pre-norm (RMSNorm), embedding and ``lm_head`` (untied by default;
  ``tie_word_embeddings=True`` shares the table).
* Attention: multi-head latent attention (`zoo.layers.MLA`): low-rank query (``q_lora_rank``),
  compressed KV latent (``kv_lora_rank``) with a decoupled rotary key (``qk_rope_head_dim``)
  shared by all heads; RoPE in DeepSeek's interleaved layout with YaRN (``rope_scaling``) and
  its softmax-scale correction.
* Feed-forward: the first ``first_k_dense_replace`` layers a dense SwiGLU MLP of width
  ``intermediate_size``; the rest an MoE of ``n_routed_experts`` experts of width
  ``moe_intermediate_size``: sigmoid scores, a selection-only ``e_score_correction_bias``
  (aux-loss-free balancing: `zoo.layers.moe.update_expert_bias`), group-limited top-k
  (``n_group``/``topk_group``), weights normalised (``norm_topk_prob``) and scaled by
  ``routed_scaling_factor``, plus ``n_shared_experts`` shared experts.
* Multi-token prediction (``num_nextn_predict_layers`` modules, read as ``mtp_depth``; `MTP`;
  DeepSeek-V3 trains with one): module ``d`` combines the previous depth's hidden state (the
  trunk's, before the final norm, for
  ``d = 1``) with the embedding of the token ``d`` ahead, ``eh_proj([enorm(emb); hnorm(h)])``,
  runs one more MoE decoder layer and predicts the token ``d + 1`` ahead through the shared
  embedding and ``lm_head`` (its own final norm). ``model(tokens, ..., mtp_tokens=[d, B, L])``
  returns their logits in ``aux["mtp_logits"]``; `zoo.train.step.loss_fn` adds
  ``mtp_loss_weight`` times their mean cross-entropy (`mtp_targets` finds each token's
  successor from positions and segment ids, so any sequence layout works). The `deepseek_v3`
  preset has one module, as the published config: 682,636,472,320 parameters, the trunk's
  671,026,404,352 (what transformers builds, ``num_nextn_predict_layers=0``) and the MTP
  module's 11,610,067,968 (the published "671B + 14B" counts the checkpoint's layer 61, which
  also holds copies of the embedding and head: 13,463,426,304 elements before the FP8 scales).
  `from_hf` reads ``num_nextn_predict_layers`` from config.json and loads the checkpoint's
  MTP layer in DeepSeek's layout (``model.layers.61.*``: ``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.norm``, a decoder layer, and copies of the embedding and head,
  ``embed_tokens`` and ``shared_head.head``, which zoo shares with the trunk: their shapes are
  checked, their values not read); `to_hf` writes all of it. A checkpoint that
  declares MTP but holds none (transformers saves none) leaves the modules freshly
  initialised, with a warning.
* `DeepSeek3Config` (a `zoo.models.DecoderConfig`) uses the Hugging Face field names plus the
  base's zoo-only fields (``dtype``, ``param_dtype``, ``remat_policy``, the attention and MoE
  choices).
  Presets: `deepseek_v3` and `mini` (vocab 264 = the byte tokenizer's 259 ids padded).
* `from_hf(path)` / `to_hf(model, path)`: the published layout (per-expert
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj``; FP8 block-quantised weights are dequantised
  while loading), tensor by tensor into sharded parameters.

Legend: B batch, L length, D hidden_size, N heads, Rq q_lora_rank, Rkv kv_lora_rank,
Hn qk_nope_head_dim, Hr qk_rope_head_dim, Hv v_head_dim, E routed experts, F expert width.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, ClassVar


import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.linear import Linear
from zoo.layers.mla import MLA
from zoo.ops.attention import KV_WIRES
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import RoPE, YaRN
from zoo.models.config import DecoderConfig, check_positive, nullable, zoo_field
from zoo.models import registry
from zoo.models.decoder import CausalLM, DecoderLayer, count_params, family_io
from zoo.models.stacks import run_layers

__all__ = ["DeepSeek3Config", "DeepSeek3DecoderLayer", "DeepSeek3", "MTP", "from_hf", "to_hf",
           "update_selection_bias"]


# DeepSeek-V3's context extension: 4k pre-training context stretched 40x (YaRN is frozen, so
# sharing one instance as a dataclass default is safe)
V3_YARN = YaRN(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
               beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


# The full-size presets' MoE (DeepSeek-V3, Kimi K2): all_to_all buffers of twice the balanced
# share, and the copies beyond them sent in further rounds rather than dropped -- exact, as
# DeepSeek trains, at bounded memory. Measured on the TPU compiler (v5p, 256 chips, fsdp=4 x
# expert=64, 256 x 4096, MTP on; docs/moe.md): 47.66 GiB of temporaries (peak 77.81 of 95.74)
# against 45.08 for dropping (+5.7%), where dropless buffers need 162.79 and do not fit.
# ``--set moe_buffer_factor=none`` (dropless) or ``moe_overflow=drop`` restore the others.
FULL_SIZE_MOE = {"moe_buffer_factor": 2.0, "moe_overflow": "exact"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeek3Config(DecoderConfig):
    """DeepSeek-V3 hyper-parameters; field names are those of Hugging Face's
    ``DeepseekV3Config`` (``rope_scaling`` is a `zoo.layers.YaRN`, or a dict of its fields;
    the shared and zoo-only fields are `zoo.models.config.DecoderConfig`'s)."""

    hf_model_type: ClassVar[str] = "deepseek_v3"
    hf_architecture: ClassVar[str] = "DeepseekV3ForCausalLM"
    hf_supported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **DecoderConfig.hf_supported, "attention_bias": (False,), "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",), "moe_layer_freq": (1,)}
    hf_constants: ClassVar[dict[str, Any]] = {
        **DecoderConfig.hf_constants, "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 1}
    aux_loss_field: ClassVar[str] = "aux_loss_alpha"

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128  # MLA: every head has its own K/V; must equal the heads
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = nullable(1536)  # None (null in config.json): a plain q_proj
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YaRN | None = V3_YARN
    rope_interleave: bool = True
    aux_loss_alpha: float = 1e-4  # weight of aux["load_balance_loss"] (DeepSeek's seq-wise alpha)
    # multi-token prediction: modules (DeepSeek-V3 trains with 1) and their loss weight
    # (DeepSeek: 0.3, then 0.1 for the last 4.8T tokens)
    num_nextn_predict_layers: int = 0  # MTP modules (config.json's name; also `mtp_depth`)
    mtp_loss_weight: float = zoo_field(0.3)
    # MLA(kv_wire=): what crosses the context-parallel wire, "latent", "expanded" or "auto"
    mla_kv_wire: str = zoo_field("auto")

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", YaRN(**self.rope_scaling))
        super().__post_init__()
        what = "DeepSeek3Config"
        check_positive(self, ("moe_intermediate_size", "n_routed_experts", "kv_lora_rank",
                              "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group",
                              "topk_group", "num_experts_per_tok"), optional=("q_lora_rank",))
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"{what}: num_key_value_heads={self.num_key_value_heads} must equal "
                             f"num_attention_heads={self.num_attention_heads} (MLA expands the "
                             f"latent into one key/value per head)")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"{what}: first_k_dense_replace={self.first_k_dense_replace} must be "
                             f"between 0 and num_hidden_layers={self.num_hidden_layers}")
        if not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise ValueError(f"{what}: num_nextn_predict_layers={self.mtp_depth!r} must be an "
                             f"int >= 0 (the "
                             f"multi-token-prediction modules; DeepSeek-V3 trains with 1)")
        if not (isinstance(self.mtp_loss_weight, (int, float)) and self.mtp_loss_weight >= 0
                and math.isfinite(self.mtp_loss_weight)):
            raise ValueError(f"{what}: mtp_loss_weight={self.mtp_loss_weight!r} must be a finite "
                             f"number >= 0 (DeepSeek-V3: 0.3)")
        if self.mtp_depth and self.num_hidden_layers + self.mtp_depth <= self.first_k_dense_replace:
            raise ValueError(f"{what}: the MTP layers are MoE layers; first_k_dense_replace="
                             f"{self.first_k_dense_replace} leaves none")
        if self.mla_kv_wire not in KV_WIRES:
            raise ValueError(f"{what}: mla_kv_wire={self.mla_kv_wire!r} must be one of "
                             f"{KV_WIRES} (what MLA sends under context parallelism)")
        if self.n_shared_experts < 0:
            raise ValueError(f"{what}: n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YaRN):
            raise ValueError(f"{what}: rope_scaling={self.rope_scaling!r} must be a "
                             f"zoo.layers.YaRN, a dict of its fields, or None")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def deepseek_v3(cls, **overrides) -> DeepSeek3Config:
        """deepseek-ai/DeepSeek-V3 (and -R1) as published: 671B parameters plus one MTP module
        (``num_nextn_predict_layers=1``, 11.6B more), 37B active in the trunk;
        ``num_nextn_predict_layers=0`` is the model transformers builds (and the scale
        rehearsal's goal row). Layers rematerialised (``remat_policy="full"``): at this size
        activations decide. MoE exact in bounded buffers (`FULL_SIZE_MOE`)."""
        return cls(**{"remat_policy": "full", "num_nextn_predict_layers": 1, **FULL_SIZE_MOE,
                      **overrides})

    @classmethod
    def kimi_k2(cls, **overrides) -> DeepSeek3Config:
        """moonshotai/Kimi-K2 (Base/Instruct): DeepSeek-V3's architecture with 384 routed
        experts, 64 heads, one dense layer and no expert groups; 1,026,408,209,408 parameters
        (no MTP layer: ``num_nextn_predict_layers=0``), 32B active. Layers rematerialised;
        MoE as `deepseek_v3`'s (`FULL_SIZE_MOE`)."""
        return cls(**{**dict(
            vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
            n_routed_experts=384, routed_scaling_factor=2.827, n_group=1, topk_group=1,
            first_k_dense_replace=1, max_position_embeddings=131072, rope_theta=50000.0,
            rope_scaling=YaRN(factor=32.0, original_max_position_embeddings=4096,
                              beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
            aux_loss_alpha=0.001, remat_policy="full", **FULL_SIZE_MOE), **overrides})

    @classmethod
    def mini(cls, **overrides) -> DeepSeek3Config:
        """A DeepSeek-V3-shaped reduction that trains on a CPU: 3 layers (1 dense, 2 MoE), MLA
        with a query LoRA and YaRN, 16 routed experts in 4 groups (top-2 groups, top-4 experts)
        + 1 shared, vocab 264 (the byte tokenizer's 259 ids, padded to a multiple of 8)."""
        return cls(**{**dict(
            vocab_size=264, hidden_size=128, intermediate_size=320, moe_intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=2.5,
            kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32,
            qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4,
            first_k_dense_replace=1, max_position_embeddings=4096,
            rope_scaling=YaRN(factor=4.0, original_max_position_embeddings=1024, beta_fast=32.0,
                              beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
            **overrides})

    # -- derived quantities --------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def rope(self) -> RoPE:
        return RoPE(theta=self.rope_theta, interleaved=self.rope_interleave,
                    scaling=self.rope_scaling)

    def num_params(self) -> int:
        """Parameter count from `nnx.eval_shape` (allocates nothing; bias buffers excluded)."""
        return count_params(DeepSeek3.abstract(self.for_counting()))

    @property
    def mtp_depth(self) -> int:
        """The number of MTP modules: ``num_nextn_predict_layers``."""
        return self.num_nextn_predict_layers

    def active_matmul_params(self) -> int:
        """Weights one token multiplies with (routed: top-k + shared experts; no embedding)."""
        D, N = self.hidden_size, self.num_attention_heads
        if self.q_lora_rank is None:
            q = D * N * self.qk_head_dim
        else:
            q = D * self.q_lora_rank + self.q_lora_rank * N * self.qk_head_dim
        kv = D * (self.kv_lora_rank + self.qk_rope_head_dim) + \
            self.kv_lora_rank * N * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + N * self.v_head_dim * D
        dense = 3 * D * self.intermediate_size
        moe = D * self.n_routed_experts + 3 * D * self.moe_intermediate_size * (
            self.num_experts_per_tok + self.n_shared_experts)
        mtp = self.mtp_depth * (attn + moe + 2 * D * D + D * self.vocab_size)
        return (self.num_hidden_layers * attn + self.first_k_dense_replace * dense
                + self.num_moe_layers * moe + D * self.vocab_size + mtp)

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training (forward + backward = 3x forward) FLOPs per token at this sequence length:
        ``6 * active_matmul_params`` plus attention ``3 * 2 * N * (Hqk + Hv) * S`` per layer, with
        ``S`` the keys a query sees on average (``(seq_len + 1) / 2`` when causal)."""
        keys = (seq_len + 1) / 2 if causal else seq_len
        attn = 2 * self.num_attention_heads * (self.qk_head_dim + self.v_head_dim) * keys
        layers = self.num_hidden_layers + self.mtp_depth
        return 3 * (2 * self.active_matmul_params() + layers * attn)


class DeepSeek3DecoderLayer(DecoderLayer):
    """MLA + (dense MLP for the first ``first_k_dense_replace`` layers, else sigmoid-routed
    MoE with shared experts). Swap a piece with ``attention_cls = ...`` etc."""

    attention_cls: ClassVar[type] = MLA

    @classmethod
    def uses_moe(cls, config: DeepSeek3Config, layer_idx: int) -> bool:
        return layer_idx >= config.first_k_dense_replace

    def attention_kwargs(self, config: DeepSeek3Config) -> dict:
        """`MLA`'s shape and options from the config (a subclass adds its own)."""
        return dict(
            num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            rope=config.rope(), rms_norm_eps=config.rms_norm_eps, kv_wire=config.mla_kv_wire,
            **config.attention_options())

    def make_attention(self, config: DeepSeek3Config, *, inputs_shape, partitioner, rngs):
        return self.attention_cls(inputs_shape=inputs_shape, partitioner=partitioner,
                                  rngs=rngs, **self.attention_kwargs(config))

    def make_moe(self, config: DeepSeek3Config, *, inputs_shape, partitioner, rngs):
        return self.moe_cls(
            num_experts=config.n_routed_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.moe_intermediate_size, inputs_shape=inputs_shape,
            partitioner=partitioner, scoring="sigmoid", n_group=config.n_group,
            topk_group=config.topk_group, routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob, num_shared_experts=config.n_shared_experts,
            **config.moe_options(), rngs=rngs)


class MTP(nnx.Module):
    """One multi-token-prediction module (DeepSeek-V3, section 2.2): ``h' = eh_proj([enorm(e);
    hnorm(h)])`` of the previous depth's hidden state ``h`` and the embedding ``e`` of the
    token ``depth`` ahead, then one decoder layer (index ``num_hidden_layers + depth - 1``);
    the model's embedding and ``lm_head`` are shared, the final norm is its own (``norm``)."""

    def __init__(self, config: DeepSeek3Config, *, depth: int, layer_cls: type[DecoderLayer],
                 inputs_shape, partitioner, rngs: nnx.Rngs):
        D, eps, pd = config.hidden_size, config.rms_norm_eps, config.param_dtype
        norm = lambda: RMSNorm(D, eps=eps, partitioner=partitioner, param_dtype=pd, rngs=rngs)
        self.depth = depth
        self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
        self.eh_proj = Linear(2 * D, D, in_axes=("embed",), out_axes=(None,),
                              partitioner=partitioner, dtype=config.dtype, param_dtype=pd,
                              fp8=config.fp8, rngs=rngs)
        self.layer = layer_cls(config, layer_idx=config.num_hidden_layers + depth - 1,
                               inputs_shape=inputs_shape, partitioner=partitioner, rngs=rngs)

    hf_names: ClassVar[dict[str, str]] = {"norm": "shared_head.norm"}

    def hf_keys(self, prefix: str) -> list:
        """DeepSeek's layout: the module's tensors beside its decoder layer's, all under the
        layer's prefix (``model.layers.61.enorm.weight``, ``...eh_proj.weight``,
        ``...shared_head.norm.weight``, ``...self_attn.*``, ``...mlp.*``)."""
        from zoo.layers import hf_keys as hfk
        rows = hfk.children(self, prefix, ("enorm", "hnorm", "eh_proj", "norm"))
        return rows + [dataclasses.replace(r, path=("layer", *r.path))
                       for r in hfk.keys_of(self.layer, prefix)]

    def combine(self, h, embedded):
        """The decoder layer's input: ``eh_proj([enorm(embedded); hnorm(h)])`` [B, L, D]
        (`zoo.inference.speculative` runs the layer with a KV cache on it)."""
        x = jnp.concatenate([self.enorm(embedded), self.hnorm(h).astype(embedded.dtype)], -1)
        return self.eh_proj(x)

    def __call__(self, h, embedded, positions, segment_ids, remat):
        return run_layers(self.layer, self.combine(h, embedded), positions=positions,
                          segment_ids=segment_ids, remat=remat)


class DeepSeek3(CausalLM):
    """The DeepSeek-V3 causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``.

    ``DeepSeek3(config, *, inputs_shape=(batch, length), partitioner=None, rngs,
    decoder_layer_cls=None)``; see `zoo.models.decoder.CausalLM`. With
    ``config.num_nextn_predict_layers`` modules (`MTP`), ``mtp_tokens=`` ``[depth, B, L]`` (row
    ``d``: the token ``d + 1`` places
    ahead of each position, `zoo.train.step.mtp_targets`) adds their logits to the aux dict as
    ``aux["mtp_logits"]`` ``[depth, B, L, V]``; their MoE layers' aux entries follow the
    trunk's.
    """

    config_cls: ClassVar[type] = DeepSeek3Config
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = DeepSeek3DecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("deepseek_v3",)

    def __init__(self, config: DeepSeek3Config, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(config, rngs=rngs, **kwargs)
        layer_cls = kwargs.get("decoder_layer_cls") or type(self).decoder_layer_cls
        self.mtp = nnx.List([
            MTP(config, depth=d + 1, layer_cls=layer_cls,
                inputs_shape=(*self.inputs_shape, config.hidden_size),
                partitioner=self.partitioner, rngs=rngs) for d in range(config.mtp_depth)])

    # -- speculative decoding (zoo.inference.speculative): the first MTP module drafts --------
    def speculative_support(self) -> str | None:
        """None with an MTP module (`CausalLM.speculative_support`)."""
        return None if len(self.mtp) else super().speculative_support()

    def draft_input(self, stream, ahead: jax.Array) -> tuple[jax.Array, dict]:
        """The first MTP module's layer input from the trunk's stream after its last layer
        (`CausalLM.stream_in`'s kind) and the ids ``ahead [B, T]`` of each position's next
        token: (``combine(hidden, embed(ahead))``, the layer's keyword inputs: none)."""
        return self.mtp[0].combine(self.stream_out(stream), self.embed_tokens(ahead)), {}

    def draft_hidden(self, x: jax.Array) -> jax.Array:
        """The first MTP module's layer output -> hidden ``[B, T, D]`` for its ``norm``."""
        return x

    def hf_keys(self, prefix: str = "") -> list:
        """The base's rows, then MTP module ``d``'s under the layer index after the trunk's
        (``model.layers.{num_hidden_layers + d - 1}.*``, DeepSeek's published layout), with
        the copies of the embedding and ``lm_head`` that layout keeps there (``embed_tokens``,
        ``shared_head.head``): rows of the trunk's variables under a second key, so `to_hf`
        writes them and `from_hf` checks their shapes (the first row of a variable is the one
        read)."""
        from zoo.layers import hf_keys as hfk
        rows = super().hf_keys(prefix)
        layers = hfk.join(prefix, hfk.hf_name(self, "layers"))
        shared = {"embed_tokens": "embed_tokens.weight", "lm_head": "shared_head.head.weight"}
        for d, module in enumerate(self.mtp):
            at = f"{layers}.{module.layer.layer_idx}"
            rows += [dataclasses.replace(r, path=("mtp", d, *r.path))
                     for r in module.hf_keys(at)]
            rows += [dataclasses.replace(r, keys=(f"{at}.{shared[attr]}",))
                     for attr in shared for r in hfk.child(self, attr, prefix)]
        return rows

    def hf_load_map(self, keys) -> list:
        """`hf_key_map`, with the MTP modules a checkpoint lacks (transformers saves none)
        zoo-only: they start as the constructor initialises them, with a warning."""
        from zoo.layers import hf_keys as hfk
        keys, rows = set(keys), self.hf_key_map()
        layers = hfk.hf_name(self, "layers")
        fresh = {f"{layers}.{m.layer.layer_idx}." for m in self.mtp
                 if f"{layers}.{m.layer.layer_idx}.eh_proj.weight" not in keys}
        if fresh:
            warnings.warn(f"DeepSeek3.from_hf: num_nextn_predict_layers={len(self.mtp)}, but "
                          f"the checkpoint holds no MTP layer under {sorted(fresh)} (no "
                          f"eh_proj.weight there; transformers saves none): those MTP modules "
                          f"start freshly initialised", stacklevel=4)
        out = []
        for r in rows:
            if not any(k.startswith(p) for k in r.keys for p in fresh):
                out.append(r)
            elif r.path[:1] == ("mtp",):
                out.append(hfk.zoo_only(r.path))
            # else: a shared copy of a trunk variable the checkpoint lacks; not needed
        return out

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, mtp_tokens: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        if mtp_tokens is None or not len(self.mtp):
            return super().__call__(tokens, positions=positions, segment_ids=segment_ids)
        positions = mtp_positions("DeepSeek3", tokens, positions, mtp_tokens, len(self.mtp))
        with jax.named_scope("deepseek3"):
            h, auxes = self.trunk(tokens, positions, segment_ids)
            logits = self.head(h)
            mtp_logits = []
            for d, module in enumerate(self.mtp):
                with jax.named_scope(f"mtp_{d + 1}"):
                    h, aux = module(h, self.embed_tokens(mtp_tokens[d]), positions,
                                    segment_ids, self.config.remat_policy)
                    auxes.append(aux)
                    mtp_logits.append(self.head(h, module.norm))
        out = self.collect_aux(auxes)
        out["mtp_logits"] = jnp.stack(mtp_logits)
        return logits, out


def mtp_positions(name: str, tokens: jax.Array, positions: jax.Array | None,
                  mtp_tokens: jax.Array, depth: int) -> jax.Array:
    """A forward pass with MTP modules: ``mtp_tokens`` checked to be ``[depth, B, L]`` (the
    tokens ``d + 1`` ahead for module ``d``) and the positions (``0..L-1`` when None)."""
    B, L = tokens.shape
    if tuple(mtp_tokens.shape) != (depth, B, L):
        raise ValueError(f"{name}: mtp_tokens has shape {tuple(mtp_tokens.shape)}; "
                         f"expected (mtp_depth, batch, length) = {(depth, B, L)}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    return positions


from_hf, to_hf = family_io(DeepSeek3, "DeepSeek-V3",
                           "Hub layout, bf16/fp32 or block-FP8; either rope spelling")


def update_selection_bias(model, aux, *, expert_bias_rate: float = 0.0) -> None:
    """DeepSeek-V3's aux-loss-free balancing after each update: the sigmoid routers' selection
    bias moves by ``rate * sign(mean - counts)`` (`zoo.layers.moe.update_expert_bias`)."""
    counts = aux.get("expert_counts")
    if expert_bias_rate and counts is not None and counts.size:
        from zoo.layers.moe import moe_modules, update_expert_bias
        if any(m.e_score_correction_bias is not None for m in moe_modules(model, with_bias=False)):
            update_expert_bias(model, counts, expert_bias_rate)


registry.register(registry.Family(
    name="deepseek3", config_cls=DeepSeek3Config, model_cls=DeepSeek3,
    presets={"deepseek_v3": DeepSeek3Config.deepseek_v3, "kimi_k2": DeepSeek3Config.kimi_k2,
             "mini": DeepSeek3Config.mini},
    after_step=update_selection_bias))
