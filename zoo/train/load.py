"""`load(run_dir)`: a finished (or interrupted) run's model, outside training, on any mesh.

The checkpoint's own record (the settings, the family and the resolved model config that
`zoo.train.build` wrote beside the arrays) rebuilds the model; its arrays are restored straight
onto the shardings of the mesh asked for -- the run's own mesh when this process has as many
devices, else FSDP over the devices there are (or ``mesh=``/``strategy=``). The model and
decoder layer classes are the ones the run trained with: the record names them as importable
``module:QualName`` paths; one that cannot be imported (a class defined in the training
script's ``__main__``) is an error naming it and how to pass it, never a silent base class.

The run dir is only read (`Checkpointer` with ``read_only=True``), so it is safe beside a
live trainer: nothing is created, cleaned up or moved. The newest checkpoint whose files match
their digest record is used; a corrupt one is skipped with a warning naming it (see
`zoo.train.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from zoo.models import registry
from zoo.train.build import Built, build
from zoo.train.checkpoint import Checkpointer
from zoo.train.config import MODEL_FLAGS, TrainConfig
from zoo.train.fields import config_from_json

__all__ = ["Loaded", "load", "import_class", "add_class_flags", "classes_from_flags",
           "saved_train_config"]


@dataclasses.dataclass
class Loaded:
    model: Any                 # the trained model, sharded on `built.partitioner`'s mesh
    optimizer: Any             # its optimizer state (None when the run used a custom tx and
    #                            none was passed)
    step: int                  # updates the checkpoint holds
    config: TrainConfig        # the run's settings (mesh/strategy as loaded here)
    model_config: Any
    data_state: Any            # this process's data-iterator state at that step
    built: Built               # what the model was rebuilt with (partitioner, train_step, ...)


def _family(record: dict[str, Any]) -> registry.Family:
    if record.get("family"):
        return registry.get(record["family"])
    for family in registry.families():  # a record from before families were named
        if family.model_cls.__qualname__ == (record.get("model_cls") or "").split(":")[-1]:
            return family
    raise ValueError(f"load: the checkpoint names no registered family (model class "
                     f"{record.get('model_cls')!r}); pass the class ({_HOW_TO_PASS['model_cls']})")


_HOW_TO_PASS = {"model_cls": "model_cls= in Python, --model-cls module:Class on python -m "
                             "zoo.generate / zoo.evaluate",
                "decoder_layer_cls": "decoder_layer_cls= in Python, --decoder-layer-cls "
                                     "module:Class on python -m zoo.generate / zoo.evaluate"}


def import_class(path: str, what: str) -> type:
    """The class a ``module:QualName`` path names (`zoo.train.build.class_path`); a
    `ValueError` beginning with `what` when it cannot be imported."""
    import importlib
    module, _, qualname = path.partition(":")
    if not module or not qualname:
        raise ValueError(f"{what} {path}: not a module:Class path; write e.g. "
                         f"my_research.layers:TemperedLayer")
    if module == "__main__" or "<locals>" in qualname:
        where = "the script that trained it (__main__)" if module == "__main__" else \
            "a function's body"
        raise ValueError(f"{what} {path}: the class was defined in {where}, so it cannot be "
                         f"imported here")
    try:
        obj = importlib.import_module(module)
        for name in qualname.split("."):
            obj = getattr(obj, name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {path}: cannot be imported ({type(e).__name__}: {e})") from None
    if not isinstance(obj, type):
        raise ValueError(f"{what} {path}: names a {type(obj).__name__}, not a class")
    return obj


def add_class_flags(parser) -> None:
    """``--model-cls``/``--decoder-layer-cls MODULE:CLASS`` on a command line that loads a run
    (``python -m zoo.generate``, ``python -m zoo.evaluate``); see `classes_from_flags`."""
    for name, what in (("model_cls", "model"), ("decoder_layer_cls", "decoder layer")):
        parser.add_argument("--" + name.replace("_", "-"), metavar="MODULE:CLASS", default=None,
                            help=f"the {what} class the run trained with, when run.json's "
                                 f"{name} cannot be imported (default: that one)")


def classes_from_flags(args) -> dict[str, type]:
    """The classes `add_class_flags`' flags name, imported, as `load`'s keywords."""
    return {name: import_class(path, "--" + name.replace("_", "-"))
            for name in ("model_cls", "decoder_layer_cls")
            if (path := getattr(args, name, None)) is not None}


def _trained_class(record: dict[str, Any], field: str, family: registry.Family,
                   given: type | None) -> type | None:
    """The class `field` of the record (``model_cls``/``decoder_layer_cls``) as trained: the
    one given, else the recorded path imported (None: the family's own)."""
    from zoo.train.build import class_path
    recorded = record.get(field)
    default = family.model_cls if field == "model_cls" else None
    if given is not None:
        if recorded and class_path(given) != recorded and ":" in recorded:
            import warnings
            warnings.warn(f"load: the run was trained with {field} {recorded}; loading with "
                          f"{class_path(given)} as asked", stacklevel=3)
        return given
    if not recorded or recorded in (class_path(default), getattr(default, "__qualname__", 0)):
        return None
    if ":" not in recorded:
        reason = f"{field} {recorded}: recorded by name only, so it cannot be imported"
    else:
        try:
            return import_class(recorded, field)
        except ValueError as e:
            reason = str(e)
    raise ValueError(f"load: the run was trained with a {field} of its own, and {reason}. "
                     f"Pass the class ({_HOW_TO_PASS[field]}); loading without it would give "
                     f"another model than the one trained")


def load(run_dir: str | os.PathLike, *, step: int | None = None,
         devices: Sequence[Any] | None = None, mesh: str | None = None,
         strategy: str | None = None, batch_size: int | None = None,
         seq_len: int | None = None, tx: Any = None, model_cls: type | None = None,
         decoder_layer_cls: type | None = None) -> Loaded:
    """The model (and optimizer, data state) of `run_dir`'s newest checkpoint, or of `step`.

    Args:
      devices, mesh, strategy: where to put it (default: see the module docstring).
      batch_size, seq_len: the inputs shape the model is built for (default the run's).
      tx: the optax transformation of a run trained with a custom one (else the model comes
        back without optimizer state).
      model_cls, decoder_layer_cls: the classes of a run trained with subclasses (default:
        those its record names, imported by their ``module:QualName``; a `ValueError` names
        one that cannot be imported, e.g. a class defined in a script's ``__main__``).
    """
    import jax
    # read-only: nothing in the run dir is created, cleaned up or moved (a live trainer's
    # save in flight is left alone); the newest verified checkpoint is read
    ckpt = Checkpointer(os.path.join(os.fspath(run_dir), "checkpoints"), read_only=True)
    try:
        if not ckpt.steps():
            raise ValueError(f"load: {os.path.abspath(run_dir)} holds no checkpoint; train "
                             f"first (checkpoints go to RUN_DIR/checkpoints)")
        if step is not None and step not in ckpt.steps():
            raise ValueError(f"load: {os.path.abspath(run_dir)} holds no checkpoint of step "
                             f"{step}; its checkpoints are steps {ckpt.steps()}")
        record = _record(ckpt, step)
        family = _family(record)
        model_cls = _trained_class(record, "model_cls", family, model_cls)
        decoder_layer_cls = _trained_class(record, "decoder_layer_cls", family,
                                           decoder_layer_cls)
        model_config = config_from_json(family.config_cls, record["model"])
        train = saved_train_config(record["train"])
        n = len(devices) if devices is not None else jax.device_count()
        same = mesh is None and _mesh_size(train.mesh) == n
        # the recorded model config is the resolved one; a dtype the run set stays set, so
        # the platform default (zoo.train.build.PLATFORM_DTYPE) applies only where it did
        pinned = tuple(o for o in train.overrides if o.partition("=")[0].strip() == "dtype")
        train = train.replace(mesh=mesh if mesh or not same else train.mesh,
                              strategy=strategy or (train.strategy if same or mesh else "fsdp"),
                              overrides=pinned[-1:], from_hf=None, run_dir=os.fspath(run_dir),
                              batch_size=batch_size or train.batch_size,
                              seq_len=seq_len or train.seq_len)
        if not (same or mesh):
            train = train.replace(mesh=f"fsdp={n}")
        custom = record.get("optimizer") == "custom"
        built = build(train, model_config=model_config, model_cls=model_cls,
                      decoder_layer_cls=decoder_layer_cls, tx=tx, devices=devices,
                      with_data=False)
        model, optimizer = built.abstract_state()
        restored = ckpt.restore(model, None if custom and tx is None else optimizer, step=step,
                                move_bad=False)
        if restored is None:
            what = f"checkpoint {step} cannot" if step is not None else "no checkpoint can"
            raise ValueError(f"load: {what} be read in {ckpt.directory} (the warnings above "
                             f"say why)")
    finally:
        ckpt.close()
    return Loaded(restored.model, restored.optimizer, restored.step, built.config,
                  built.model_config, restored.data, built)


def saved_train_config(saved: dict[str, Any]) -> TrainConfig:
    """The `TrainConfig` of a run.json's (or a checkpoint record's) ``train`` section, also as
    older zoo wrote it: without ``data.validation_fraction`` (no documents held out), or with
    the model settings ``attention``/``dtype``/``param_dtype``/``remat`` in ``parallelism``,
    which become ``overrides`` items of their model config fields (after the run's own, as
    they took precedence then)."""
    settings, data = dict(saved), saved.get("data")
    if isinstance(data, dict) and "validation_fraction" not in data:  # saved before
        settings["data"] = dict(data, validation_fraction=0.0)          # holdouts: none
    parallelism = settings.get("parallelism")
    if isinstance(parallelism, dict) and set(parallelism) & set(MODEL_FLAGS):
        parallelism = dict(parallelism)
        folded = []
        for name, spec in MODEL_FLAGS.items():
            value = parallelism.pop(name, None)
            if value is not None:
                folded.append(f"{spec.field}={value}")
        settings["parallelism"] = parallelism
        model = dict(settings.get("model") or {})
        model["overrides"] = [*(model.get("overrides") or ()), *folded]
        settings["model"] = model
    return TrainConfig(**settings)


def _record(ckpt: Checkpointer, step: int | None) -> dict[str, Any]:
    """The settings saved with `step`, or with the newest checkpoint whose record is intact."""
    error = None
    for s in [step] if step is not None else reversed(ckpt.steps()):
        try:
            return ckpt.read_config(s, verify=True)
        except Exception as e:
            error = e
    raise ValueError(f"load: the settings saved in {ckpt.directory} cannot be read "
                     f"({type(error).__name__}: {str(error)[:300]})")


def _mesh_size(text: str | None) -> int | None:
    if not text:
        return None
    from zoo.partitioning import MeshShape
    shape = MeshShape.parse(text)
    out = 1
    for v in dataclasses.asdict(shape).values():
        out *= v
    return out
