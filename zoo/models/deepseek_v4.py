"""DeepSeek-V4: compressed attention, manifold-constrained hyper-connections, hash-routed MoE.

* Residual stream as ``hc_mult`` streams ``[B, L, n, D]`` (the embedding copied into each);
  around each block a `zoo.layers.HyperConnection` collapses them into the block's input and
  expands its output back, mixing the streams with a Sinkhorn-Knopp doubly stochastic matrix;
  a `zoo.layers.HyperHead` collapses them before the final RMSNorm.
* Attention (`zoo.layers.compressed_attention.CompressedAttention`), one kind per layer
  (``layer_types``): ``sliding_attention`` (a window of ``sliding_window`` tokens, main RoPE
  base ``rope_theta``), ``compressed_sparse_attention`` (CSA: entries of 4 tokens over
  overlapping windows, a lightning indexer picks each query's ``index_topk``) and
  ``heavily_compressed_attention`` (HCA: entries of 128 tokens, all visible), both with the
  sliding branch and the compressed branches' RoPE (``compress_rope_theta`` with YaRN,
  ``rope_scaling``); single-KV-head MQA of ``head_dim`` 512, attention sinks, a grouped
  low-rank output projection (``o_groups``, ``o_lora_rank``).
* Every layer an MoE (`zoo.layers.MoE`) of ``n_routed_experts`` SwiGLU experts clamped at
  ``swiglu_limit`` plus ``n_shared_experts`` shared ones (clamped too): the first layers
  (``mlp_layer_types == "hash_moe"``) take each token's experts from a fixed token-id table
  (``tid2eid``, from the checkpoint; the model passes its token ids down), the others rank
  ``sqrtsoftplus`` scores plus a selection bias (aux-loss-free balancing, as DeepSeek-V3);
  weights normalised and scaled by ``routed_scaling_factor``.
* Scanned as cycles: layers of one (attention kind, MoE kind) share a stack, and a pattern
  that repeats (V4-Flash: sliding, sliding, CSA, then (HCA, CSA) x 20) runs as one scan over
  the cycle (`zoo.models.stacks.layer_cycles`).
* Training the CSA indexers as DeepSeek-V3.2 trains its own (``index_stage``, zoo-only;
  ``--set index_stage=...``; `zoo.models.deepseek_v32.index_stage_outputs` and
  `index_stage_frozen`): ``"off"`` (default, and what `from_hf` gives) selects with no
  indexer loss; ``"warmup"`` attends densely to every visible compressed entry (beside the
  sliding window and sinks) while the main model is frozen (logits and other aux under
  ``stop_gradient``, `DeepSeekV4.frozen_state`), the indexers learning the main attention's
  head-summed distribution over the entries by KL; ``"sparse"`` the sparse forward, the main
  model on the language-model loss and the indexers (detached input) on the KL over their
  selected entries. ``aux["indexer_loss"]`` sums the CSA layers' mean KL per query (MTP's
  included); sliding and HCA layers have no indexer.
* `DeepSeekV4Config` has Hugging Face's ``DeepseekV4Config`` field names (``model_type``
  ``deepseek_v4``). Presets: `deepseek_v4_flash` (284B, what transformers' defaults build),
  `deepseek_v4_pro` (1.6T) and `mini`.
* Multi-token prediction (``num_nextn_predict_layers`` modules, `DeepSeekV4MTP`; DeepSeek's
  ``MTPBlock``): module ``d`` reads the previous depth's streams ``[B, L, n, D]`` (the
  trunk's, before its hyper head, for ``d = 1``) and the embedding ``e`` of the token ``d``
  ahead, ``x = e_proj(enorm(e))`` added to every stream of ``h_proj(hnorm(streams))``, runs
  one more V4 decoder layer (hyper-connections and all; attention kind ``mtp_layer_types``,
  published as the trailing entries of ``compress_ratios``: sliding for V4-Flash; routed,
  not hashed), and predicts the token ``d + 1`` ahead through its own hyper head
  (``hc_head``) and norm and the shared embedding and head. ``model(tokens, ...,
  mtp_tokens=[d, B, L])`` returns their logits in ``aux["mtp_logits"]`` and
  `zoo.train.step.loss_fn` adds ``mtp_loss_weight`` times their mean cross-entropy, as for
  DeepSeek-V3. transformers builds no MTP and ignores the checkpoint's ``mtp.*`` tensors:
  its meta-device counts (V4-Flash 284,332,230,231, the published "284B") exclude them, so
  the presets (one module, as published) count more (`DeepSeekV4Config.num_params`).
  Speculative decoding (``speculative="mtp"``) drafts with the first module: a verify step
  decodes 2 tokens, each layer's state taking them in turn, and a row whose draft is rejected
  keeps its states as they were after the first (`zoo.inference.speculative`).
* `from_hf(path)` / `to_hf(model, path)`: the layout transformers' ``save_pretrained`` writes
  and ``from_pretrained`` reads for ``deepseek_v4`` (DeepSeek's names: ``model.layers.{i}.attn
  .wq_a``, ``.ffn.experts.{e}.w1``, ``.hc_attn_fn``, ``head.weight``, ...; `published_key`
  maps transformers' module names, which the layers own, to them); the MTP modules under
  DeepSeek's published names (``mtp.{d}.e_proj.weight``, ``.h_proj``, ``.enorm``,
  ``.hnorm``, ``.norm``, ``.hc_head_fn``/``_base``/``_scale``, then the layer's ``.attn.*``,
  ``.ffn.*``, ``.hc_attn_fn``, ...), which transformers skips on load; a checkpoint without
  them (transformers saves none) leaves the modules freshly initialised, with a warning.
  DeepSeek's release layout loads too (told apart by its keys, `checkpoint_layout`): the same
  names without ``model.`` (``embed.weight``, ``norm.weight``, ``hc_head_fn``,
  ``layers.{i}.attn.kv_norm``, `release_key`), FP8 e4m3 weights with a ue8m0 ``X.scale`` per
  128x128 block and routed experts in FP4 e2m1 (two a byte, a ue8m0 scale per 32 inputs),
  dequantised on load to ``param_dtype`` (`zoo.models.hf.CheckpointReader`);
  ``to_hf(model, path, layout="release")`` writes those names back, weights unquantised.

Legend: B batch, L length, n streams (hc_mult), D hidden_size, E routed experts.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.layers.compressed_attention import CompressedAttention
from zoo.layers.hyper_connection import STREAMS, HyperConnection, HyperHead, expand_streams
from zoo.layers.linear import Linear
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import RoPE, YaRN
from zoo.models import hf, registry
from zoo.models.config import DecoderConfig, check_hf_types, check_positive, zoo_field
from zoo.models.decoder import CausalLM, DecoderLayer, count_params, family_io
from zoo.models.deepseek3 import mtp_positions, update_selection_bias
from zoo.models.deepseek_v32 import check_index_training, index_stage_frozen, index_stage_outputs
from zoo.models.stacks import interleave_aux, layer_groups, run_cycle, run_layers
from zoo.ops import moe as moe_ops
from zoo.ops.grouped import GLU

__all__ = ["DeepSeekV4Config", "DeepSeekV4DecoderLayer", "DeepSeekV4MTP", "DeepSeekV4",
           "from_hf", "to_hf", "published_key", "release_key", "checkpoint_layout", "LAYOUTS"]

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
LAYER_TYPES = (SLIDING, CSA, HCA)
KIND = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}  # CompressedAttention(kind=)
MLP_LAYER_TYPES = ("hash_moe", "moe")

# DeepSeek-V4's context extension of the compressed branches: YaRN x16 over 64k, cos/sin
# unscaled (transformers pins attention_factor=1.0 for them)
V4_YARN = YaRN(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0,
               beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0, attention_factor=1.0)


def default_layer_types(n: int) -> tuple[str, ...]:
    """transformers' default: two HCA layers, then CSA and HCA interleaved (HCA first)."""
    return (HCA,) * min(n, 2) + tuple(CSA if i % 2 else HCA for i in range(max(n - 2, 0)))


def flash_layer_types(n: int = 43) -> tuple[str, ...]:
    """DeepSeek-V4-Flash's pattern: two sliding layers, one CSA, then (HCA, CSA) repeated."""
    return ((SLIDING, SLIDING, CSA) + (HCA, CSA) * n)[:n]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeekV4Config(DecoderConfig):
    """DeepSeek-V4 hyper-parameters, Hugging Face ``DeepseekV4Config``'s names and defaults
    (V4-Flash's shape). ``layer_types`` / ``mlp_layer_types`` None: transformers' defaults
    (two HCA layers then CSA/HCA interleaved; ``num_hash_layers`` hash layers, then routed);
    ``rope_scaling``: the compressed branches' YaRN (None: plain RoPE)."""

    hf_model_type: ClassVar[str] = "deepseek_v4"
    hf_architecture: ClassVar[str] = "DeepseekV4ForCausalLM"
    hf_supported: ClassVar[dict[str, tuple[Any, ...]]] = {
        **DecoderConfig.hf_supported, "attention_bias": (False,), "mlp_bias": (False,),
        "num_key_value_heads": (1,), "topk_method": ("noaux_tc",)}
    hf_constants: ClassVar[dict[str, Any]] = {
        **DecoderConfig.hf_constants, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 1}
    aux_loss_field: ClassVar[str] = "aux_loss_alpha"

    vocab_size: int = 129280
    hidden_size: int = 4096
    intermediate_size: int = zoo_field(0)  # the shared expert's width: moe_intermediate_size
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YaRN | None = V4_YARN
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    num_hash_layers: int = zoo_field(3)  # how many hash_moe layers mlp_layer_types=None means
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # multi-token prediction: modules (V4 publishes one), their attention kinds (None: all
    # sliding, as V4-Flash's compress_ratios end in 0; kept None then, so the depth can change
    # alone) and their loss weight (DeepSeek-V3's 0.3)
    num_nextn_predict_layers: int = 1
    mtp_layer_types: tuple[str, ...] | None = None
    mtp_loss_weight: float = zoo_field(0.3)
    aux_loss_alpha: float = zoo_field(1e-4)  # weight of aux["load_balance_loss"]
    # how the CSA layers' indexers train (module docstring): "off" | "warmup" | "sparse"
    index_stage: str = zoo_field("off")
    index_loss_weight: float = zoo_field(1.0)  # weight of aux["indexer_loss"] in the loss

    def __post_init__(self):
        what = type(self).__name__
        set_ = lambda name, value: object.__setattr__(self, name, value)
        if isinstance(self.rope_scaling, dict):
            set_("rope_scaling", YaRN(**self.rope_scaling))
        set_("intermediate_size", self.moe_intermediate_size)
        n = self.num_hidden_layers
        layers = default_layer_types(n) if self.layer_types is None else tuple(self.layer_types)
        hashed = min(n, self.num_hash_layers)
        mlps = (("hash_moe",) * hashed + ("moe",) * (n - hashed)
                if self.mlp_layer_types is None else tuple(self.mlp_layer_types))
        set_("layer_types", layers)
        set_("mlp_layer_types", mlps)
        set_("num_hash_layers", sum(t == "hash_moe" for t in mlps))  # one spelling per config
        depth = self.num_nextn_predict_layers
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"{what}: num_nextn_predict_layers={depth!r} must be an int >= 0 "
                             f"(the multi-token-prediction modules; DeepSeek-V4 publishes 1)")
        mtp = None if self.mtp_layer_types is None else tuple(self.mtp_layer_types)
        mtp = None if mtp is not None and set(mtp) <= {SLIDING} else mtp
        set_("mtp_layer_types", mtp)
        super().__post_init__()
        check_index_training(self)
        check_positive(self, ("moe_intermediate_size", "head_dim", "qk_rope_head_dim",
                              "q_lora_rank", "num_experts_per_tok", "n_routed_experts",
                              "compress_rate_csa", "compress_rate_hca", "hc_mult",
                              "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank",
                              "index_n_heads", "index_head_dim", "index_topk"))
        for name, values, allowed in (("layer_types", layers, LAYER_TYPES),
                                      ("mlp_layer_types", mlps, MLP_LAYER_TYPES)):
            if len(values) != n:
                raise ValueError(f"{what}: {name} has {len(values)} entries but "
                                 f"num_hidden_layers={n}; give one per layer")
            bad = sorted({v for v in values if v not in allowed})
            if bad:
                raise ValueError(f"{what}: {name} entries {bad} are not among {allowed}")
        if mtp is not None and (len(mtp) != depth or any(t not in LAYER_TYPES for t in mtp)):
            raise ValueError(f"{what}: mtp_layer_types={mtp!r} must hold one of {LAYER_TYPES} "
                             f"per MTP module (num_nextn_predict_layers={depth}); pass "
                             f"{(SLIDING,) * depth!r} or None")
        if not (isinstance(self.mtp_loss_weight, (int, float)) and self.mtp_loss_weight >= 0
                and math.isfinite(self.mtp_loss_weight)):
            raise ValueError(f"{what}: mtp_loss_weight={self.mtp_loss_weight!r} must be a finite "
                             f"number >= 0 (DeepSeek-V3's: 0.3)")
        if self.num_key_value_heads != 1:
            raise ValueError(f"{what}: num_key_value_heads={self.num_key_value_heads}; "
                             f"DeepSeek-V4's attention has one shared key/value head")
        if self.scoring_func not in moe_ops.SCORINGS:
            raise ValueError(f"{what}: scoring_func={self.scoring_func!r} must be one of "
                             f"{moe_ops.SCORINGS} (DeepSeek-V4: 'sqrtsoftplus')")
        if self.n_shared_experts < 0:
            raise ValueError(f"{what}: n_shared_experts={self.n_shared_experts} must be >= 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YaRN):
            raise ValueError(f"{what}: rope_scaling={self.rope_scaling!r} must be a "
                             f"zoo.layers.YaRN, a dict of its fields, or None")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def deepseek_v4_flash(cls, **overrides) -> DeepSeekV4Config:
        """deepseek-ai/DeepSeek-V4-Flash: 43 layers (sliding, sliding, CSA, then HCA and CSA
        alternating), hidden 4096, 64 heads of 512, 256 experts (top-6) of width 2048 + 1
        shared, 3 hash layers. Layers rematerialised; MoE exact in bounded buffers is not
        available for clamped experts, so it runs dropless."""
        return cls(**{"layer_types": flash_layer_types(43), "remat_policy": "full",
                      **overrides})

    @classmethod
    def deepseek_v4_pro(cls, **overrides) -> DeepSeekV4Config:
        """deepseek-ai/DeepSeek-V4-Pro: 61 layers (transformers' default pattern: two HCA
        layers, then CSA and HCA interleaved), hidden 7168, 128 heads of 512, query LoRA 1536,
        16 output groups, 384 experts (top-6) of width 3072 + 1 shared, CSA top-1024."""
        return cls(**{**dict(
            hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
            q_lora_rank=1536, o_groups=16, moe_intermediate_size=3072, n_routed_experts=384,
            index_topk=1024, remat_policy="full"), **overrides})

    @classmethod
    def mini(cls, **overrides) -> DeepSeekV4Config:
        """A V4-shaped reduction that trains on a CPU: 4 layers (sliding, CSA, HCA, CSA; the
        first hash-routed), hidden 64, 4 heads of 32 (8 rotary), HCA entries of 16 tokens,
        8 experts (top-2) + 1 shared, vocab 264 (the byte tokenizer's ids, padded)."""
        return cls(**{**dict(
            vocab_size=264, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32,
            num_experts_per_tok=2, n_routed_experts=8, layer_types=(SLIDING, CSA, HCA, CSA),
            num_hash_layers=1, compress_rate_hca=16, sliding_window=16, o_groups=2,
            o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=8,
            max_position_embeddings=4096, num_nextn_predict_layers=0,
            rope_scaling=YaRN(factor=4.0, original_max_position_embeddings=1024,
                              beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0,
                              attention_factor=1.0)), **overrides})

    # -- Hugging Face config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides) -> DeepSeekV4Config:
        """A ``deepseek_v4`` config.json: transformers' (nested ``rope_parameters`` with
        ``main``/``compress``, ``compress_rates``, ``partial_rotary_factor``) or the published
        spelling (``compress_ratios`` per layer, ``num_hash_layers``, ``rope_scaling``)."""
        what = f"{cls.__name__}.from_hf_config"
        hf.check_fields(cfg, cls.hf_supported, what=what)
        skip = {"rope_theta", "rope_scaling", "layer_types", "mlp_layer_types",
                "compress_rate_csa", "compress_rate_hca", "qk_rope_head_dim", "mtp_layer_types"}
        kwargs = {f.name: cfg[f.name] for f in cls.hf_fields()
                  if f.name not in skip and cfg.get(f.name) is not None}
        check_hf_types(cls, kwargs, what=what)
        rates = dict(cfg.get("compress_rates") or {})
        for key, name in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
            value = rates.get(key, cfg.get(name))
            if value is not None:
                kwargs[name] = value
        ratios = cfg.get("compress_ratios")
        by_rate = {0: SLIDING, kwargs.get("compress_rate_csa", 4): CSA,
                   kwargs.get("compress_rate_hca", 128): HCA}
        n = cfg.get("num_hidden_layers", cls.num_hidden_layers)

        def kinds(rates):  # published: 0 sliding, else the layer kind of that rate
            try:
                return tuple(by_rate[int(r)] for r in rates)
            except KeyError as e:
                raise ValueError(f"{what}: compress_ratios holds {e.args[0]}, not 0 or a "
                                 f"compression rate {sorted(by_rate)}") from None

        if cfg.get("layer_types") is not None:
            kwargs["layer_types"] = tuple(cfg["layer_types"])
        elif ratios is not None:
            kwargs["layer_types"] = kinds(ratios[:n])
        depth = kwargs.get("num_nextn_predict_layers", cls.num_nextn_predict_layers)
        if cfg.get("mtp_layer_types") is not None:
            kwargs["mtp_layer_types"] = tuple(cfg["mtp_layer_types"])
        elif ratios is not None and len(ratios) >= n + depth:
            # published: the entries after the trunk's are the MTP layers' (V4-Flash: 0)
            kwargs["mtp_layer_types"] = kinds(ratios[n:n + depth])
        if cfg.get("mlp_layer_types") is not None:
            kwargs["mlp_layer_types"] = tuple(cfg["mlp_layer_types"])
        elif cfg.get("num_hash_layers") is not None:
            kwargs["num_hash_layers"] = int(cfg["num_hash_layers"])
        head_dim = kwargs.get("head_dim", cls.head_dim)
        if cfg.get("qk_rope_head_dim") is not None:
            kwargs["qk_rope_head_dim"] = int(cfg["qk_rope_head_dim"])
        elif cfg.get("partial_rotary_factor") is not None:
            kwargs["qk_rope_head_dim"] = int(head_dim * cfg["partial_rotary_factor"])
        params = cfg.get("rope_parameters") or {}
        main, compress = params.get("main"), params.get("compress")
        if isinstance(main, dict) and isinstance(compress, dict):
            kwargs["rope_theta"], _ = hf.rope_from_hf({"rope_parameters": main}, what=what,
                                                      default_theta=cls.rope_theta)
            kwargs["compress_rope_theta"], kwargs["rope_scaling"] = hf.rope_from_hf(
                {"rope_parameters": compress,
                 "max_position_embeddings": cfg.get("max_position_embeddings")},
                what=what, default_theta=cls.compress_rope_theta)
        else:  # published: rope_theta for the main rotary, rope_scaling for the compressed one
            flat = {k: v for k, v in (cfg.get("rope_scaling") or params).items()
                    if k not in ("main", "compress")}
            kwargs["rope_theta"] = float(cfg.get("rope_theta") or cls.rope_theta)
            rope = {**flat, "rope_theta": cfg.get("compress_rope_theta",
                                                  cls.compress_rope_theta)}
            if rope.get("rope_type", rope.get("type")) == "yarn":
                rope.setdefault("attention_factor", 1.0)  # as transformers
            kwargs["compress_rope_theta"], kwargs["rope_scaling"] = hf.rope_from_hf(
                {"rope_parameters": rope,
                 "max_position_embeddings": cfg.get("max_position_embeddings")},
                what=what, default_theta=cls.compress_rope_theta)
        return cls(**{**kwargs, **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in self.hf_fields()
               if f.name not in ("rope_scaling", "compress_rate_csa", "compress_rate_hca")}
        out["layer_types"] = list(self.layer_types)
        out["mlp_layer_types"] = list(self.mlp_layer_types)
        out["mtp_layer_types"] = list(self.mtp_attention_types)
        out["compress_rates"] = {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}
        factor = self.qk_rope_head_dim / self.head_dim
        out["partial_rotary_factor"] = factor
        out["rope_parameters"] = {
            "main": {**hf.rope_to_hf(self.rope_theta, None), "partial_rotary_factor": factor},
            "compress": {**hf.rope_to_hf(self.compress_rope_theta, self.rope_scaling),
                         "partial_rotary_factor": factor}}
        out.update(self.hf_constants)
        out.update(architectures=[self.hf_architecture], model_type=self.hf_model_type,
                   dtype=jnp.dtype(self.param_dtype).name)
        return out

    # -- derived quantities --------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def mtp_depth(self) -> int:
        """The number of MTP modules: ``num_nextn_predict_layers``."""
        return self.num_nextn_predict_layers

    @property
    def mtp_attention_types(self) -> tuple[str, ...]:
        """The MTP layers' attention kinds: ``mtp_layer_types``, all sliding when None."""
        return self.mtp_layer_types or (SLIDING,) * self.mtp_depth

    def attention_type(self, layer_idx: int) -> str:
        """Layer `layer_idx`'s attention kind: ``layer_types``, then for the MTP modules'
        layers (indices ``num_hidden_layers + d``) ``mtp_layer_types``."""
        n = self.num_hidden_layers
        return self.layer_types[layer_idx] if layer_idx < n else \
            self.mtp_attention_types[layer_idx - n]

    def mlp_type(self, layer_idx: int) -> str:
        """Layer `layer_idx`'s MoE kind: ``mlp_layer_types``; an MTP layer routes (``moe``:
        DeepSeek hashes only layers below ``num_hash_layers``)."""
        n = self.num_hidden_layers
        return self.mlp_layer_types[layer_idx] if layer_idx < n else "moe"

    def rope(self, layer_type: str) -> RoPE:
        """The layer kind's `RoPE`: the main base for sliding layers, the compressed branches'
        (with YaRN) for CSA/HCA."""
        if layer_type == SLIDING:
            return RoPE(theta=self.rope_theta, interleaved=True)
        return RoPE(theta=self.compress_rope_theta, interleaved=True, scaling=self.rope_scaling)

    def num_params(self) -> int:
        """Parameter count from `nnx.eval_shape` (allocates nothing; buffers excluded), the
        MTP modules' included (transformers' count has none: ``num_nextn_predict_layers=0``
        gives it)."""
        return count_params(DeepSeekV4.abstract(self.for_counting()))

    def active_matmul_params(self) -> int:
        """Weights one token multiplies with, from the abstract model: everything but the
        embedding and the routed experts, plus k routed experts per layer (the MTP layers'
        too) and the head once more per MTP module."""
        model = DeepSeekV4.abstract(self.for_counting())
        total = count_params(model)
        F, D = self.moe_intermediate_size, self.hidden_size
        layers = self.num_hidden_layers + self.mtp_depth
        routed = 3 * D * F * self.n_routed_experts * layers
        active = 3 * D * F * self.num_experts_per_tok * layers
        return total - routed + active - self.vocab_size * D * (1 - self.mtp_depth)

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training FLOPs per token: ``6 * active_matmul_params`` plus attention ``3 * 2 * N *
        2H`` per key a query sees: its sliding window, and per layer kind the compressed
        entries it reads (CSA: ``min(index_topk, entries)``, HCA: all of them)."""
        keys_seen = (seq_len + 1) / 2 if causal else seq_len
        window = min(self.sliding_window, keys_seen)
        attn = 0.0
        for kind in (*self.layer_types, *self.mtp_attention_types):
            keys = window
            if kind == CSA:
                keys += min(self.index_topk, keys_seen / self.compress_rate_csa)
            elif kind == HCA:
                keys += keys_seen / self.compress_rate_hca
            attn += 2 * self.num_attention_heads * 2 * self.head_dim * keys
        return 3 * (2 * self.active_matmul_params() + attn)


# transformers' module names (what the layers own) -> the checkpoint's names
# (``save_pretrained`` / ``from_pretrained`` for deepseek_v4), applied in order
_PUBLISHED = [(re.compile(a), b) for a, b in (
    (r"\.mlp\.(experts\.\d+|shared_experts)\.gate_proj\.", r".ffn.\1.w1."),
    (r"\.mlp\.(experts\.\d+|shared_experts)\.up_proj\.", r".ffn.\1.w3."),
    (r"\.mlp\.(experts\.\d+|shared_experts)\.down_proj\.", r".ffn.\1.w2."),
    (r"\.mlp\.gate\.e_score_correction_bias$", r".ffn.gate.bias"),
    (r"\.mlp\.", r".ffn."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"^(mtp\.\d+)\.hc_head\.hc_(fn|base|scale)$", r"\1.hc_head_\2"),  # an MTP module's head
    (r"\.input_layernorm\.", r".attn_norm."),
    (r"\.post_attention_layernorm\.", r".ffn_norm."),
    (r"^lm_head\.weight$", r"head.weight"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", r".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", r".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", r".attn.indexer.compressor."),
    (r"\.self_attn\.", r".attn."),
    (r"\.sinks$", r".attn_sink"),
    (r"\.kv_norm\.", r".norm."),
    # transformers never reads or writes the MTP tensors: DeepSeek's own name for the
    # attention's norm there (its compressor's stays ``norm``)
    (r"^(mtp\.\d+\.attn)\.norm\.", r"\1.kv_norm."),
    (r"\.position_bias$", r".ape"),
    (r"\.q_a_proj\.", r".wq_a."),
    (r"\.q_b_proj\.", r".wq_b."),
    (r"\.kv_proj\.", r".wkv."),
    (r"\.gate_proj\.", r".wgate."),
    (r"\.o_a_proj\.", r".wo_a."),
    (r"\.o_b_proj\.", r".wo_b."),
    (r"\.q_a_norm\.", r".q_norm."),
)]


def published_key(key: str) -> str:
    """A key in transformers' module names (``model.layers.1.self_attn.q_a_proj.weight``) as
    the checkpoint names it (``model.layers.1.attn.wq_a.weight``): the reverse of
    transformers' ``deepseek_v4`` weight conversion."""
    for pattern, repl in _PUBLISHED:
        key = pattern.sub(repl, key)
    return key


def _published(row, key=published_key):
    if isinstance(row, hf.LayerStack):
        return dataclasses.replace(row, rows=tuple(_published(r, key) for r in row.rows))
    return dataclasses.replace(row, keys=tuple(key(k) for k in row.keys))


# transformers' checkpoint names (`published_key`) -> DeepSeek's release (the safetensors of
# deepseek-ai/DeepSeek-V4-Flash and -Pro, the names of its inference/model.py): no ``model.``
# prefix, ``embed`` / ``norm`` / ``hc_head_{fn,base,scale}`` at the top, the attention's own
# KV norm ``kv_norm`` (its compressors' stay ``norm``); MTP names are the same in both
_RELEASE = [(re.compile(a), b) for a, b in (
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.", ""),
    (r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm."),
)]
LAYOUTS = ("transformers", "release")


def release_key(key: str) -> str:
    """A key as transformers' ``save_pretrained`` names it (`published_key`:
    ``model.layers.1.attn.norm.weight``) as DeepSeek's release does
    (``layers.1.attn.kv_norm.weight``; ``model.embed_tokens.weight`` -> ``embed.weight``,
    ``model.hc_head.hc_fn`` -> ``hc_head_fn``)."""
    for pattern, repl in _RELEASE:
        key = pattern.sub(repl, key)
    return key


def checkpoint_layout(keys) -> str:
    """``"release"`` when `keys` are DeepSeek's release names (``embed.weight``,
    ``layers.{i}.*``), else ``"transformers"``."""
    keys = set(keys)
    return "release" if "embed.weight" in keys or any(k.startswith("layers.") for k in keys) \
        else "transformers"


class DeepSeekV4DecoderLayer(DecoderLayer):
    """``x = attn_hc(x, self_attn . input_layernorm)``, then ``x = ffn_hc(x, mlp .
    post_attention_layernorm)`` on the streams ``[B, L, n, D]``; the MoE gets the token ids
    (hash routing). Pieces swap as in `DecoderLayer` (``attention_cls``, ``moe_cls``)."""

    attention_cls: ClassVar[type] = CompressedAttention
    hyper_connection_cls: ClassVar[type] = HyperConnection

    def __init__(self, config: DeepSeekV4Config, *, layer_idx: int, inputs_shape,
                 partitioner=None, rngs: nnx.Rngs):
        super().__init__(config, layer_idx=layer_idx, inputs_shape=inputs_shape,
                         partitioner=partitioner, rngs=rngs)
        hc = lambda: self.hyper_connection_cls(
            embed_dim=config.hidden_size, hc_mult=config.hc_mult,
            sinkhorn_iters=config.hc_sinkhorn_iters, eps=config.hc_eps,
            norm_eps=config.rms_norm_eps, partitioner=self.partitioner,
            param_dtype=config.param_dtype, rngs=rngs)
        self.attn_hc, self.ffn_hc = hc(), hc()

    @classmethod
    def uses_moe(cls, config, layer_idx: int) -> bool:
        return True

    @classmethod
    def layer_kind(cls, config: DeepSeekV4Config, layer_idx: int):
        return config.attention_type(layer_idx), config.mlp_type(layer_idx)

    def make_attention(self, config: DeepSeekV4Config, *, inputs_shape, partitioner, rngs):
        kind = config.attention_type(self.layer_idx)
        rate = {CSA: config.compress_rate_csa, HCA: config.compress_rate_hca}.get(kind)
        return self.attention_cls(
            kind=KIND[kind], num_heads=config.num_attention_heads, head_dim=config.head_dim,
            rope_head_dim=config.qk_rope_head_dim, q_lora_rank=config.q_lora_rank,
            o_groups=config.o_groups, o_lora_rank=config.o_lora_rank,
            sliding_window=config.sliding_window, compress_rate=rate,
            index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
            index_topk=config.index_topk, rope=config.rope(kind),
            index_stage=config.index_stage if kind == CSA else "off",
            rms_norm_eps=config.rms_norm_eps, layout=config.attention_layout,
            dtype=config.dtype, param_dtype=config.param_dtype, inputs_shape=inputs_shape,
            partitioner=partitioner, rngs=rngs)

    def make_moe(self, config: DeepSeekV4Config, *, inputs_shape, partitioner, rngs):
        hashed = config.mlp_type(self.layer_idx) == "hash_moe"
        return self.moe_cls(
            num_experts=config.n_routed_experts, num_experts_per_tok=config.num_experts_per_tok,
            mlp_dim=config.moe_intermediate_size, inputs_shape=inputs_shape,
            partitioner=partitioner, scoring=config.scoring_func,
            routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob, num_shared_experts=config.n_shared_experts,
            activation=GLU(limit=config.swiglu_limit),
            shared_limit=config.swiglu_limit,
            hash_vocab_size=config.vocab_size if hashed else None,
            **config.moe_options(), rngs=rngs)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return super().hf_keys(prefix) + hfk.children(self, prefix, ("attn_hc", "ffn_hc"))

    def block(self, x: jax.Array, attention, tokens: jax.Array | None = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The layer on the streams ``x [B, L, n, D]`` with ``attention(h [B, L, D])`` in place
        of ``self_attn`` (`zoo.models.decoder.DecoderLayer.block`; `zoo.inference` passes one
        that reads and writes the layer's cache); ``tokens [B, L]``: the ids the hash-routed
        MoE looks up."""
        with jax.named_scope(f"layer_{self.layer_idx}"):
            h, post, comb = self.attn_hc.collapse(x)
            a = attention(self.input_layernorm(h))
            x = self.attn_hc.expand(jax.ad_checkpoint.checkpoint_name(
                a.astype(x.dtype), "attention_out"), x, post, comb)
            h, post, comb = self.ffn_hc.collapse(x)
            m, aux = self.mlp(self.post_attention_layernorm(h), tokens)
            x = self.ffn_hc.expand(jax.ad_checkpoint.checkpoint_name(
                m.astype(x.dtype), "mlp_out"), x, post, comb)
            return x, aux

    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None, tokens: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Streams ``x [B, L, n, D]`` -> ``(streams, the MoE's aux)``; ``tokens [B, L]``: the
        ids the hash-routed layers look up."""
        return self.block(x, lambda h: self.self_attn(h, positions=positions,
                                                      segment_ids=segment_ids), tokens)


class DeepSeekV4MTP(nnx.Module):
    """One multi-token-prediction module (DeepSeek's ``MTPBlock``): the previous depth's
    streams ``h [B, L, n, D]`` and the embedding ``e [B, L, D]`` of the token ``depth``
    ahead combine as ``e_proj(enorm(e))`` added to each stream of ``h_proj(hnorm(h))``, then
    one `DeepSeekV4DecoderLayer` (index ``num_hidden_layers + depth - 1``) runs on them; its
    own hyper head (``hc_head``) and ``norm`` lead to the model's shared head."""

    def __init__(self, config: DeepSeekV4Config, *, depth: int, layer_cls: type[DecoderLayer],
                 inputs_shape, partitioner, rngs: nnx.Rngs):
        D, pd = config.hidden_size, config.param_dtype
        norm = lambda: RMSNorm(D, eps=config.rms_norm_eps, partitioner=partitioner,
                               param_dtype=pd, rngs=rngs)
        proj = lambda: Linear(D, D, in_axes=("embed",), out_axes=(None,),
                              partitioner=partitioner, dtype=config.dtype, param_dtype=pd,
                              fp8=config.fp8, rngs=rngs)
        self.depth = depth
        self.partitioner = partitioner
        self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
        self.e_proj, self.h_proj = proj(), proj()
        self.layer = layer_cls(config, layer_idx=config.num_hidden_layers + depth - 1,
                               inputs_shape=inputs_shape, partitioner=partitioner, rngs=rngs)
        self.hc_head = HyperHead(embed_dim=D, hc_mult=config.hc_mult, eps=config.hc_eps,
                                 norm_eps=config.rms_norm_eps, partitioner=partitioner,
                                 param_dtype=pd, rngs=rngs)

    def hf_keys(self, prefix: str) -> list:
        """DeepSeek's layout: the module's tensors and its decoder layer's side by side under
        ``prefix`` (``mtp.0.e_proj.weight``, ``mtp.0.hc_head.hc_fn`` (published as
        ``mtp.0.hc_head_fn``: `published_key`), ``mtp.0.self_attn.*``, ...)."""
        rows = hfk.children(self, prefix, ("enorm", "hnorm", "e_proj", "h_proj", "norm",
                                           "hc_head"))
        return rows + [dataclasses.replace(r, path=("layer", *r.path))
                       for r in hfk.keys_of(self.layer, prefix)]

    def combine(self, streams: jax.Array, embedded: jax.Array) -> jax.Array:
        """The decoder layer's input streams ``[B, L, n, D]``: ``e_proj(enorm(embedded))``
        added to every stream of ``h_proj(hnorm(streams))``."""
        e = self.e_proj(self.enorm(embedded))
        h = self.h_proj(self.hnorm(streams))
        return self.partitioner.constrain(e[:, :, None].astype(h.dtype) + h, STREAMS)

    def __call__(self, streams, embedded, tokens, positions, segment_ids, remat):
        """-> (the layer's output streams, its MoE's aux); ``tokens [B, L]``: the ids embedded
        (the layer's MoE reads them as every V4 layer does)."""
        return run_layers(self.layer, self.combine(streams, embedded), positions=positions,
                          segment_ids=segment_ids, remat=remat,
                          layer_kwargs={"tokens": tokens})


class DeepSeekV4(CausalLM):
    """The DeepSeek-V4 causal LM: ``logits, aux = model(tokens, positions=..., segment_ids=...)``
    (see `zoo.models.decoder.CausalLM`); the trunk runs on ``hc_mult`` streams and the
    `HyperHead` (``hc_head``) collapses them before the final norm. With
    ``config.num_nextn_predict_layers`` modules (``self.mtp``, `DeepSeekV4MTP`),
    ``mtp_tokens=`` ``[depth, B, L]`` (row ``d``: the token ``d + 1`` places ahead of each
    position, `zoo.train.step.mtp_targets`) adds their logits as ``aux["mtp_logits"]``
    ``[depth, B, L, V]``; their MoE layers' aux rows follow the trunk's."""

    config_cls: ClassVar[type] = DeepSeekV4Config
    decoder_layer_cls: ClassVar[type[DecoderLayer]] = DeepSeekV4DecoderLayer
    hf_model_types: ClassVar[tuple[str, ...]] = ("deepseek_v4",)
    hf_names: ClassVar[dict[str, str]] = {**CausalLM.hf_names, "hc_head": "model.hc_head"}

    def __init__(self, config: DeepSeekV4Config, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(config, rngs=rngs, **kwargs)
        self.hc_head = HyperHead(embed_dim=config.hidden_size, hc_mult=config.hc_mult,
                                 eps=config.hc_eps, norm_eps=config.rms_norm_eps,
                                 partitioner=self.partitioner, param_dtype=config.param_dtype,
                                 rngs=rngs)
        layer_cls = kwargs.get("decoder_layer_cls") or type(self).decoder_layer_cls
        self.mtp = nnx.List([
            DeepSeekV4MTP(config, depth=d + 1, layer_cls=layer_cls,
                          inputs_shape=(*self.inputs_shape, config.hidden_size),
                          partitioner=self.partitioner, rngs=rngs)
            for d in range(config.mtp_depth)])

    def trunk(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None):
        """Embedding copied into the streams, every layer (each reads the token ids), then
        the hyper head: ``(hidden [B, L, D] before the final norm, per-group aux dicts)``."""
        x, auxes = self.streams(tokens, positions, segment_ids)
        return self.stream_out(x), auxes

    def streams(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None):
        """Embedding copied into the streams and every layer: ``(streams [B, L, n, D] before
        the hyper head, per-group aux dicts)`` (what the MTP modules read)."""
        remat = self.config.remat_policy
        x, extra = self.stream_in(tokens)
        auxes = []
        for group in layer_groups(self.layers):
            kw = dict(positions=positions, segment_ids=segment_ids, remat=remat,
                      layer_kwargs=extra)
            if len(group) == 1:
                x, aux = run_layers(group[0], x, **kw)
            else:
                x, group_aux = run_cycle(group, x, **kw)
                aux = interleave_aux(group_aux)
            auxes.append(aux)
        return x, auxes

    def stream_in(self, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The embedding copied into ``hc_mult`` streams ``[B, L, n, D]``, and the token ids
        every layer takes (hash routing)."""
        x = expand_streams(self.embed_tokens(tokens), self.config.hc_mult)
        return self.partitioner.constrain(x, STREAMS), {"tokens": tokens}

    def stream_out(self, x: jax.Array) -> jax.Array:
        """The streams collapsed by the hyper head (``hc_head``) -> ``[B, L, D]``."""
        return self.hc_head(x)

    # -- speculative decoding (zoo.inference.speculative): the first MTP module drafts --------
    def speculative_support(self) -> str | None:
        """None with an MTP module (`CausalLM.speculative_support`)."""
        return None if len(self.mtp) else super().speculative_support()

    def draft_input(self, stream: jax.Array, ahead: jax.Array) -> tuple[jax.Array, dict]:
        """The first MTP module's layer input from the trunk's streams ``[B, T, n, D]``
        after its last layer (before the hyper head) and the ids ``ahead [B, T]`` of each
        position's next token: (`DeepSeekV4MTP.combine`'s streams, the layer's keyword
        inputs: the ids, as every V4 layer takes them)."""
        return self.mtp[0].combine(stream, self.embed_tokens(ahead)), {"tokens": ahead}

    def draft_hidden(self, x: jax.Array) -> jax.Array:
        """The first MTP module's layer output streams -> hidden ``[B, T, D]`` through its
        own hyper head (``hc_head``), for its ``norm``."""
        return self.mtp[0].hc_head(x)

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, mtp_tokens: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`CausalLM.__call__` (with ``mtp_tokens``: class docstring); in an indexer training
        stage (``config.index_stage``) also ``aux["indexer_loss"]`` (`index_stage_outputs`)."""
        if mtp_tokens is None or not len(self.mtp):
            return index_stage_outputs(self, *super().__call__(
                tokens, positions=positions, segment_ids=segment_ids))
        positions = mtp_positions("DeepSeekV4", tokens, positions, mtp_tokens, len(self.mtp))
        with jax.named_scope("deepseekv4"):
            x, auxes = self.streams(tokens, positions, segment_ids)
            logits = self.head(self.stream_out(x))
            mtp_logits = []
            for d, module in enumerate(self.mtp):
                with jax.named_scope(f"mtp_{d + 1}"):
                    x, aux = module(x, self.embed_tokens(mtp_tokens[d]), mtp_tokens[d],
                                    positions, segment_ids, self.config.remat_policy)
                    auxes.append(aux)
                    mtp_logits.append(self.head(module.hc_head(x), module.norm))
        out = self.collect_aux(auxes)
        out["mtp_logits"] = jnp.stack(mtp_logits)
        return index_stage_outputs(self, logits, out)

    @property
    def frozen_state(self):
        """What a train step leaves unchanged: `index_stage_frozen` of the config's stage
        (in ``"warmup"`` everything but the CSA indexers)."""
        return index_stage_frozen(self.config.index_stage)

    def hf_keys(self, prefix: str = "") -> list:
        """The base's rows, the hyper head's, then MTP module ``d``'s under ``mtp.{d}``
        (DeepSeek's published layout), every key in the checkpoint's names
        (`published_key`)."""
        rows = super().hf_keys(prefix) + hfk.child(self, "hc_head", prefix)
        for d, module in enumerate(self.mtp):
            rows += [dataclasses.replace(r, path=("mtp", d, *r.path))
                     for r in module.hf_keys(hfk.join(prefix, f"mtp.{d}"))]
        return [_published(r) for r in rows]

    def hf_layout_map(self, layout: str = "transformers") -> list:
        """`hf_key_map` in transformers' names (``"transformers"``) or DeepSeek's release
        names (``"release"``, `release_key`)."""
        if layout not in LAYOUTS:
            raise ValueError(f"DeepSeekV4: layout={layout!r} is not one of {LAYOUTS}; "
                             f"'transformers' is what save_pretrained writes, 'release' the "
                             f"names of DeepSeek's published safetensors")
        rows = self.hf_key_map()
        return rows if layout == "transformers" else [_published(r, release_key) for r in rows]

    def hf_load_map(self, keys) -> list:
        """`hf_layout_map` of the layout `keys` are in (`checkpoint_layout`), with the MTP
        modules a checkpoint lacks (transformers saves none) zoo-only: they start as the
        constructor initialises them, with a warning."""
        keys = set(keys)
        table = self.hf_layout_map(checkpoint_layout(keys))
        fresh = [f"mtp.{d}." for d in range(len(self.mtp))
                 if f"mtp.{d}.e_proj.weight" not in keys]
        if fresh:
            warnings.warn(f"DeepSeekV4.from_hf: num_nextn_predict_layers={len(self.mtp)}, but "
                          f"the checkpoint holds no MTP module under {fresh} (no "
                          f"e_proj.weight there; transformers saves none): those MTP modules "
                          f"start freshly initialised", stacklevel=4)
        return [hfk.zoo_only(r.path) if any(k.startswith(p) for k in r.keys for p in fresh)
                else r for r in table]

    def to_hf(self, path, *, layout: str = "transformers", max_shard_bytes: int = 5 * 2**30,
              overwrite: bool = False) -> None:
        """`CausalLM.to_hf` in transformers' names (``layout="transformers"``) or DeepSeek's
        release names (``"release"``); either way the weights are the parameters as they are
        (``param_dtype``, no FP8/FP4 or scales: as zoo exports DeepSeek-V3)."""
        table = self.hf_layout_map(layout)
        hf.save_checkpoint(path, hf.export_tensors(self, table), self.config.to_hf_config(),
                           max_shard_bytes=max_shard_bytes, overwrite=overwrite)


from_hf, _to_hf = family_io(
    DeepSeekV4, "DeepSeek-V4",
    "transformers' deepseek_v4 layout or DeepSeek's release layout, bf16/fp32, or the "
    "release's FP8 (block-scaled e4m3) with FP4 (e2m1) experts, dequantised on load")


def to_hf(model: DeepSeekV4, path, *, layout: str = "transformers",
          max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> None:
    """Write a DeepSeek-V4 model as a checkpoint folder (safetensors + config.json) in
    transformers' names (``layout="transformers"``, what ``from_pretrained`` reads) or
    DeepSeek's release names (``"release"``), weights in ``param_dtype`` (not re-quantised);
    an earlier export there is replaced whole, a folder holding other files is refused
    unless overwrite=True."""
    model.to_hf(path, layout=layout, max_shard_bytes=max_shard_bytes, overwrite=overwrite)

registry.register(registry.Family(
    name="deepseek_v4", config_cls=DeepSeekV4Config, model_cls=DeepSeekV4,
    presets={"deepseek_v4_flash": DeepSeekV4Config.deepseek_v4_flash,
             "deepseek_v4_pro": DeepSeekV4Config.deepseek_v4_pro,
             "mini": DeepSeekV4Config.mini},
    after_step=update_selection_bias))
