"""`TrainConfig`: every setting of a training run, in sections that validate themselves.

The sections (frozen dataclasses, one default per setting):

* `ModelSection` ``model`` -- family, preset, config overrides, a Hugging Face start, MoE
  balancing (aux-loss weight, expert-bias rate);
* `OptimizerSection` ``optimizer`` -- AdamW and clipping;
* `ScheduleSection` ``schedule`` -- peak rate, warmup, final fraction;
* `ParallelismSection` ``parallelism`` -- strategy, mesh, devices and processes;
* `DataSection` ``data`` -- files, documents, the held-out share, load balance, tokenizer, batch
  and length;
* `EvalSection` ``eval`` -- how often and on how many held-out batches the loss is evaluated;
* `CheckpointSection` ``checkpoint`` -- run dir, interval, rotation;
* `RunSection` ``run`` -- steps, seed, divergence stop, progress bar, loggers, rehearsal.

Every setting has a unique name across sections, so a config is also built and read flat::

    TrainConfig(family="deepseek3", preset="mini", steps=200, lr=3e-3)
    config.lr == config.schedule.lr

The recipes' flags are generated from the fields (`add_flags`): ``--seq-len`` for ``seq_len``
(also spelt ``--data.seq-len``), the field's ``help`` as the flag's help, the recipe's value as
its default, values parsed from the field's type (`zoo.train.fields.parse_text`). ``run.json``
holds ``dataclasses.asdict`` of it (section by section).

One place per setting: a model setting lives in the model config (`zoo.models.DecoderConfig`)
and nowhere here. ``--set FIELD=VALUE`` sets any of its fields; the flags of `MODEL_FLAGS`
(``--attention``, ``--dtype``, ``--param-dtype``, ``--remat``) are spellings of ``--set`` for
the fields set most often: ``--dtype bfloat16`` adds ``dtype=bfloat16`` to ``overrides``. A
flag and a ``--set`` of the same field with different values are refused, naming both. In
code, ``TrainConfig(overrides=["dtype=bfloat16"])``; ``TrainConfig(dtype=...)`` is a
`TypeError` saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any, ClassVar, Literal

from zoo.train.fields import (DTypeName, apply_overrides, config_to_json, config_to_python,
                              describe, is_union, parse_text)

__all__ = ["TrainConfig", "ModelSection", "OptimizerSection", "ScheduleSection",
           "ParallelismSection", "DataSection", "EvalSection", "CheckpointSection",
           "RunSection", "SECTIONS", "MODEL_FLAGS", "ModelFlag",
           "DTypeName", "parse_text", "describe", "add_flags", "from_args", "flag_name",
           "apply_overrides", "config_to_json", "config_to_python"]


def _field(default: Any, help: str, **meta: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _check(ok: bool, name: str, value: Any, rule: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"{flag_name(name)} {value}: {rule}; {fix}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _at_least_one(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _check(isinstance(value, int) and value >= 1, name, value, "must be an integer >= 1",
               "pass a positive count")


class ModelFlag(typing.NamedTuple):
    """A flag that spells ``--set FIELD=VALUE`` for one model config field."""

    field: str      # the model config field (zoo.models.DecoderConfig)
    type: Any       # the value's type, checked when the flag is parsed
    help: str


# The model settings with a flag of their own. They are model config fields, set only there:
# ``--dtype X`` is ``--set dtype=X`` (a TrainConfig keeps them in ``overrides``).
MODEL_FLAGS: dict[str, ModelFlag] = {
    "attention": ModelFlag(
        "attention_implementation", Literal["auto", "all_gather", "ring", "reference"],
        "attention implementation: --set attention_implementation=VALUE (default: the model "
        "config's)"),
    "dtype": ModelFlag(
        "dtype", DTypeName,
        "computation dtype: --set dtype=VALUE (default: bfloat16 on GPU/TPU and with "
        "--rehearse, the model config's on CPU)"),
    "param_dtype": ModelFlag(
        "param_dtype", DTypeName, "parameter dtype: --set param_dtype=VALUE (default: the "
        "model config's)"),
    "remat": ModelFlag(
        "remat_policy", str,
        "remat policy: --set remat_policy=VALUE; none, full, dots_saveable, "
        "dots_with_no_batch_dims_saveable, save_layer_outputs, offload_layer_outputs "
        "(default: the model config's)"),
}


def _text(value: Any) -> str:
    """A value as ``--set`` text (dtypes by name)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return "none" if value is None else str(value)
    import numpy as np
    try:
        return np.dtype(value).name
    except TypeError:
        return str(value)


def _refuse_model_settings(settings: dict[str, Any], where: str) -> None:
    """`TypeError` when `settings` name a model setting (`MODEL_FLAGS`): it lives in the model
    config, so the message gives the ``overrides`` item that sets it."""
    moved = [name for name in MODEL_FLAGS if name in settings]
    if not moved:
        return
    items = [f"{MODEL_FLAGS[n].field}={_text(settings[n])}" for n in moved]
    flags = " or ".join(f"{flag_name(n)} {_text(settings[n])}" for n in moved)
    raise TypeError(
        f"{where} got {', '.join(f'{n}=' for n in moved)}: a model setting lives in the model "
        f"config (zoo.models.DecoderConfig), not in the training config; pass "
        f"overrides={items!r} instead (on the command line: {flags}, or --set "
        f"{' --set '.join(items)})")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model: a registered family's preset, with overrides."""

    family: str | None = _field(None, "model family (zoo.models.registry: deepseek3, mixtral, "
                                      "qwen3_moe, ...; None: the recipe's)")
    preset: str | None = _field(None, "preset of the family, e.g. mini (None: the recipe's)")
    overrides: tuple[str, ...] = _field(
        (), "model config fields FIELD=VALUE, e.g. hidden_size=256 (repeatable)", flag="--set")
    from_hf: str | None = _field(
        None, "start from this Hugging Face checkpoint folder instead of random weights")
    aux_loss_field: str | None = _field(
        None, "model config field holding the load-balance loss weight (None: the family's)")
    aux_loss_weight: float | None = _field(
        None, "weight of the MoE load-balance loss (None: the model config's aux-loss field)")
    expert_bias_rate: float = _field(
        1e-3, "aux-loss-free balancing speed: bias += rate*sign(mean-count) after each step "
              "(DeepSeek-V3's 1e-3; models without a selection bias ignore it; 0: off)")

    def __post_init__(self):
        object.__setattr__(self, "overrides", tuple(self.overrides))
        for item in self.overrides:
            _check(isinstance(item, str) and "=" in item, "set", item, "write FIELD=VALUE",
                   "e.g. --set hidden_size=256")
        if self.aux_loss_weight is not None:
            _check(_finite(self.aux_loss_weight) and self.aux_loss_weight >= 0,
                   "aux_loss_weight", self.aux_loss_weight, "must be a finite number >= 0",
                   "e.g. 1e-4, or leave it out for the model config's weight")
        _check(_finite(self.expert_bias_rate) and self.expert_bias_rate >= 0,
               "expert_bias_rate", self.expert_bias_rate, "must be a finite number >= 0",
               "e.g. 1e-3 (0 turns the bias update off)")


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """AdamW (decoupled weight decay on matrices) after global-norm clipping."""

    weight_decay: float = _field(0.1, "AdamW decoupled weight decay (matrices only)")
    adam_b1: float = _field(0.9, "AdamW beta1, in [0, 1)")
    adam_b2: float = _field(0.95, "AdamW beta2, in [0, 1)")
    adam_eps: float = _field(1e-8, "AdamW epsilon, > 0")
    clip: float = _field(1.0, "clip the gradient to this global norm (<= 0: no clipping)")

    def __post_init__(self):
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay",
               self.weight_decay, "must be a finite number >= 0", "e.g. 0.1 (0: no decay)")
        for name in ("adam_b1", "adam_b2"):
            value = getattr(self, name)
            _check(_finite(value) and 0 <= value < 1, name, value, "must be in [0, 1)",
                   "e.g. 0.9 for --adam-b1, 0.95 for --adam-b2")
        _check(_finite(self.adam_eps) and self.adam_eps > 0, "adam_eps", self.adam_eps,
               "must be a finite number > 0", "e.g. 1e-8")
        _check(isinstance(self.clip, (int, float)) and not math.isnan(self.clip), "clip",
               self.clip, "must be a number", "e.g. 1.0, or 0 for no clipping")


@dataclasses.dataclass(frozen=True)
class ScheduleSection:
    """Linear warmup to ``lr``, then a cosine to ``final_lr_fraction * lr`` at ``steps``."""

    lr: float = _field(3e-3, "peak learning rate")
    warmup: int | None = _field(None, "linear warmup steps (None: min(100, steps/10))")
    final_lr_fraction: float = _field(0.1, "the cosine decays to this fraction of --lr at "
                                           "--steps, in [0, 1]")

    def __post_init__(self):
        _check(_finite(self.lr) and self.lr > 0, "lr", self.lr, "must be a finite number > 0",
               "pass a peak learning rate such as 3e-3")
        if self.warmup is not None:
            _check(isinstance(self.warmup, int) and self.warmup >= 0, "warmup", self.warmup,
                   "must be an integer >= 0", "or leave it out: min(100, steps/10)")
        _check(_finite(self.final_lr_fraction) and 0 <= self.final_lr_fraction <= 1,
               "final_lr_fraction", self.final_lr_fraction, "must be in [0, 1]",
               "e.g. 0.1 (1: constant after warmup)")


@dataclasses.dataclass(frozen=True)
class ParallelismSection:
    """How the mesh cuts the model, on which devices and processes."""

    def __new__(cls, *args: Any, **settings: Any):
        _refuse_model_settings(settings, "ParallelismSection")
        return super().__new__(cls)

    strategy: Literal["fsdp", "cp", "ep_as_cp"] | None = _field(
        None, "partitioning strategy (None: ep_as_cp on CPU, fsdp on accelerators)")
    mesh: str | None = _field(
        None, "mesh axis sizes, any subset of data,fsdp,expert,context,tensor (the rest are 1), "
              "e.g. fsdp=2,expert=2,context=2 (None: that on 8 CPU devices, fsdp=<all> on "
              "accelerators)")
    devices: int | None = _field(
        None, "virtual CPU devices of this process (None: 8 unless JAX_NUM_CPU_DEVICES or "
              "XLA_FLAGS sets a count)")
    coordinator: str | None = _field(None, "process 0's address HOST:PORT (multi-process)")
    num_processes: int | None = _field(None, "processes in the job (multi-process)")
    process_id: int | None = _field(None, "this process, 0..N-1 (multi-process)")
    distributed: bool = _field(
        False, "call jax.distributed.initialize() with auto-detection (SLURM, Open MPI, "
               "Cloud TPU)")
    peer_timeout: float = _field(
        100.0, "seconds a process waits for a peer that does not join, or has stopped "
               "answering, before it stops with a message naming it (exit 6)")

    def __post_init__(self):
        if self.devices is not None:
            _at_least_one(self, "devices")
        _check(_finite(self.peer_timeout) and self.peer_timeout > 0, "peer_timeout",
               self.peer_timeout, "must be a finite number of seconds > 0", "e.g. 100")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The Grain pipeline: files, documents, load balance, tokenizer and the global batch."""

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
    validation_fraction: float = _field(
        0.02, "share of the documents held out for evaluation, chosen by a hash of each "
              "document's text and never trained on (zoo.data.split); 0: none")
    batch_size: int = _field(8, "global batch (rows)")
    seq_len: int = _field(256, "tokens per row")
    data_timeout: float = _field(
        300.0, "seconds a step may wait for its batch before the run stops cleanly (exit 4)")
    data_changed: Literal["refuse", "restart"] = _field(
        "refuse", "resuming a run dir whose checkpoint read other data (files, tokenizer, ...): "
                  "refuse (exit 2), or restart: weights and optimizer restored, the data stream "
                  "started afresh on the new files (recorded in run.json)")

    def __post_init__(self):
        _check(isinstance(self.data_timeout, (int, float)) and self.data_timeout > 0,
               "data_timeout", self.data_timeout, "must be a number of seconds > 0",
               "e.g. 300")
        if self.data is not None:
            object.__setattr__(self, "data", tuple(self.data))  # JSON/argparse give lists
            _check(len(self.data) > 0, "data", "(no paths)", "needs at least one file, glob "
                   "or folder", "name the text, or leave --data out for the built-in corpus")
        _at_least_one(self, "batch_size", "seq_len")
        _check(_finite(self.validation_fraction) and 0 <= self.validation_fraction < 1,
               "validation_fraction", self.validation_fraction, "must be in [0, 1)",
               "e.g. 0.02 (0: no documents held out)")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """The held-out loss during training (`zoo.train.evaluation.Evaluate`)."""

    eval_every: int = _field(0, "steps between evaluations of the held-out loss and perplexity "
                                "(also at the last planned step; 0: none)")
    eval_batches: int = _field(4, "batches of the held-out split each evaluation reads (fewer "
                                  "when the split is smaller)")

    def __post_init__(self):
        _check(isinstance(self.eval_every, int) and not isinstance(self.eval_every, bool)
               and self.eval_every >= 0, "eval_every", self.eval_every,
               "must be an integer >= 0", "e.g. 50 (0: no evaluation)")
        _at_least_one(self, "eval_batches")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Where the run lives and how often it is saved."""

    run_dir: str | None = _field(None, "where checkpoints, metrics.jsonl and run.json go "
                                       "(None: runs/<recipe name>)")
    checkpoint_every: int = _field(100, "steps between checkpoints (one is also saved at the end "
                                        "and on SIGTERM/SIGINT)")
    max_to_keep: int = _field(3, "checkpoints kept (older ones are deleted)")

    def __post_init__(self):
        _at_least_one(self, "checkpoint_every", "max_to_keep")


@dataclasses.dataclass(frozen=True)
class RunSection:
    """How long, from which seed, what stops it, and what it reports."""

    steps: int = _field(200, "planned total of updates (fixes the learning-rate schedule; on "
                             "resume, the new total)")
    seed: int = _field(0, "parameter init and data order")
    divergence_factor: float = _field(
        5.0, "stop (exit 3) when the loss stays above this many times the best of the last 100 "
             "steps for 10 steps; inf: never")
    progress: bool = _field(True, "show a progress bar")
    tensorboard: bool = _field(True, "write TensorBoard event files to the run dir")
    wandb: str | None = _field(None, "log to this Weights & Biases project (needs wandb)")
    sample_tokens: int = _field(
        48, "at the end of a run, print this many greedy tokens after --sample-prompt (0: no "
            "sample)")
    sample_prompt: str = _field("def", "the prompt of the end-of-run sample")
    rehearse: bool = _field(
        False, "compile the train step for --devices virtual devices and print per-device "
               "memory, FLOPs and collectives instead of training")
    target: str = _field(
        "cpu", "with --rehearse: the devices to compile for, 'cpu', a TPU slice such as "
               "tpu-v5p-8 or tpu:v5p:2x2x2, or GPUs such as h100-16 (the TPU and GPU "
               "compilers run here; they need libtpu / jax-cuda12-plugin)")

    def __post_init__(self):
        _at_least_one(self, "steps")
        from zoo.targets import parse
        try:
            parse(self.target)
        except ValueError as e:
            raise ValueError(str(e).replace("target=", "--target ", 1)) from None
        _check(self.target == "cpu" or self.rehearse, "target", self.target,
               "compiles without training, so it needs --rehearse",
               "add --rehearse (or drop --target to train here)")
        _check(isinstance(self.seed, int), "seed", self.seed, "must be an integer", "e.g. 0")
        _check(isinstance(self.sample_tokens, int) and self.sample_tokens >= 0, "sample_tokens",
               self.sample_tokens, "must be an integer >= 0", "e.g. 48, or 0 for no sample")
        _check(isinstance(self.divergence_factor, (int, float))
               and self.divergence_factor > 1, "divergence_factor", self.divergence_factor,
               "must be > 1", "e.g. the default 5; inf turns the divergence stop off")


SECTIONS: dict[str, type] = {"model": ModelSection, "optimizer": OptimizerSection,
                             "schedule": ScheduleSection, "parallelism": ParallelismSection,
                             "data": DataSection, "eval": EvalSection,
                             "checkpoint": CheckpointSection, "run": RunSection}
# flat setting name -> its section
_SECTION_OF = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True, init=False)
class TrainConfig:
    """Every setting of a training run, in sections (see the module docstring).

    ``TrainConfig(steps=20, lr=3e-3)`` sets settings by their flat names;
    ``TrainConfig(optimizer=OptimizerSection(...))`` (or a dict of its fields) sets a section;
    both may be mixed (a flat name wins over its section). ``config.lr`` reads flat.
    """

    model: ModelSection
    optimizer: OptimizerSection
    schedule: ScheduleSection
    parallelism: ParallelismSection
    data: DataSection
    eval: EvalSection
    checkpoint: CheckpointSection
    run: RunSection

    _flat_names: ClassVar[frozenset[str]] = frozenset(_SECTION_OF)

    def __init__(self, **settings: Any):
        # ``data`` names both a section and its file list: a mapping or a DataSection is the
        # section, anything else (None, paths) the setting
        if "data" in settings and not isinstance(settings["data"], (dict, DataSection)):
            settings = dict(settings)
            settings["data_files"] = settings.pop("data")
        _refuse_model_settings(settings, "TrainConfig")
        unknown = set(settings) - set(SECTIONS) - self._flat_names - {"data_files"}
        if unknown:
            raise TypeError(f"TrainConfig got unknown settings {sorted(unknown)}; valid: the "
                            f"sections {', '.join(SECTIONS)} or any of their fields")
        for name, cls in SECTIONS.items():
            given = settings.get(name)
            flat = {k: v for k, v in settings.items()
                    if _SECTION_OF.get(k) == name and k not in SECTIONS}
            if name == "data" and "data_files" in settings:
                flat["data"] = settings["data_files"]
            if isinstance(given, cls):
                section = dataclasses.replace(given, **flat) if flat else given
            else:
                section = cls(**{**dict(given or {}), **flat})
            object.__setattr__(self, name, section)
        warmup, steps = self.schedule.warmup, self.run.steps
        _check(warmup is None or warmup <= steps, "warmup", warmup,
               f"must be in [0, --steps {steps}]", "lower --warmup or raise --steps (or leave "
               "--warmup out: min(100, steps/10))")
        _check(not self.eval.eval_every or self.data.validation_fraction > 0, "eval_every",
               self.eval.eval_every, "evaluates held-out documents, but --validation-fraction "
               "is 0", "pass --validation-fraction 0.02, or leave --eval-every out")

    def __getattr__(self, name: str) -> Any:
        if name == "data_files":
            return self.data.data
        section = _SECTION_OF.get(name)
        if section is None and name in MODEL_FLAGS:
            field = MODEL_FLAGS[name].field
            raise AttributeError(f"TrainConfig has no setting {name!r}: it is the model "
                                 f"config's field {field!r} (read it from the built model "
                                 f"config, e.g. zoo.train.build(config).model_config.{field}; "
                                 f"set it with overrides=[\"{field}=...\"])")
        if section is None:
            raise AttributeError(f"TrainConfig has no setting {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def replace(self, **settings: Any) -> TrainConfig:
        """A copy with settings changed by flat or section name."""
        merged = self.sections()
        if "data" in settings and not isinstance(settings["data"], (dict, DataSection)):
            settings = dict(settings)
            merged["data"] = dataclasses.replace(merged["data"], data=settings.pop("data"))
        return TrainConfig(**merged, **settings)

    def sections(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SECTIONS}

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        return {f.name: getattr(getattr(self, s), f.name)
                for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


# -- flags -------------------------------------------------------------------------------------

def _arg_type(name: str, tp, what: str = "TrainConfig."):
    def parse(text: str):
        try:
            return parse_text(tp, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid for {what}{name}: {e}") from None
    parse.__name__ = describe(tp)
    return parse


def _flag_kwargs(f: dataclasses.Field, tp, default: Any) -> dict[str, Any]:
    inner = [a for a in typing.get_args(tp) if a is not type(None)] if is_union(tp) else [tp]
    kw: dict[str, Any] = dict(default=default, help=f.metadata["help"], dest=f.name)
    if tp is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif "flag" in f.metadata:  # --set: repeatable, added to the recipe's own
        kw.update(action=_SetModelField, default=list(default), metavar="FIELD=VALUE")
    elif len(inner) == 1 and typing.get_origin(inner[0]) in (tuple, list):
        item = (typing.get_args(inner[0]) or (str,))[0]
        kw.update(nargs="*", type=_arg_type(f.name, item), metavar=describe(item).upper())
    else:
        kw["type"] = _arg_type(f.name, tp)
        if len(inner) == 1 and typing.get_origin(inner[0]) is Literal:
            kw["metavar"] = "{" + ",".join(map(str, typing.get_args(inner[0]))) + "}"
    return kw


def add_flags(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """One flag per setting, grouped by section, its default taken from `defaults`: the flat
    spelling (``--weight-decay``) and the sectioned one (``--optimizer.weight-decay``)."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        group = parser.add_argument_group(f"{section} (TrainConfig.{section})", doc)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            names = [f.metadata.get("flag", flag_name(f.name)),
                     f"--{section}.{f.name.replace('_', '-')}"]
            group.add_argument(*names, **_flag_kwargs(f, hints[f.name], default))
            for alias, value in f.metadata.get("aliases", {}).items():
                group.add_argument(alias, dest=f.name, action="store_const", const=value,
                                   help=f"same as {flag_name(f.name)} {value}")
        if section == "model":
            for name, spec in MODEL_FLAGS.items():
                choices = typing.get_args(spec.type) if typing.get_origin(
                    spec.type) is Literal else ()
                group.add_argument(
                    flag_name(name), dest="overrides", const=spec.field, action=_SetModelField,
                    default=argparse.SUPPRESS, help=spec.help,
                    type=_arg_type(spec.field, spec.type, "the model config's "),
                    metavar="{" + ",".join(choices) + "}" if choices else name.upper())


class _SetModelField(argparse.Action):
    """``--set FIELD=VALUE`` (``const`` None) and the `MODEL_FLAGS` (``const`` the field):
    each appends ``FIELD=VALUE`` to ``overrides``, after the recipe's own. A flag and a
    ``--set`` giving one field different values are refused, naming both."""

    def __call__(self, parser, namespace, values, option_string=None):
        is_set = self.const is None
        if is_set:
            name, _, text = values.partition("=")
            field, text, spelling = name.strip(), text.strip(), f"--set {values}"
        else:
            field, text, spelling = self.const, str(values), f"{option_string} {values}"
        # what this command line gave each field: field -> (spelling, text, by --set)
        given = namespace.__dict__.setdefault("given_model_fields", {})
        earlier = given.get(field)
        if (earlier is not None and earlier[2] != is_set
                and _normal(field, earlier[1]) != _normal(field, text)):
            flag = (earlier[0] if is_set else spelling).split()[0]
            parser.error(f"{earlier[0]} and {spelling} both set the model config's {field}; "
                         f"pass one of them ({flag} X is the same as --set {field}=X)")
        given[field] = (spelling, text, is_set)
        item = values if is_set else f"{field}={text}"
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or ()), item])


def _normal(field: str, text: str) -> str:
    """`text` as a value of a model field, for comparing two spellings (dtypes by name)."""
    if field in ("dtype", "param_dtype"):
        try:
            return parse_text(DTypeName, text)
        except ValueError:
            pass
    return text.strip().lower()


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of parsed flags (`add_flags`); raises `ValueError` on bad values."""
    return TrainConfig(**{name: getattr(args, name) for name in _SECTION_OF})
