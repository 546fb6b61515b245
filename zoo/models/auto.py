"""`from_hf(path)` for any family: the checkpoint's ``model_type`` picks the family from the
registry, as transformers' ``AutoModelForCausalLM`` does; `to_hf(model, path)` writes any
family's model back."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from zoo.models import hf, registry
from zoo.partitioning import Partitioner

__all__ = ["from_hf", "to_hf", "family_of_checkpoint"]


def family_of_checkpoint(path: str | os.PathLike, *, loader: str = "zoo.models.from_hf"
                         ) -> registry.Family:
    """The registered family that reads the checkpoint folder `path` (by its config.json's
    ``model_type``); an unknown model_type is an error listing the supported ones."""
    raw = hf.read_config(path, tuple(registry.model_types()), loader=loader)
    return registry.for_model_type(raw.get("model_type"), where=f"{loader}: {os.fspath(path)}")


def from_hf(path: str | os.PathLike, *, partitioner: Partitioner | None = None,
            inputs_shape: Sequence[int] | None = None, **kwargs: Any):
    """Load a local Hugging Face checkpoint folder (config.json + *.safetensors) of any family
    zoo registers, dispatching on config.json's ``model_type``. ``kwargs`` are the family
    loader's (``dtype``, ``param_dtype``, ``config_overrides``, ``model_cls``,
    ``decoder_layer_cls``; see e.g. `zoo.models.deepseek3.from_hf`)."""
    family = family_of_checkpoint(path)
    model_cls = kwargs.pop("model_cls", family.model_cls)
    return model_cls.from_hf(path, partitioner=partitioner, inputs_shape=inputs_shape, **kwargs)


def to_hf(model, path: str | os.PathLike, **kwargs: Any) -> None:
    """Write `model` (any family) as a Hugging Face checkpoint folder; ``kwargs`` as the
    family's ``to_hf`` (``max_shard_bytes``, ``overwrite``)."""
    model.to_hf(path, **kwargs)
