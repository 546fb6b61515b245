"""Mesh construction and the `Partitioner`: how the mesh cuts every parameter and activation.

A `Partitioner` is a value: a `jax.sharding.Mesh` plus a small table from *logical* axis names
to mesh axes, with one override table per scope (``"attention"``, ``"moe"``). Layers receive it
in their constructor and ask it for parameter initialisers (`param`), shardings (`spec`,
`sharding`) and activation constraints (`constrain`). Nothing reads a global rules context.

Mesh axes, always in this order: ``data, fsdp, expert, context, tensor`` (size 1 is fine).

Logical axes. Parameters and activations use different names for the model dimension because
FSDP shards a parameter's ``embed`` dimension over the same mesh axes that shard the batch of an
activation; one name for both would make ``("batch", "length", "embed")`` use a mesh axis twice.

=================  ==========================================================================
parameters         ``embed`` ``vocab`` ``heads`` ``kv_heads`` ``head_dim`` ``mlp`` ``experts``
                   ``q_lora`` ``kv_lora`` ``o_lora`` ``norm`` ``layers`` (``norm``: small
                   vectors, never sharded; ``q_lora``/``kv_lora``: MLA's low-rank input to
                   the up-projections, ``o_lora``: DeepSeek-V4's grouped output rank,
                   FSDP-sharded like ``embed``; ``layers``: the leading axis
                   of scanned layers' stacked parameters, never sharded -- each scan step
                   needs its whole layer)
activations        ``batch`` ``length`` ``act_embed`` ``act_heads`` ``act_kv_heads``
                   ``act_head_dim`` ``act_mlp`` ``act_vocab`` ``act_experts``
=================  ==========================================================================

Strategies (constructors of the table, not flags inside layers):

* ``fsdp`` -- the sequence is whole. Parameters are sharded over ``fsdp``, ``context`` and
  ``expert`` (outside MoE); the batch over ``data, fsdp, expert, context``. Inside MoE the
  experts go over ``expert``.
* ``cp`` -- native context parallelism: ``context`` shards the sequence in every block;
  ``expert`` shards the experts inside MoE and acts as a data/FSDP axis everywhere else.
* ``ep_as_cp`` -- expert-parallel-as-context-parallel: outside MoE the sequence is sharded over
  ``("context", "expert")`` (sizes multiply), so attention sees ``context*expert``-way CP; inside
  MoE the same ``expert`` axis shards the experts and only ``context`` shards the sequence.

In every strategy ``tensor`` shards heads, MLP width and vocabulary (Megatron-style).

Why `AxisType.Auto` meshes: layers state shardings at a few boundaries (parameters, activation
constraints, `shard_map` in/out specs) and let XLA's partitioner propagate the rest. Explicit
axes would make every intermediate op sharding-typed (ambiguous gathers raise, `shard_map`
refuses mismatched inputs), which costs user code far more than it buys here. `make_mesh`
therefore builds Auto axes on purpose.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
STRATEGIES = ("fsdp", "cp", "ep_as_cp")
SCOPES = (None, "attention", "moe")

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

PARAM_AXES = ("embed", "vocab", "heads", "kv_heads", "head_dim", "mlp", "experts",
              "q_lora", "kv_lora", "o_lora", "norm", "layers")
ACTIVATION_AXES = ("batch", "length", "act_embed", "act_heads", "act_kv_heads", "act_head_dim",
                   "act_mlp", "act_vocab", "act_experts")
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

# Parameter metadata (``nnx.Param(value, compute_dtype="bfloat16")``): the layer only ever uses
# this parameter cast to that dtype. A scanned stack casts such parameters once, before its
# scan (`zoo.models.stacks.run_cycle`), so the loop reads, and its backward stacks the
# gradients in, the compute dtype; the values are the same as casting inside each layer.
COMPUTE_DTYPE = "compute_dtype"


PLATFORMS = ("cpu", "gpu", "tpu")
_PLATFORM_NAMES = {"cuda": "gpu", "rocm": "gpu"}


def device_platform(device: Any) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the platform a device (or a topology's device
    description, `jax.experimental.topologies`) belongs to (``cuda``/``rocm`` are ``"gpu"``)."""
    name = str(getattr(device, "platform", "cpu")).lower()
    return _PLATFORM_NAMES.get(name, name)


def host_value(x: Any) -> np.ndarray:
    """`x` as a host array, whole. An array spread over other processes' devices is gathered
    from all of them (a collective: every process of the job calls this together)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def mesh_platform(mesh: Any = None) -> str:
    """The platform of `mesh`'s devices: the target a program over this mesh is compiled for.

    Every program choice that depends on the platform (kernels, tile sizes, ring pieces,
    donation, host offload) reads this, never `jax.default_backend()`: a mesh of TPU devices
    from `jax.experimental.topologies` compiles the TPU program on a CPU-only host. Without a
    mesh (or with an `AbstractMesh`, which has no devices) the program runs on the default
    device, whose platform it is.
    """
    devices = _mesh_devices(mesh)
    if devices is not None:
        return device_platform(devices.flat[0])
    return device_platform(jax.devices()[0])


def _mesh_devices(mesh: Any) -> np.ndarray | None:
    """`mesh`'s devices, None without any (no mesh; an `AbstractMesh` raises on `.devices`)."""
    try:
        devices = getattr(mesh, "devices", None)
    except ValueError:
        return None
    return devices if isinstance(devices, np.ndarray) and devices.size else None


def make_mesh(*, data: int = 1, fsdp: int = 1, expert: int = 1, context: int = 1,
              tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with axes ``("data", "fsdp", "expert", "context", "tensor")`` over `devices`.

    ``devices`` defaults to all of `jax.devices()`; the product of the sizes must equal their
    number. Axes are `AxisType.Auto` (see the module docstring for why).
    """
    sizes = dict(data=data, fsdp=fsdp, expert=expert, context=context, tensor=tensor)
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh axis {name}={size!r} must be a positive integer")
    devs = list(jax.devices() if devices is None else devices)
    product = math.prod(sizes.values())
    if product != len(devs):
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(
            f"mesh sizes ({shown}) multiply to {product}, but there are {len(devs)} devices; "
            f"choose sizes whose product is {len(devs)} (e.g. fsdp={len(devs)})")
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:  # topology-aware placement when the backend offers it
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(shape, devices=devs, allow_split_physical_axes=True)
    except Exception:
        grid = np.asarray(devs, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _strategy_rules(strategy: str) -> dict[Any, dict[str, MeshAxes]]:
    """The table for one strategy: ``{None: default rules, scope: overrides}``."""
    tp = "tensor"
    common = dict(vocab=tp, heads=tp, kv_heads=tp, head_dim=None, mlp=tp, experts="expert",
                  norm=None, layers=None,
                  act_embed=None, act_heads=tp, act_kv_heads=tp, act_head_dim=None, act_mlp=tp,
                  act_vocab=tp, act_experts="expert")
    if strategy == "fsdp":
        default = dict(common, batch=("data", "fsdp", "expert", "context"), length=None,
                       embed=("fsdp", "context", "expert"),
                       q_lora=("fsdp", "context", "expert"),
                       kv_lora=("fsdp", "context", "expert"),
                       o_lora=("fsdp", "context", "expert"))
        moe = dict(batch=("data", "fsdp", "context"), embed=("fsdp", "context"))
        return {None: default, "attention": {}, "moe": moe}
    if strategy == "cp":
        default = dict(common, batch=("data", "fsdp", "expert"), length="context",
                       embed=("fsdp", "context", "expert"),
                       q_lora=("fsdp", "context", "expert"),
                       kv_lora=("fsdp", "context", "expert"),
                       o_lora=("fsdp", "context", "expert"))
        moe = dict(batch=("data", "fsdp"), embed=("fsdp", "context"))
        return {None: default, "attention": {}, "moe": moe}
    if strategy == "ep_as_cp":
        default = dict(common, batch=("data", "fsdp"), length=("context", "expert"),
                       embed=("fsdp", "context", "expert"),
                       q_lora=("fsdp", "context", "expert"),
                       kv_lora=("fsdp", "context", "expert"),
                       o_lora=("fsdp", "context", "expert"))
        moe = dict(length="context", embed=("fsdp", "context"))
        return {None: default, "attention": {}, "moe": moe}
    raise ValueError(f"unknown partitioning strategy {strategy!r}; valid strategies are "
                     f"{', '.join(repr(s) for s in STRATEGIES)}")


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


class Partitioner:
    """A mesh plus the logical-to-mesh axis table of one strategy.

    ``Partitioner(None)`` (or passing ``partitioner=None`` to a layer) means unsharded: every
    spec is empty, `sharding` returns None and `constrain` returns its input unchanged.

    Args:
      mesh: a mesh from `make_mesh` (an `AbstractMesh` works for `nnx.eval_shape`).
      strategy: ``"fsdp"``, ``"cp"`` or ``"ep_as_cp"`` (see the module docstring).
      overrides: optional ``{scope: {logical_axis: mesh_axes}}`` applied on top of the strategy,
        e.g. ``{None: {"vocab": None}}`` to replicate the vocabulary.
    """

    def __init__(self, mesh: Mesh | jax.sharding.AbstractMesh | None, strategy: str = "fsdp",
                 overrides: Mapping[Any, Rules] | None = None):
        table = _strategy_rules(strategy)
        for scope, rules in (overrides or {}).items():
            if scope not in SCOPES:
                raise ValueError(f"unknown scope {scope!r} in overrides; valid scopes are "
                                 f"{SCOPES}")
            table.setdefault(scope, {}).update(rules)
        if mesh is not None:
            missing = [a for a in MESH_AXES if a not in mesh.axis_names]
            if missing:
                raise ValueError(f"mesh axes {mesh.axis_names} lack {missing}; build the mesh "
                                 f"with zoo.make_mesh so it has all of {MESH_AXES}")
            for scope, rules in table.items():
                for logical, axes in rules.items():
                    for a in _as_tuple(axes):
                        if a not in mesh.axis_names:
                            raise ValueError(f"rule {logical!r} -> {axes!r} (scope {scope!r}) "
                                             f"names mesh axis {a!r}, not one of {MESH_AXES}")
        self.mesh = mesh
        self.strategy = strategy
        self._table = table

    # -- resolution -------------------------------------------------------------------------
    @property
    def platform(self) -> str:
        """``"cpu"``/``"gpu"``/``"tpu"`` of the mesh's devices (`mesh_platform`)."""
        return mesh_platform(self.mesh)

    @property
    def target_device(self) -> Any:
        """One of the mesh's devices when they are not of the default device's platform (a
        TPU or GPU topology's devices on a CPU host), else None: kernels that look for the
        platform on the default device are traced with this one."""
        devices = _mesh_devices(self.mesh)
        if devices is None:
            return None
        first = devices.flat[0]
        return None if device_platform(first) == mesh_platform(None) else first

    def rules(self, scope: str | None = None) -> dict[str, MeshAxes]:
        """The resolved logical-to-mesh table of `scope` (defaults overlaid by the scope)."""
        if scope not in self._table:
            raise ValueError(f"unknown scope {scope!r}; valid scopes are {SCOPES}")
        return {**self._table[None], **self._table[scope]}

    def mesh_axes(self, logical: str | None, scope: str | None = None) -> tuple[str, ...]:
        """Mesh axes (of size > 1) that shard one logical axis in `scope`."""
        if logical is None or self.mesh is None:
            return ()
        rules = self.rules(scope)
        if logical not in rules:
            raise ValueError(f"unknown logical axis {logical!r}; known axes are "
                             f"{', '.join(sorted(rules))} (add it with overrides=...)")
        return tuple(a for a in _as_tuple(rules[logical]) if self.mesh.shape[a] > 1)

    def spec(self, logical_axes: Sequence[str | None], scope: str | None = None) -> P:
        """The `PartitionSpec` of an array whose dimensions have these logical names.

        Raises `ValueError` if two dimensions would be sharded over the same mesh axis.
        """
        if self.mesh is None:
            return P()
        if isinstance(logical_axes, str):
            raise TypeError(f"logical_axes must be a sequence of names, got the string "
                            f"{logical_axes!r}; write ({logical_axes!r},)")
        rules = self.rules(scope)
        used: dict[str, str] = {}
        entries = []
        for logical in logical_axes:
            if logical is not None and logical not in rules:
                raise ValueError(f"unknown logical axis {logical!r}; known axes are "
                                 f"{', '.join(sorted(rules))} (add it with overrides=...)")
            axes = _as_tuple(rules[logical]) if logical is not None else ()
            for a in axes:  # checked before dropping size-1 axes: a bad table fails on any mesh
                if a in used:
                    raise ValueError(
                        f"logical axes {tuple(logical_axes)} (scope {scope!r}, strategy "
                        f"{self.strategy!r}) map both {used[a]!r} and {logical!r} to mesh axis "
                        f"{a!r}; an array can be sharded over a mesh axis only once -- use "
                        f"different logical names or override one rule")
                used[a] = logical
            kept = tuple(a for a in axes if self.mesh.shape[a] > 1)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return P(*entries)

    def sharding(self, logical_axes: Sequence[str | None],
                 scope: str | None = None) -> NamedSharding | None:
        """`NamedSharding` for `logical_axes` on this mesh (None when unsharded)."""
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, self.spec(logical_axes, scope))

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None],
                  scope: str | None = None) -> jax.Array:
        """Sharding constraint on an activation; a no-op without a mesh.

        The constraint carries its own mesh, so it works under `jax.jit` with or without an
        ambient mesh.
        """
        if self.mesh is None or isinstance(self.mesh, jax.sharding.AbstractMesh):
            return x
        if len(logical_axes) != x.ndim:
            raise ValueError(f"logical axes {tuple(logical_axes)} name {len(logical_axes)} "
                             f"dimensions but the array has shape {x.shape}")
        return jax.lax.with_sharding_constraint(x, self.sharding(logical_axes, scope))

    def param(self, init: Callable[..., jax.Array], logical_axes: Sequence[str | None],
              scope: str | None = None) -> Callable[..., jax.Array]:
        """Wrap an initializer so the `nnx.Param` it fills is created already sharded.

        The sharding travels as NNX ``out_sharding`` metadata, which also lets
        `nnx.get_partition_spec` and `zoo.shardings.sharding_table` read it back.
        """
        axes = tuple(logical_axes)
        if self.mesh is None:
            return nnx.with_metadata(init, logical_axes=axes)
        spec = self.spec(axes, scope)

        def checked(key, shape, *args, **kwargs):
            self.check_divisible(shape, axes, scope)
            return init(key, shape, *args, **kwargs)

        return nnx.with_partitioning(checked, spec, mesh=self.mesh, logical_axes=axes)

    def check_divisible(self, shape: Sequence[int], logical_axes: Sequence[str | None],
                        scope: str | None = None, what: str = "parameter") -> None:
        """Raise if a dimension does not split evenly over the mesh axes that shard it."""
        if len(shape) != len(logical_axes):
            raise ValueError(f"{what} of shape {tuple(shape)} has {len(shape)} dimensions but "
                             f"logical axes {tuple(logical_axes)} name {len(logical_axes)}")
        for dim, (size, logical) in enumerate(zip(shape, logical_axes)):
            axes = self.mesh_axes(logical, scope)
            shards = self.axis_size(axes)
            if size % shards:
                raise ValueError(
                    f"{what} dimension {dim} ({logical!r}, size {size}) of shape {tuple(shape)} "
                    f"does not split into {shards} shards over mesh axes {axes} (strategy "
                    f"{self.strategy!r}, scope {scope!r}); use a size divisible by {shards} or a "
                    f"mesh/strategy that shards {logical!r} fewer ways")

    # -- shape checks: the one home of every layer's and op's divisibility rules -------------
    def check_split(self, name: str, value: int, logical: str, scope: str | None = None, *,
                    what: str = "", role: str = "", fix: str = "") -> None:
        """Raise unless ``value`` (the dimension called `name`) splits evenly over the mesh
        axes that shard the logical axis `logical` in `scope`. ``role`` says what those shards
        are; ``fix`` replaces the default advice (a multiple, or fewer shards)."""
        n = self.size(logical, scope)
        if value % n:
            axes = self.mesh_axes(logical, scope)
            role = f" ({role})" if role else ""
            fix = fix or (f"make {name} a multiple of {n} (e.g. {-(-value // n) * n}) or "
                          f"shrink those mesh axes")
            raise ValueError(f"{_prefix(what)}{name}={value} is not divisible by its {n} shards "
                             f"over mesh axes {axes}{role}; {fix}")

    def check_sequence(self, length: int, scope: str | None = "attention", *, what: str = "",
                       name: str = "length", balanced: bool = True) -> None:
        """Raise unless a sequence of `length` splits over the `scope`'s sequence shards ``cp``:
        into ``2*cp`` chunks when `balanced` (the load-balanced layout: shard r holds chunks r
        and 2*cp-1-r), into ``cp`` pieces otherwise."""
        cp = self.context_size(scope)
        chunks = 2 * cp if balanced else cp
        if cp > 1 and length % chunks:
            up, down = -(-length // (2 * cp)) * 2 * cp, length // (2 * cp) * 2 * cp
            alt = f" (or cut it to {down})" if down else ""
            why = (f"2*context = {chunks} (the sequence is sharded {cp} ways over "
                   f"{self.sequence_axes(scope)} and load balancing cuts it into {chunks} "
                   f"chunks)" if balanced else
                   f"its {cp} shards over mesh axes {self.sequence_axes(scope)}")
            raise ValueError(f"{_prefix(what)}{name}={length} is not divisible by {why}; pad it "
                             f"to {up}{alt} or change the context/expert mesh axes")

    def check_tokens(self, batch: int, length: int, scope: str | None = None, *,
                     what: str = "", balanced: bool = False) -> None:
        """Raise unless a ``[batch, length, ...]`` activation shards in `scope`."""
        self.check_split("batch", batch, "batch", scope, what=what,
                         role="the tokens' batch shards", fix=(
                             f"use a batch that is a multiple of {self.size('batch', scope)} or "
                             f"shrink those mesh axes"))
        self.check_sequence(length, scope, what=what, balanced=balanced)

    def check_heads(self, num_heads: int, num_kv_heads: int, scope: str | None = "attention",
                    *, what: str = "") -> None:
        """Grouped-query head rules: ``num_heads`` a multiple of ``num_kv_heads`` and of the
        tensor axis size ``tp`` that shards heads; ``num_kv_heads`` and ``tp`` divide one
        another (fewer kv heads than tensor shards are repeated so each shard has its own)."""
        pre = _prefix(what)
        if num_heads < 1 or num_kv_heads < 1:
            raise ValueError(f"{pre}num_heads={num_heads} and num_kv_heads={num_kv_heads} must "
                             f"be positive")
        if num_heads % num_kv_heads:
            divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
            raise ValueError(f"{pre}num_heads={num_heads} is not a multiple of num_kv_heads="
                             f"{num_kv_heads}; choose num_kv_heads among {divisors}")
        tp = self.size("act_heads", scope)
        if num_heads % tp:
            raise ValueError(f"{pre}num_heads={num_heads} is not divisible by the tensor axis "
                             f"size {tp}; use a tensor axis that divides {num_heads}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"{pre}num_kv_heads={num_kv_heads} and the tensor axis size {tp} "
                             f"must divide one another (kv heads are split over, or repeated "
                             f"across, the tensor shards); change num_kv_heads or the tensor "
                             f"axis")

    @staticmethod
    def check_inputs_shape(inputs_shape: Sequence[int], *, what: str = "") -> tuple[int, ...]:
        """``(batch, length, embed)`` as three positive ints, or a `ValueError`."""
        shape = tuple(inputs_shape)
        if len(shape) != 3 or not all(isinstance(n, (int, np.integer)) and not
                                      isinstance(n, bool) and n > 0 for n in shape):
            raise ValueError(f"{_prefix(what)}inputs_shape={inputs_shape!r} must be three "
                             f"positive ints (batch, length, embed), e.g. (8, 4096, 2048)")
        return tuple(int(n) for n in shape)

    # -- sizes --------------------------------------------------------------------------------
    def axis_size(self, axes: str | Sequence[str] | None) -> int:
        return axes_size(self.mesh, axes)

    def size(self, logical: str, scope: str | None = None) -> int:
        """How many shards one logical axis has in `scope` (1 when unsharded)."""
        return self.axis_size(self.mesh_axes(logical, scope))

    def context_size(self, scope: str | None = "attention") -> int:
        """How many shards the sequence has in `scope`: the CP degree data must reorder for."""
        return self.size("length", scope)

    def sequence_axes(self, scope: str | None = "attention") -> tuple[str, ...]:
        """Mesh axes (size > 1) that shard the sequence in `scope`, major to minor."""
        return self.mesh_axes("length", scope)

    def batch_axes(self, scope: str | None = None) -> tuple[str, ...]:
        """Mesh axes (size > 1) that shard the batch in `scope`."""
        return self.mesh_axes("batch", scope)

    # -- display ------------------------------------------------------------------------------
    def __repr__(self) -> str:
        if self.mesh is None:
            return "Partitioner(unsharded)"
        mesh = ", ".join(f"{a}={self.mesh.shape[a]}" for a in MESH_AXES)
        lines = [f"Partitioner(strategy={self.strategy!r}, mesh=({mesh}))"]
        scopes = [s for s in SCOPES if s in self._table]
        header = f"  {'logical axis':<14}" + "".join(f"{s or 'default'!s:<30}" for s in scopes)
        lines.append(header)
        names = list(dict.fromkeys([*LOGICAL_AXES, *self._table[None]]))
        for name in names:
            cells = []
            for s in scopes:
                axes = self.rules(s).get(name)
                kept = tuple(a for a in _as_tuple(axes) if self.mesh.shape[a] > 1)
                cell = ",".join(kept) if kept else "-"
                if s is not None and name not in self._table[s]:
                    cell = '"'  # same as default
                cells.append(f"{cell:<30}")
            lines.append(f"  {name:<14}" + "".join(cells))
        ctx = ", ".join(f"{s or 'default'}={self.context_size(s)}" for s in scopes)
        lines.append(f"  sequence shards: {ctx}")
        return "\n".join(lines)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Partitioner) and self.mesh == other.mesh
                and self.strategy == other.strategy and self._table == other._table)

    def __hash__(self) -> int:
        return hash((self.strategy, id(self.mesh)))


def axes_size(mesh: Any, axes: str | Sequence[str] | None) -> int:
    """Devices along mesh axes (a name, a tuple of names, or None); 1 without a mesh."""
    if mesh is None or axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in _as_tuple(axes))


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""


def resolve(partitioner: Partitioner | None) -> Partitioner:
    """``None`` -> the unsharded partitioner; layers call this on their argument."""
    return UNSHARDED if partitioner is None else partitioner


UNSHARDED = Partitioner(None)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the five mesh axes, parsed from ``"data=..,fsdp=.."`` strings (recipes)."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in MESH_AXES or not value.isdigit() or int(value) < 1:
                raise ValueError(f"bad mesh entry {part!r} in {text!r}; write AXIS=SIZE with "
                                 f"AXIS one of {', '.join(MESH_AXES)} and SIZE >= 1, e.g. "
                                 f"'fsdp=2,expert=2,context=2'")
            sizes[name] = int(value)
        return cls(**sizes)

    def make(self, devices: Sequence[Any] | None = None) -> Mesh:
        return make_mesh(**dataclasses.asdict(self), devices=devices)
