"""`DecoderConfig`: what every family's config has, and its mapping to Hugging Face config.json.

A family config subclasses it as a frozen, keyword-only dataclass, keeps Hugging Face's field
names, redeclares the shared fields whose defaults differ, and adds its own::

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MyConfig(DecoderConfig):
        hf_model_type: ClassVar[str] = "my_moe"
        hf_architecture: ClassVar[str] = "MyMoeForCausalLM"
        vocab_size: int = 32000
        ...
        num_experts_per_tok: int = 2            # a Hugging Face field: copied both ways
        my_kernel: str = zoo_field("fast")      # zoo-only: never read from / written to config.json

* Hugging Face fields are copied one-to-one by `DecoderConfig.from_hf_config` /
  `DecoderConfig.to_hf_config`; zoo-only fields (`zoo_field`, declared once here for the shared
  ones) are excluded, derived from the field metadata rather than listed per family. The rotary
  settings (``rope_theta`` and, where the family has it, ``rope_scaling``) go through
  `zoo.models.hf.rope_from_hf` / `rope_to_hf` (both spellings).
* `nullable` marks a field where an explicit ``null`` in config.json means something (Mixtral's
  ``sliding_window``, DeepSeek's ``q_lora_rank``); elsewhere a ``null`` keeps the default.
* Every value read from config.json must have its field's annotated type (`check_hf_types`): a
  number written as a string (``"rms_norm_eps": "1e-5"``), a float in an int field or a NaN is
  a `ValueError` naming the field, the value and the type, never coerced.
* The fields `zoo.models.decoder.CausalLM` and the training CLI read are all declared here:
  widths, depth, heads, ``rms_norm_eps``, ``tie_word_embeddings``, ``dtype``/``param_dtype``,
  ``scan_layers``, ``remat_policy``, the attention and MoE choices, plus `num_experts`,
  `num_params` and `flops_per_token` (each family implements these three).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from zoo.models import hf
from zoo.ops import fp8 as fp8_ops

__all__ = ["DecoderConfig", "REMAT_POLICIES", "check_hf_types", "check_positive", "dtype_name",
           "nullable", "zoo_field", "zoo_only_fields"]

ZOO_ONLY = "zoo_only"
NULLABLE = "hf_nullable"
ROPE_FIELDS = ("rope_theta", "rope_scaling")  # mapped through hf.rope_from_hf / rope_to_hf

REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "save_layer_outputs", "offload_layer_outputs")


def zoo_field(default: Any, **kwargs) -> Any:
    """A config field zoo uses that config.json does not carry (dtype, kernels, parallelism)."""
    return dataclasses.field(default=default, metadata={ZOO_ONLY: True}, **kwargs)


def nullable(default: Any) -> Any:
    """A Hugging Face field whose explicit ``null`` in config.json is a value, not "unset"."""
    return dataclasses.field(default=default, metadata={NULLABLE: True})


def zoo_only_fields(cls: type) -> frozenset[str]:
    """Names of `cls`'s zoo-only fields: declared so in `cls` or in `DecoderConfig` (a family
    that redeclares a shared zoo field to change its default keeps it zoo-only)."""
    base = {f.name for f in dataclasses.fields(DecoderConfig) if f.metadata.get(ZOO_ONLY)}
    return frozenset(f.name for f in dataclasses.fields(cls)
                     if f.metadata.get(ZOO_ONLY) or f.name in base)


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def check_positive(config: Any, names: Sequence[str], *, optional: Sequence[str] = ()) -> None:
    """ValueError naming the field unless each of `names` is a positive int (`optional`: or
    None)."""
    what = type(config).__name__
    for name in (*names, *optional):
        value = getattr(config, name)
        if value is None and name in optional:
            continue
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            extra = " or None" if name in optional else ""
            raise ValueError(f"{what}: {name}={value!r} must be a positive int{extra}")


@functools.cache
def _annotations(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _has_type(value: Any, hint: Any) -> bool:
    """Whether the JSON value `value` is of the annotated type `hint` (a float: also finite)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, (bool, np.bool_))
    if isinstance(value, (bool, np.bool_)):
        return False
    if hint is int:
        return isinstance(value, (int, np.integer))
    if hint is float:
        return isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_has_type(v, args[0]) for v in value)
        return not args or (len(args) == len(value)
                            and all(_has_type(v, a) for v, a in zip(value, args)))
    if origin is not None:
        return isinstance(value, origin)
    return not isinstance(hint, type) or isinstance(value, hint)


def _type_text(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if hint is float:
        return "a finite number"
    if hint is int:
        return "an integer"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if typing.get_origin(hint) in (tuple, list):
        return f"a list ({hint})"
    return getattr(hint, "__name__", str(hint))


def check_hf_types(cls: type, values: dict[str, Any], *, what: str) -> None:
    """ValueError unless each config.json value in `values` (field name -> value) has the type
    `cls` annotates its field with (``float``: a finite JSON number, an int too; ``int``: an
    integer; ``bool``: true/false; ``tuple[int, ...]``: a list of them; ``X | None``: also null).
    The error names the field, the value, the expected type and the fix."""
    hints = _annotations(cls)
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None or _has_type(value, hint):
            continue
        fix = "correct it in config.json (is it the config.json of this checkpoint?)"
        if isinstance(value, str):
            try:
                number = json.loads(value)
            except ValueError:
                number = None
            if not isinstance(number, str) and _has_type(number, hint):
                fix = (f"write it without quotes, as a JSON {type(number).__name__}: "
                       f"\"{name}\": {value}")
        raise ValueError(f"{what}: config.json has {name}={value!r} ({type(value).__name__}), "
                         f"but {cls.__name__}.{name} must be {_type_text(hint)}; {fix}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Hyper-parameters every decoder family has (Hugging Face names) and zoo's own settings.

    Subclass as ``@dataclasses.dataclass(frozen=True, kw_only=True)``; set the class
    attributes ``hf_model_type``, ``hf_architecture`` and, if needed, ``hf_supported``
    (values config.json may hold for features zoo does not vary), ``hf_constants`` (fixed
    entries written to config.json), ``hf_aliases`` (alternative key -> field) and
    ``aux_loss_field`` (the field weighting ``aux["load_balance_loss"]``).
    """

    hf_model_type: ClassVar[str] = ""
    hf_architecture: ClassVar[str] = ""
    hf_supported: ClassVar[dict[str, tuple[Any, ...]]] = {"hidden_act": ("silu",)}
    hf_constants: ClassVar[dict[str, Any]] = {"hidden_act": "silu", "attention_dropout": 0.0}
    hf_aliases: ClassVar[dict[str, str]] = {}
    aux_loss_field: ClassVar[str | None] = None

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False  # True: no lm_head, logits through the embedding table
    # -- zoo-only fields (not in config.json) --------------------------------------------------
    attention_implementation: str = zoo_field("auto")  # zoo.ops.attention IMPLEMENTATIONS
    # how the data lays tokens on the context shards ("contiguous", "balanced", None: unknown);
    # the recipes set it from --load-balance, so the ring skips hops a sliding window can't see
    attention_layout: str | None = zoo_field(None)
    capacity_factor: float | None = zoo_field(None)  # None: dropless MoE
    moe_dispatch: str = zoo_field("auto")  # MoE(dispatch=): "all_to_all", "all_gather", "auto"
    # MoE(grouped_matmul=): blocked on CPU, XLA ragged dot on TPU, tokamax on GPU
    moe_grouped_matmul: str = zoo_field("auto")
    moe_buffer_factor: float | None = zoo_field(None)  # all_to_all receive buffers; None: dropless
    # MoE(overflow=): copies beyond the buffers "drop" or travel in further rounds ("exact");
    # "auto": drop with a buffer factor, dropless in rounds where they save (zoo.layers.moe)
    moe_overflow: str = zoo_field("auto")
    remat_policy: str | None = zoo_field(None)  # None or one of REMAT_POLICIES
    scan_layers: bool = zoo_field(True)  # runs of identical layers as one lax.scan
    # (a dtype is immutable: RUF009 cannot tell)
    dtype: Any = zoo_field(jnp.float32)  # noqa: RUF009 -- computation dtype
    param_dtype: Any = zoo_field(jnp.float32)  # noqa: RUF009 -- storage dtype
    # None/"off" or "blockwise": FP8 products in the dense linears (zoo.ops.fp8, docs/fp8.md)
    fp8: str | None = zoo_field(None)

    def __post_init__(self):
        what = type(self).__name__
        check_positive(self, ("vocab_size", "hidden_size", "intermediate_size",
                              "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                              "max_position_embeddings"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{what}: num_attention_heads={self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads={self.num_key_value_heads}")
        if not isinstance(self.tie_word_embeddings, (bool, np.bool_)):
            raise ValueError(f"{what}: tie_word_embeddings={self.tie_word_embeddings!r} must be "
                             f"True or False")
        if self.remat_policy is not None and self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"{what}: remat_policy={self.remat_policy!r} is not known; valid "
                             f"values are None or {', '.join(map(repr, REMAT_POLICIES))}")
        for name in ("dtype", "param_dtype"):
            try:
                dt = jnp.dtype(getattr(self, name))
            except TypeError as e:
                raise ValueError(f"{what}: {name}={getattr(self, name)!r} is not a dtype") from e
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"{what}: {name}={dt} must be a floating dtype (e.g. float32, "
                                 f"bfloat16)")
        if self.fp8 not in fp8_ops.MODES:
            raise ValueError(f"{what}: fp8={self.fp8!r} must be None or 'off' (no FP8) or "
                             f"'blockwise' (blockwise-scaled FP8 linears, docs/fp8.md)")
        if self.moe_overflow not in ("auto", "drop", "exact"):
            raise ValueError(f"{what}: moe_overflow={self.moe_overflow!r} must be 'drop' (copies "
                             f"beyond the all_to_all buffers are dropped), 'exact' (they "
                             f"travel in further rounds) or 'auto' (see zoo.layers.moe)")
        for name in ("capacity_factor", "moe_buffer_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{what}: {name}={value!r} must be > 0, or None for dropless "
                                 f"MoE")

    # -- what each family implements ---------------------------------------------------------
    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (``aux["expert_counts"]`` has this many columns)."""
        raise NotImplementedError(f"{type(self).__name__} must define num_experts")

    def for_counting(self):
        """This config with no MoE buffer factor: what an unsharded abstract model built only
        to count parameters or FLOPs uses (``Model.abstract(config.for_counting())``), so a
        mesh's MoE choice (``moe_buffer_factor``) meeting no mesh warns nothing. The
        parameters are the same."""
        return dataclasses.replace(self, moe_buffer_factor=None)

    def num_params(self) -> int:
        """Exact parameter count (``count_params(Model.abstract(self.for_counting()))``)."""
        raise NotImplementedError(f"{type(self).__name__} must define num_params")

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Training FLOPs per token at this sequence length (forward + backward)."""
        raise NotImplementedError(f"{type(self).__name__} must define flops_per_token")

    @property
    def aux_loss_weight(self) -> float:
        """The weight of ``aux["load_balance_loss"]`` in the loss (``aux_loss_field``)."""
        return float(getattr(self, self.aux_loss_field)) if self.aux_loss_field else 0.0

    # -- the zoo fields as layer arguments (a new zoo field reaches every family here) ---------
    def attention_options(self) -> dict[str, Any]:
        """Keyword arguments of `zoo.layers.Attention` / `MLA` taken from the zoo fields."""
        return dict(implementation=self.attention_implementation,
                    layout=self.attention_layout, dtype=self.dtype, param_dtype=self.param_dtype,
                    fp8=self.fp8)

    def moe_options(self) -> dict[str, Any]:
        """Keyword arguments of `zoo.layers.MoE` taken from the zoo fields."""
        return dict(capacity_factor=self.capacity_factor, dispatch=self.moe_dispatch,
                    grouped_matmul=self.moe_grouped_matmul, buffer_factor=self.moe_buffer_factor,
                    overflow=self.moe_overflow, dtype=self.dtype, param_dtype=self.param_dtype,
                    fp8=self.fp8)

    # -- Hugging Face config.json ---------------------------------------------------------------
    @classmethod
    def hf_fields(cls) -> list[dataclasses.Field]:
        """The fields copied to and from config.json as they are (not zoo-only, not rope)."""
        skip = zoo_only_fields(cls) | set(ROPE_FIELDS)
        return [f for f in dataclasses.fields(cls) if f.name not in skip]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **overrides):
        """A config from a parsed ``config.json`` (either rope spelling); `overrides` replace
        fields afterwards. Values outside ``hf_supported`` are refused with a clear error."""
        what = f"{cls.__name__}.from_hf_config"
        hf.check_fields(cfg, cls.hf_supported, what=what)
        cfg = {**{field: cfg[key] for key, field in cls.hf_aliases.items()
                  if cfg.get(field) is None and cfg.get(key) is not None}, **cfg}
        kwargs = {}
        for f in cls.hf_fields():
            if f.name in cfg and (cfg[f.name] is not None or f.metadata.get(NULLABLE)):
                kwargs[f.name] = cfg[f.name]
        check_hf_types(cls, kwargs, what=what)
        if cfg.get("num_key_value_heads") is None and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # as transformers
        names = {f.name for f in dataclasses.fields(cls)}
        default_theta = cls.__dataclass_fields__["rope_theta"].default
        kwargs["rope_theta"], scaling = hf.rope_from_hf(cfg, default_theta=default_theta,
                                                        what=what)
        if "rope_scaling" in names:
            kwargs["rope_scaling"] = scaling
        elif scaling is not None:
            raise ValueError(f"{what}: rope scaling {scaling} is not supported by "
                             f"{cls.__name__} (it has no rope_scaling field)")
        return cls(**{**kwargs, **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers' ``hf_architecture`` loads."""
        out = {f.name: getattr(self, f.name) for f in self.hf_fields()}
        out["rope_parameters"] = hf.rope_to_hf(self.rope_theta, getattr(self, "rope_scaling",
                                                                        None))
        out.update(self.hf_constants)
        out.update(architectures=[self.hf_architecture], model_type=self.hf_model_type,
                   dtype=dtype_name(self.param_dtype))
        return out
