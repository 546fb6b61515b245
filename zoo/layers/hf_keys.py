"""Hugging Face checkpoint keys owned by the layers: rows of a key map and how modules compose them.

Every layer maps its own variables to Hugging Face tensor names with ``hf_keys(prefix) ->
list[Tensor]``: paths relative to the module (``("kernel",)``), keys under ``prefix``
(``"model.layers.3.self_attn.q_proj.weight"``). A module with submodules composes its rows with
`child`, which prefixes the paths with the attribute name and the keys with the submodule's
Hugging Face name: the class attribute ``hf_names`` (attribute -> Hugging Face name; missing
entries keep the attribute name), so a family only supplies the names that differ, e.g. Mixtral's
experts ``w1``/``w3``/``w2``.

A subclass that adds a parameter either extends ``hf_keys`` (``super().hf_keys(prefix) +
[copy(("gate",), f"{prefix}.gate")]``) or declares it zoo-only with the class attribute
``hf_zoo_only = ("gate",)``: zoo-only variables are initialised as the constructor does on
``from_hf`` and never written by ``to_hf``. A variable with neither is reported by name when
the model is loaded or saved (`uncovered`).

This module sits below `zoo.layers` (no model imports) so the layers can use it;
`zoo.models.hf` re-exports `Tensor` and the row helpers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Tensor", "child", "children", "copy", "hf_name", "join", "keys_of", "linear",
           "stacked_linear", "zoo_only"]


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One zoo variable and the Hugging Face tensor(s) it corresponds to.

    ``keys``: one key, one per slice of the zoo array's leading axis (per-expert weights,
    ``stacked``), or none: a zoo-only variable (initialised by the constructor, not saved).
    ``in_ndim``: None copies the tensor (reshaped); ``k`` means an ``nn.Linear`` weight
    ``[out, in]`` whose zoo kernel is ``[*in (k dims), *out]``: ``kernel = W.T.reshape(...)``.
    ``flat``: the Hugging Face tensor is the zoo array flattened (a bias ``[N*H]`` of a zoo
    ``[N, H]`` projection).
    """

    path: tuple[Any, ...]
    keys: tuple[str, ...]
    in_ndim: int | None = None
    stacked: bool = False
    flat: bool = False

    @property
    def zoo_only(self) -> bool:
        return not self.keys

    def to_zoo(self, w: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        shape = tuple(shape)
        if self.in_ndim is not None:
            if w.ndim != 2 or w.shape[1] != math.prod(shape[:self.in_ndim]):
                raise ValueError(f"{self.describe()}: Hugging Face weight of shape {w.shape} "
                                 f"does not fit zoo kernel {shape} (expected [out, in] with "
                                 f"in={math.prod(shape[:self.in_ndim])})")
            w = w.T
        if w.size != math.prod(shape):
            raise ValueError(f"{self.describe()}: Hugging Face tensor of shape {w.shape} does "
                             f"not fit zoo variable of shape {shape}; does config.json match "
                             f"the weights?")
        return w.reshape(shape)

    def to_hf(self, z: np.ndarray) -> np.ndarray:
        if self.in_ndim is None:
            return z.reshape(-1) if self.flat else z
        n_in = math.prod(z.shape[:self.in_ndim])
        return np.ascontiguousarray(z.reshape(n_in, -1).T)

    def describe(self) -> str:
        if not self.keys:
            return f"zoo {'.'.join(map(str, self.path))} (zoo-only)"
        key = self.keys[0] if len(self.keys) == 1 else f"{self.keys[0]} .. {self.keys[-1]}"
        return f"zoo {'.'.join(map(str, self.path))} <- {key}"


def linear(path: Sequence[Any], key: str, in_ndim: int = 1) -> Tensor:
    """An ``nn.Linear`` weight ``[out, in]`` for a zoo kernel ``[*in, *out]``."""
    return Tensor(tuple(path), (key,), in_ndim)


def copy(path: Sequence[Any], key: str, *, flat: bool = False) -> Tensor:
    """A tensor stored as is (reshaped): norm scales, embeddings, biases; ``flat``: stored
    flattened (the bias of a multi-dimensional projection)."""
    return Tensor(tuple(path), (key,), None, flat=flat)


def stacked_linear(path: Sequence[Any], keys: Sequence[str]) -> Tensor:
    """A zoo array ``[n, in, out]`` whose slice ``i`` is the ``nn.Linear`` weight ``keys[i]``."""
    return Tensor(tuple(path), tuple(keys), 1, stacked=True)


def zoo_only(path: Sequence[Any]) -> Tensor:
    """A variable with no Hugging Face counterpart: initialised on load, never saved."""
    return Tensor(tuple(path), ())


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def hf_name(module: Any, attr: str) -> str:
    """The Hugging Face name of `module`'s attribute `attr` (its class's ``hf_names``)."""
    return getattr(type(module), "hf_names", {}).get(attr, attr)


def keys_of(module: Any, prefix: str) -> list[Tensor]:
    """`module`'s rows (its ``hf_keys(prefix)``) plus its ``hf_zoo_only`` declarations."""
    fn = getattr(module, "hf_keys", None)
    if fn is None:
        raise TypeError(f"{type(module).__name__} has no hf_keys(prefix) method, so its "
                        f"parameters have no Hugging Face names; define one (see "
                        f"zoo.layers.hf_keys) or declare them zoo-only (hf_zoo_only = (...))")
    rows = list(fn(prefix))
    rows += [zoo_only((name,)) for name in getattr(type(module), "hf_zoo_only", ())
             if getattr(module, name, None) is not None]
    return rows


def child(module: Any, attr: str, prefix: str) -> list[Tensor]:
    """The rows of submodule ``module.<attr>``: paths under ``attr``, keys under ``prefix.<its
    Hugging Face name>`` (empty if the attribute is None, e.g. an optional projection)."""
    sub = getattr(module, attr)
    if sub is None:
        return []
    return [dataclasses.replace(r, path=(attr, *r.path))
            for r in keys_of(sub, join(prefix, hf_name(module, attr)))]


def children(module: Any, prefix: str, attrs: Sequence[str]) -> list[Tensor]:
    """`child` for each of `attrs`, in order."""
    return [r for attr in attrs for r in child(module, attr, prefix)]
