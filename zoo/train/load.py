"""`load(run_dir)`: a finished (or interrupted) run's model, outside training, on any mesh.

The checkpoint's own record (the settings, the family and the resolved model config that
`zoo.train.build` wrote beside the arrays) rebuilds the model; its arrays are restored straight
onto the shardings of the mesh asked for -- the run's own mesh when this process has as many
devices, else FSDP over the devices there are (or ``mesh=``/``strategy=``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from zoo.models import registry
from zoo.train.build import Built, build
from zoo.train.checkpoint import Checkpointer
from zoo.train.config import TrainConfig
from zoo.train.fields import config_from_json

__all__ = ["Loaded", "load"]


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
        if family.model_cls.__qualname__ == record.get("model_cls"):
            return family
    raise ValueError(f"load: the checkpoint names no registered family (model class "
                     f"{record.get('model_cls')!r}); pass model_cls=")


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
      model_cls, decoder_layer_cls: the classes of a run trained with subclasses.
    """
    import jax
    ckpt = Checkpointer(os.path.join(os.fspath(run_dir), "checkpoints"))
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"load: {os.path.abspath(run_dir)} holds no checkpoint; train "
                             f"first (checkpoints go to RUN_DIR/checkpoints)")
        record = ckpt.read_config(step)
        family = _family(record)
        model_config = config_from_json(family.config_cls, record["model"])
        settings, data = dict(record["train"]), record["train"].get("data")
        if isinstance(data, dict) and "validation_fraction" not in data:  # saved before
            settings["data"] = dict(data, validation_fraction=0.0)          # holdouts: none
        train = TrainConfig(**settings)
        n = len(devices) if devices is not None else jax.device_count()
        same = mesh is None and _mesh_size(train.mesh) == n
        train = train.replace(mesh=mesh if mesh or not same else train.mesh,
                              strategy=strategy or (train.strategy if same or mesh else "fsdp"),
                              overrides=(), from_hf=None, run_dir=os.fspath(run_dir),
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
            raise ValueError(f"load: checkpoint {step} in {ckpt.directory} cannot be read")
    finally:
        ckpt.close()
    return Loaded(restored.model, restored.optimizer, restored.step, built.config,
                  built.model_config, restored.data, built)


def _mesh_size(text: str | None) -> int | None:
    if not text:
        return None
    from zoo.partitioning import MeshShape
    shape = MeshShape.parse(text)
    out = 1
    for v in dataclasses.asdict(shape).values():
        out *= v
    return out
