"""`TrainConfig`: every training setting of a run, in one frozen dataclass.

The recipes' flags are generated from its fields (`add_flags`): ``--seq-len`` for ``seq_len``,
the field's ``help`` metadata as the flag's help, the recipe's value as its default, and values
parsed from the field's type (`parse_text`: ``int``, ``float``, ``bool`` as
``--x/--no-x``, ``X | None``, ``tuple[X, ...]``, ``Literal`` choices, `DTypeName`). ``run.json``
holds ``dataclasses.asdict`` of it. ``--set FIELD=VALUE`` (`apply_overrides`) parses a model
config field the same way, from that config's resolved field types.

A research recipe declares one::

    TRAIN = TrainConfig(steps=200, seq_len=256, lr=3e-3, aux_loss_field="aux_loss_alpha")
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, NewType

__all__ = ["TrainConfig", "DTypeName", "parse_text", "describe", "add_flags", "from_args",
           "flag_name", "apply_overrides", "config_to_json", "config_to_python"]

DTypeName = NewType("DTypeName", str)  # a dtype by name ("bfloat16"), checked by jnp.dtype
_NONE = ("none", "null")


def _field(default: Any, help: str, **meta: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run; `None` means "derive it" (each field says how)."""

    # -- length, batch, schedule, optimizer
    steps: int = _field(200, "planned total of updates (fixes the learning-rate schedule; on "
                             "resume, the new total)")
    batch_size: int = _field(8, "global batch (rows)")
    seq_len: int = _field(256, "tokens per row")
    lr: float = _field(3e-3, "peak learning rate")
    warmup: int | None = _field(None, "linear warmup steps (None: min(100, steps/10))")
    final_lr_fraction: float = _field(0.1, "the cosine decays to this fraction of --lr at "
                                           "--steps")
    weight_decay: float = _field(0.1, "AdamW decoupled weight decay (matrices only)")
    adam_b1: float = _field(0.9, "AdamW beta1")
    adam_b2: float = _field(0.95, "AdamW beta2")
    adam_eps: float = _field(1e-8, "AdamW epsilon")
    clip: float = _field(1.0, "clip the gradient to this global norm (<= 0: no clipping)")
    # -- MoE balancing
    aux_loss_field: str | None = _field(
        None, "model config field holding the load-balance loss weight (None: no aux loss "
              "unless --aux-loss-weight)")
    aux_loss_weight: float | None = _field(
        None, "weight of the MoE load-balance loss (None: the model config's --aux-loss-field)")
    expert_bias_rate: float = _field(
        0.0, "aux-loss-free balancing speed: bias += rate*sign(mean-count) after each step "
             "(DeepSeek-V3; 0: off)")
    seed: int = _field(0, "parameter init and data order")
    # -- parallelism and numerics
    strategy: Literal["fsdp", "cp", "ep_as_cp"] | None = _field(
        None, "partitioning strategy (None: ep_as_cp on CPU, fsdp on accelerators)")
    mesh: str | None = _field(
        None, "mesh axis sizes, any subset of data,fsdp,expert,context,tensor (the rest are 1), "
              "e.g. fsdp=2,expert=2,context=2 (None: that on 8 CPU devices, fsdp=<all> on "
              "accelerators)")
    attention: Literal["auto", "all_gather", "ring", "reference"] | None = _field(
        None, "attention implementation (None: the model config's)")
    dtype: DTypeName | None = _field(  # noqa: RUF009 (a dataclasses.Field, not a default)
        None, "computation dtype (None: bfloat16 on GPU/TPU and with --rehearse, the model "
              "config's on CPU)")
    param_dtype: DTypeName | None = _field(  # noqa: RUF009 (as dtype)
        None, "parameter dtype (None: the model config's)")
    remat: str | None = _field(
        None, "remat policy: none, full, dots_saveable, dots_with_no_batch_dims_saveable, "
              "save_layer_outputs, offload_layer_outputs (None: the model config's)")
    # -- data
    data: tuple[str, ...] | None = _field(
        None, "text files, globs or folders (None: the Python standard library's sources)")
    corpus_docs: Literal["file", "short"] = _field(
        "file", "documents of the corpus: whole files, or one per top-level function/class of "
                ".py files")
    load_balance: Literal["auto", "row", "document", "none"] = _field(
        "auto", "reorder each packed row for context parallelism: auto picks, per row, the "
                "permutation whose busiest shard computes the fewest attention tiles (zoo.data)",
        aliases={"--no-load-balance": "none"})
    tokenizer: str | None = _field(None, "a tokenizer.json (None: bytes)")
    from_hf: str | None = _field(
        None, "start from this Hugging Face checkpoint folder instead of random weights")
    # -- run dir, checkpoints, stopping
    run_dir: str | None = _field(None, "where checkpoints, metrics.jsonl and run.json go "
                                       "(None: runs/<recipe name>)")
    checkpoint_every: int = _field(100, "steps between checkpoints (one is also saved at the end "
                                        "and on SIGTERM/SIGINT)")
    max_to_keep: int = _field(3, "checkpoints kept (older ones are deleted)")
    divergence_factor: float = _field(
        5.0, "stop (exit 3) when the loss stays above this many times the best of the last 100 "
             "steps for 10 steps; inf: never")
    progress: bool = _field(True, "show a progress bar")
    rehearse: bool = _field(
        False, "compile the train step for --devices virtual devices and print per-device "
               "memory, FLOPs and collectives instead of training")
    # -- devices and processes
    devices: int | None = _field(
        None, "virtual CPU devices of this process (None: 8 unless JAX_NUM_CPU_DEVICES or "
              "XLA_FLAGS sets a count)")
    coordinator: str | None = _field(None, "process 0's address HOST:PORT (multi-process)")
    num_processes: int | None = _field(None, "processes in the job (multi-process)")
    process_id: int | None = _field(None, "this process, 0..N-1 (multi-process)")
    distributed: bool = _field(
        False, "call jax.distributed.initialize() with auto-detection (SLURM, Open MPI, "
               "Cloud TPU)")

    def __post_init__(self):
        from zoo.train import validate
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "max_to_keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_name(name)} {getattr(self, name)} must be >= 1")
        validate.check_positive("--lr", self.lr, "pass a peak learning rate such as 3e-3")
        validate.check_warmup(self.warmup, self.steps)
        if not self.divergence_factor > 1:  # also refuses nan
            raise ValueError(f"--divergence-factor {self.divergence_factor}: must be > 1 (e.g. "
                             f"the default 5; inf turns the divergence stop off)")
        if self.devices is not None and self.devices < 1:
            raise ValueError(f"--devices {self.devices}: must be >= 1")
        if self.data is not None and not isinstance(self.data, tuple):
            object.__setattr__(self, "data", tuple(self.data))  # JSON/argparse give lists


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


# -- values from text, by type ---------------------------------------------------------------

def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_dtype(value) -> bool:
    import numpy as np
    # numpy scalar types, and jax's (jnp.float32 is no np.generic but carries a .dtype)
    return isinstance(value, np.dtype) or (isinstance(value, type) and (
        issubclass(value, np.generic) or isinstance(getattr(value, "dtype", None), np.dtype)))


def describe(tp, current: Any = None) -> str:
    """What `parse_text` expects for `tp`, in words (for error messages)."""
    if _is_union(tp):
        parts = [describe(a, current) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts + (["none"] if type(None) in typing.get_args(tp) else []))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (tuple, list):
        item = (typing.get_args(tp) or (str,))[0]
        return f"comma-separated {describe(item)} values"
    if tp is DTypeName or (tp in (Any, object) and _is_dtype(current)):
        return "a dtype name (e.g. float32, bfloat16)"
    if tp is bool:
        return "true or false"
    if dataclasses.is_dataclass(tp):
        return f"a JSON object of {tp.__name__} fields"
    return getattr(tp, "__name__", str(tp))


def parse_text(tp, text: str, current: Any = None) -> Any:
    """`text` as a value of type `tp` (a resolved annotation); `current` (the field's present
    value) decides for ``Any`` fields. Raises `ValueError` naming what was expected."""
    text = text.strip()
    if _is_union(tp):
        members = typing.get_args(tp)
        if type(None) in members and text.lower() in _NONE:
            return None
        # the narrow types first, so "3" is an int in `int | str` and "1.5" a float
        order = sorted((m for m in members if m is not type(None)), key=lambda m: m is str)
        for member in order:
            try:
                return parse_text(member, text, current)
            except ValueError:
                continue
        raise ValueError(f"expected {describe(tp, current)}")
    origin = typing.get_origin(tp)
    if origin is Literal:
        for choice in typing.get_args(tp):
            if str(choice) == text:
                return choice
        raise ValueError(f"expected {describe(tp)}")
    if origin in (tuple, list):
        args = typing.get_args(tp)
        items = json.loads(text) if text.startswith("[") else [t for t in text.split(",") if t]
        if (len(args) == 2 and args[1] is Ellipsis) or len(args) <= 1:
            item = args[0] if args else str
            values = [parse_text(item, str(v)) for v in items]
        elif len(args) == len(items):
            values = [parse_text(a, str(v)) for a, v in zip(args, items)]
        else:
            raise ValueError(f"expected {len(args)} comma-separated values")
        return origin(values)
    if tp in (Any, object):
        return _parse_untyped(text, current)
    if tp is DTypeName:
        import numpy as np
        return DTypeName(np.dtype(_jnp_dtype(text)).name)
    if tp is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError("expected true or false")
    if tp in (int, float, str):
        try:
            return tp(text)
        except ValueError:
            raise ValueError(f"expected {tp.__name__}") from None
    if dataclasses.is_dataclass(tp) or tp is dict:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            raise ValueError(f"expected {describe(tp)}, e.g. '{{\"factor\": 2.0}}'")
        try:
            return obj if tp is dict else tp(**obj)
        except TypeError as e:
            raise ValueError(f"expected {describe(tp)} ({e})") from None
    raise ValueError(f"cannot parse a {describe(tp)} from text")


def _jnp_dtype(text: str):
    import jax.numpy as jnp
    try:
        return jnp.dtype(text)
    except TypeError:
        raise ValueError("expected a dtype name (e.g. float32, bfloat16)") from None


def _parse_untyped(text: str, current: Any) -> Any:
    """An ``Any`` field: a dtype if it holds one, else the type of its current value."""
    if text.lower() in _NONE:
        return None
    if _is_dtype(current):
        return _jnp_dtype(text).type
    if current is not None and type(current) in (bool, int, float, str):
        return parse_text(type(current), text)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# -- flags -------------------------------------------------------------------------------------

def _arg_type(name: str, tp):
    def parse(text: str):
        try:
            return parse_text(tp, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid for TrainConfig.{name}: {e}") from None
    parse.__name__ = describe(tp)
    return parse


def add_flags(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """One flag per `TrainConfig` field, its default taken from `defaults`."""
    hints = typing.get_type_hints(TrainConfig)
    group = parser.add_argument_group("training (zoo.train.TrainConfig fields)")
    for f in dataclasses.fields(TrainConfig):
        tp, default = hints[f.name], getattr(defaults, f.name)
        inner = [a for a in typing.get_args(tp) if a is not type(None)] if _is_union(tp) else [tp]
        kw: dict[str, Any] = dict(default=default, help=f.metadata["help"], dest=f.name)
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif len(inner) == 1 and typing.get_origin(inner[0]) in (tuple, list):
            item = (typing.get_args(inner[0]) or (str,))[0]
            kw.update(nargs="*", type=_arg_type(f.name, item), metavar=describe(item).upper())
        else:
            kw["type"] = _arg_type(f.name, tp)
            if len(inner) == 1 and typing.get_origin(inner[0]) is Literal:
                kw["metavar"] = "{" + ",".join(map(str, typing.get_args(inner[0]))) + "}"
        group.add_argument(flag_name(f.name), **kw)
        for alias, value in f.metadata.get("aliases", {}).items():
            group.add_argument(alias, dest=f.name, action="store_const", const=value,
                               help=f"same as {flag_name(f.name)} {value}")


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of parsed flags (`add_flags`); raises `ValueError` on bad values."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


# -- model configs -----------------------------------------------------------------------------

def apply_overrides(config: Any, overrides: Sequence[str]) -> Any:
    """``["field=value", ...]`` -> a new config, each value parsed from the field's resolved
    type (`parse_text`); unknown fields and bad values raise naming the field and the fix."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    hints = typing.get_type_hints(type(config))
    changes = {}
    for item in overrides:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--set {item!r}: write FIELD=VALUE, e.g. --set hidden_size=256")
        if name not in fields:
            raise ValueError(f"--set {item!r}: {type(config).__name__} has no field {name!r}; "
                             f"valid fields: {', '.join(fields)}")
        tp, current = hints.get(name, Any), getattr(config, name)
        try:
            changes[name] = parse_text(tp, text, current)
        except ValueError as e:  # json.JSONDecodeError included
            raise ValueError(f"--set {name}={text.strip()}: {e} (the field "
                             f"{type(config).__name__}.{name} is {describe(tp, current)})"
                             ) from None
    return dataclasses.replace(config, **changes) if changes else config


def config_to_json(config: Any) -> dict[str, Any]:
    """A config dataclass as JSON-able values (dtypes by name, nested dataclasses as dicts)."""
    def convert(value):
        if _is_dtype(value):
            import numpy as np
            return np.dtype(value).name
        if dataclasses.is_dataclass(value):
            return {f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (tuple, list)):
            return [convert(v) for v in value]
        return value

    return {f.name: convert(getattr(config, f.name)) for f in dataclasses.fields(config)}


def config_to_python(config: Any) -> dict[str, Any]:
    """Config fields as a dict for ``config_overrides`` (keeps dtypes and nested dataclasses)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
