"""Sharding tables: how every parameter of a module is cut across the devices.

``print(zoo.shardings.sharding_table(model))`` lists, per parameter: path, shape, dtype, logical
axes, `PartitionSpec`, per-device shard shape and bytes per device, with the total per device.
Works on a model built under `nnx.eval_shape` (values are `ShapeDtypeStruct`s), so the layout of
a 671B model can be studied on a laptop with an `AbstractMesh`. In a notebook the table renders
as HTML.
"""

from __future__ import annotations

import dataclasses
import html
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.partitioning import axes_size


@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...] | None
    spec: P
    shard_shape: tuple[int, ...]
    bytes_per_device: int

    @property
    def total_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"  # unreachable


def _spec_text(spec: P) -> str:
    return "P(" + ", ".join(repr(e) if e is not None else "None" for e in spec) + ")"


class ShardingTable:
    """Rows of `Row`, printable as text (``str``) and as HTML (``_repr_html_``)."""

    def __init__(self, rows: list[Row], mesh: Any):
        self.rows, self.mesh = rows, mesh

    @property
    def bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.rows)

    @property
    def num_params(self) -> int:
        return sum(math.prod(r.shape) for r in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        header = ["path", "shape", "dtype", "logical axes", "spec", "shard shape", "bytes/device"]
        body = [[r.path, str(r.shape), r.dtype,
                 "-" if r.logical_axes is None else str(r.logical_axes), _spec_text(r.spec),
                 str(r.shard_shape), _human(r.bytes_per_device)] for r in self.rows]
        return header, body

    def _footer(self) -> str:
        mesh = ("no mesh" if self.mesh is None else
                ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items()))
        return (f"{len(self.rows)} arrays, {self.num_params:,} values, "
                f"{_human(self.total_bytes)} in all; {_human(self.bytes_per_device)} per device "
                f"({mesh})")

    def __str__(self) -> str:
        header, body = self._cells()
        widths = [max(len(c) for c in col) for col in zip(header, *body)]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        lines = [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body), self._footer()]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        header, body = self._cells()
        th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        trs = "".join("<tr>" + "".join(f"<td><code>{html.escape(c)}</code></td>" for c in row)
                      + "</tr>" for row in body)
        return (f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"
                f"<p>{html.escape(self._footer())}</p>")


def _row(path: tuple, var: nnx.Variable) -> Row:
    value = var.get_value()
    meta = var.get_metadata()
    shape = tuple(int(d) for d in np.shape(value))
    dtype = str(np.dtype(value.dtype))
    mesh = meta.get("mesh")
    spec = meta.get("out_sharding")
    sharding = getattr(value, "sharding", None)
    if spec is None and isinstance(sharding, jax.sharding.NamedSharding):
        spec, mesh = sharding.spec, sharding.mesh
    spec = P(*spec) if spec is not None else P()
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    shard = tuple(-(-d // axes_size(mesh, e)) for d, e in zip(shape, entries))
    logical = meta.get("logical_axes")
    return Row(path="/".join(str(p) for p in path), kind=type(var).__name__, shape=shape,
               dtype=dtype, logical_axes=tuple(logical) if logical is not None else None,
               spec=spec, shard_shape=shard,
               bytes_per_device=math.prod(shard) * np.dtype(dtype).itemsize)


def sharding_table(module_or_state: nnx.Module | nnx.State,
                   filter: Any = nnx.Variable) -> ShardingTable:
    """One row per variable (default: all; pass ``nnx.Param`` for parameters only)."""
    state = (nnx.state(module_or_state, filter) if isinstance(module_or_state, nnx.Module)
             else module_or_state)
    rows, meshes = [], set()
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Variable) or not hasattr(var.get_value(), "shape"):
            continue
        if isinstance(var, nnx.RngState):
            continue
        rows.append(_row(path, var))
        mesh = var.get_metadata().get("mesh")
        if mesh is not None:
            meshes.add(mesh)
    return ShardingTable(rows, next(iter(meshes)) if len(meshes) == 1 else None)


# (name, scope, logical axes, shape keys): the activations the layers constrain.
_ACTIVATIONS = (
    ("residual stream", None, ("batch", "length", "act_embed"), ("batch", "length", "embed")),
    ("attention q", "attention", ("batch", "length", "act_heads", "act_head_dim"),
     ("batch", "length", "heads", "head_dim")),
    ("attention k/v", "attention", ("batch", "length", "act_kv_heads", "act_head_dim"),
     ("batch", "length", "kv_heads", "head_dim")),
    ("moe tokens", "moe", ("batch", "length", "act_embed"), ("batch", "length", "embed")),
    ("mlp hidden", None, ("batch", "length", "act_mlp"), ("batch", "length", "mlp")),
    ("logits", None, ("batch", "length", "act_vocab"), ("batch", "length", "vocab")),
)


def activation_table(partitioner: Any, *, batch: int, length: int, embed: int, heads: int = 1,
                     kv_heads: int = 1, head_dim: int = 1, mlp: int = 1, vocab: int = 1,
                     dtype: Any = np.float32) -> ShardingTable:
    """How the partitioner cuts the activations the layers constrain, for given sizes."""
    sizes = dict(batch=batch, length=length, embed=embed, heads=heads, kv_heads=kv_heads,
                 head_dim=head_dim, mlp=mlp, vocab=vocab)
    mesh = partitioner.mesh
    rows = []
    for name, scope, axes, keys in _ACTIVATIONS:
        shape = tuple(sizes[k] for k in keys)
        spec = partitioner.spec(axes, scope)
        entries = tuple(spec) + (None,) * (len(shape) - len(spec))
        shard = tuple(-(-d // axes_size(mesh, e)) for d, e in zip(shape, entries))
        rows.append(Row(path=f"{name} [{scope or 'default'}]", kind="activation", shape=shape,
                        dtype=str(np.dtype(dtype)), logical_axes=axes, spec=spec,
                        shard_shape=shard,
                        bytes_per_device=math.prod(shard) * np.dtype(dtype).itemsize))
    return ShardingTable(rows, mesh)
