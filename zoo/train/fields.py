"""Typed values from text: the parsing behind the recipes' flags and ``--set FIELD=VALUE``.

* `parse_text(tp, text)` -- a value of a resolved annotation (``int``, ``float``, ``bool``,
  ``X | None``, ``tuple[X, ...]``, ``Literal`` choices, `DTypeName`, nested dataclasses as
  JSON objects); `describe(tp)` says in words what it expects.
* `apply_overrides(config, ["field=value", ...])` -- a new config with fields parsed from
  their types.
* `config_to_json` / `config_from_json` -- a config dataclass to JSON-able values and back
  (dtypes by name, nested dataclasses as dicts); `config_to_python` keeps the values.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NewType

__all__ = ["DTypeName", "parse_text", "describe", "apply_overrides", "config_to_json",
           "config_from_json", "config_to_python", "is_union"]

DTypeName = NewType("DTypeName", str)  # a dtype by name ("bfloat16"), checked by jnp.dtype
_NONE = ("none", "null")


# -- values from text, by type ---------------------------------------------------------------

def is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_dtype(value) -> bool:
    import numpy as np
    # numpy scalar types, and jax's (jnp.float32 is no np.generic but carries a .dtype)
    return isinstance(value, np.dtype) or (isinstance(value, type) and (
        issubclass(value, np.generic) or isinstance(getattr(value, "dtype", None), np.dtype)))


def describe(tp, current: Any = None) -> str:
    """What `parse_text` expects for `tp`, in words (for error messages)."""
    if is_union(tp):
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
    if is_union(tp):
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
        return _parse_sequence(tp, text)
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


def _parse_sequence(tp, text: str) -> Any:
    """``tuple[X, ...]``/``list[X]`` from comma-separated or JSON-list text; fixed-length
    tuples take one value per member type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    items = json.loads(text) if text.startswith("[") else [t for t in text.split(",") if t]
    if (len(args) == 2 and args[1] is Ellipsis) or len(args) <= 1:
        item = args[0] if args else str
        return origin(parse_text(item, str(v)) for v in items)
    if len(args) == len(items):
        return origin(parse_text(a, str(v)) for a, v in zip(args, items))
    raise ValueError(f"expected {len(args)} comma-separated values")


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


def config_from_json(cls: type, values: Mapping[str, Any]) -> Any:
    """`config_to_json`'s inverse: ``cls(**values)`` with dtype names back to dtypes and
    nested dicts back to the dataclasses their fields are typed with."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values or not f.init:
            continue
        value, tp = values[f.name], hints.get(f.name, Any)
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(value, str) and _is_dtype(default):
            value = _jnp_dtype(value).type
        elif isinstance(value, Mapping):
            inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)] or [tp]
            if dataclasses.is_dataclass(inner[0]):
                value = config_from_json(inner[0], value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)
