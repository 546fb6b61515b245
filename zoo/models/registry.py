"""The family registry: each family file registers itself, so `zoo.train` names none.

A `Family` is what the training floor needs to know about a model family:

* ``name`` -- the family's name (``"deepseek3"``), also the recipes' ``--family``;
* ``config_cls`` / ``model_cls`` -- the frozen config dataclass and the `CausalLM` subclass;
* ``presets`` -- preset name -> the config classmethod (``"deepseek_v3"``, ``"mini"``); a
  preset is named ``"<family>_<preset>"`` or by its checkpoint name where that is unambiguous
  (`resolve` accepts ``"deepseek_v3"``, ``"deepseek3_mini"`` and ``("deepseek3", "mini")``);
* ``after_step`` -- an optional ``after_step(model, aux, *, expert_bias_rate)`` run inside the
  jitted train step after the optimizer update, outside the gradient (DeepSeek-V3's
  aux-loss-free bias update).

The aux-loss weight is the config's own (`zoo.models.DecoderConfig.aux_loss_weight`, read from
its ``aux_loss_field``). Registering::

    register(Family(name="mine", config_cls=MyConfig, model_cls=MyModel,
                    presets={"mini": MyConfig.mini}))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Family", "register", "get", "names", "families", "family_of", "resolve",
           "preset_names", "model_types", "for_model_type"]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    model_cls: type
    presets: Mapping[str, Callable[..., Any]]
    after_step: Callable[..., None] | None = None

    def preset(self, name: str, **overrides) -> Any:
        """The config of preset `name` (``"mini"``), with `overrides` applied."""
        if name not in self.presets:
            raise ValueError(f"family {self.name!r} has no preset {name!r}; its presets are "
                             f"{', '.join(self.presets)}")
        return self.presets[name](**overrides)

    def qualified(self, preset: str) -> str:
        """The preset's public name: a checkpoint name as it is (``"deepseek_v3"``), otherwise
        ``"<family>_<preset>"`` (``"deepseek3_mini"``)."""
        return preset if preset != "mini" else f"{self.name}_{preset}"


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` (replacing one of the same name, so a reloaded module re-registers)."""
    _FAMILIES[family.name] = family
    return family


def _load() -> None:
    import zoo.models  # noqa: F401 -- the family modules register themselves on import


def get(name: str) -> Family:
    _load()
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered families: "
                         f"{', '.join(names())}")
    return _FAMILIES[name]


def names() -> list[str]:
    _load()
    return sorted(_FAMILIES)


def families() -> list[Family]:
    return [_FAMILIES[n] for n in names()]


def family_of(config_or_model: Any) -> Family:
    """The family whose config class (or model class) `config_or_model` is an instance of
    (the most derived match, so a subclassed config still finds its family)."""
    _load()
    matches = [f for f in _FAMILIES.values()
               if isinstance(config_or_model, (f.config_cls, f.model_cls))]
    if not matches:
        raise ValueError(f"no registered family takes a {type(config_or_model).__name__}; "
                         f"registered families: {', '.join(names())} (zoo.models.registry)")
    return max(matches, key=lambda f: len(f.config_cls.__mro__))


def preset_names() -> list[str]:
    """Every preset's public name (`Family.qualified`)."""
    return sorted(f.qualified(p) for f in families() for p in f.presets)


def resolve(preset: str | tuple[str, str], **overrides) -> tuple[Family, Any]:
    """``(family, config)`` of a preset: ``"deepseek_v3"``, ``"deepseek3_mini"`` or
    ``("deepseek3", "mini")``."""
    if isinstance(preset, tuple):
        family = get(preset[0])
        return family, family.preset(preset[1], **overrides)
    for family in families():
        for name in family.presets:
            if preset in (family.qualified(name), f"{family.name}_{name}"):
                return family, family.preset(name, **overrides)
    raise ValueError(f"unknown preset {preset!r}; valid presets are "
                     f"{', '.join(preset_names())} (or pass a config)")


def model_types() -> dict[str, Family]:
    """Every Hugging Face ``model_type`` a registered family reads (its model class's
    ``hf_model_types``) -> that family."""
    return {t: f for f in families() for t in f.model_cls.hf_model_types}


def for_model_type(model_type: Any, *, where: str = "config.json") -> Family:
    """The family that reads checkpoints of `model_type`, as transformers' AutoModelForCausalLM
    dispatches; an unknown one is an error listing the supported ones."""
    known = model_types()
    if model_type not in known:
        raise ValueError(f"{where}: model_type={model_type!r} is not one zoo reads; zoo reads "
                         f"{', '.join(map(repr, sorted(known)))}")
    return known[model_type]
