"""Scale rehearsal: the recipes' train step compiled ahead of time for a (virtual) mesh.

Nothing is allocated: model and optimizer come from `zoo.train.step.abstract_state`
(`nnx.eval_shape`, shardings attached), the batch is `jax.ShapeDtypeStruct`s on the recipes'
batch sharding, and the step is `make_train_step(donate=True)` -- the program an accelerator
run compiles, lowered and compiled here for as many virtual CPU devices as the mesh needs
(`set_virtual_devices`, before jax starts its backend).

* `rehearse(model, ...)` -- a preset name (``"deepseek_v3"``, ``"mixtral_8x7b"``, ...) or a
  config, a mesh, strategy, batch, sequence length, dtypes, remat policy and config overrides
  -> a `Rehearsal`; `rehearse_step` does the same from a recipe's pieces (``--rehearse``).
* `build_for_rehearsal`, `measure`, `sharded_bytes` -- the pieces other rehearsals reuse
  (`zoo.inference.rehearsal.rehearse_decode` compiles one decode step the same way).
* `Rehearsal` -- compile seconds, HLO instruction count, per-device bytes (parameters and
  optimizer state from the shardings; temporaries, arguments and outputs from XLA's memory
  analysis), HLO FLOPs per device against the model's own training FLOPs, bytes per
  collective kind, and dot ops by operand dtype.
* `hlo_stats(text)` -- the HLO counter: dots and convolutions (FLOPs), collectives (bytes) and
  instructions of an HLO module's text, with every ``while`` body multiplied by its
  ``known_trip_count`` (XLA's own cost analysis counts a loop body once).

Dot dtypes are read from the program as lowered (before XLA's optimisation): XLA:CPU upcasts
bf16 dots to f32 when it compiles, so the compiled CPU program would hide what a GPU/TPU runs.
Collective bytes are buffer sizes per device: the gathered result of an all-gather, the input
of a reduce-scatter, all-reduce, all-to-all or collective-permute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from zoo.ops.hlo import HloStats, hlo_stats  # the HLO counter, re-exported

__all__ = ["Rehearsal", "rehearse", "rehearse_step", "hlo_stats", "HloStats",
           "set_virtual_devices", "presets", "build_for_rehearsal", "measure",
           "sharded_bytes", "dtype_name"]  # PRESETS: on access


# -- virtual devices -------------------------------------------------------------------------------

def set_virtual_devices(n: int) -> None:
    """Give the CPU backend `n` devices (`jax_num_cpu_devices`, via
    `zoo.train.launch.set_cpu_devices`). Must run before jax starts its backend (importing jax
    is fine); afterwards only the same count is accepted."""
    from zoo.train.launch import set_cpu_devices
    set_cpu_devices(n, what="devices={}", fix=f"call zoo.train.rehearse.set_virtual_devices({n}) "
                    f"(or pass --devices {n}) before anything touches a device, e.g. first "
                    f"thing in the script")


# -- the rehearsal -----------------------------------------------------------------------------

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What compiling one train step for a mesh tells: all byte figures are per device."""

    label: str
    devices: int
    mesh: str
    strategy: str
    batch_size: int
    seq_len: int
    dtype: str
    param_dtype: str
    remat: str | None
    compile_s: float
    hlo_instructions: int
    param_bytes: int               # from the parameters' shardings
    optimizer_bytes: int           # from the optimizer state's shardings
    argument_bytes: int            # XLA memory analysis (params + optimizer + batch)
    output_bytes: int
    alias_bytes: int               # outputs that reuse donated arguments
    temp_bytes: int                # XLA memory analysis: everything live inside the step
    hlo_flops: float               # per device, dots + convolutions, loops x trip counts
    model_flops: float             # per device: flops_per_token(seq_len) * tokens / devices
    xla_flops: float               # XLA's cost analysis (a while body counted once)
    collective_bytes: dict[str, float]
    dots_by_dtype: dict[str, int]  # dot ops of the lowered program by operand dtype
    dot_names: dict[str, list[str]]  # dtype -> the dots' op names (named scopes)
    target: str = "cpu"            # the platform compiled for (`zoo.targets`)
    device_kind: str = ""          # e.g. "TPU v5" (v5p)
    hbm_bytes: int | None = None   # the device's memory, where known (`zoo.targets.hbm_bytes`)
    oom: bool = False              # the compiler refused the program: out of device memory
    custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)  # compiled program
    step: str = "train"            # "train", or "decode": one token per row (`rehearse_decode`)
    cache_bytes: int = 0           # decode: the KV cache's shards (from its shardings)
    # GPU targets: the part of collective_bytes whose device groups span hosts (the network)
    cross_host_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    fp8: str | None = None         # the model's ``fp8`` mode: "blockwise" (FP8 GEMMs) or None
    # the temporaries live at their peak, grouped by named scope (`zoo.targets.PeakBreakdown`),
    # when asked for (``breakdown=True``: the compiler's buffer assignment, more compile time)
    peak_breakdown: Any = None

    @property
    def device_memory_bytes(self) -> int | None:
        """The target device's memory (HBM on TPU and GPU), None where unknown (CPU)."""
        return self.hbm_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the step fits the device's memory (None: capacity unknown, e.g. CPU)."""
        if self.oom:
            return False
        return None if self.hbm_bytes is None else self.peak_bytes <= self.hbm_bytes

    @property
    def peak_bytes(self) -> int:
        """Arguments + temporaries + outputs not aliased to a donated argument."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def flops_ratio(self) -> float:
        return self.hlo_flops / self.model_flops if self.model_flops else float("nan")

    @property
    def tokens_per_device(self) -> float:
        """Tokens one device processes a step: a train step's batch x sequence, a decode
        step's one token per row, over the devices."""
        rows = self.batch_size * (1 if self.step == "decode" else self.seq_len)
        return rows / self.devices

    def roofline(self) -> dict[str, Any] | None:
        """A lower bound on the step's time from this report's own counts and the target
        chip's published peaks (`zoo.targets.chip`; None where none is known, e.g. CPU, or for a
        program the compiler refused): the larger of compute -- the program's dot FLOPs
        (custom-call kernels' are not counted, so at least the model's) at the chip's peak:
        its FP8 peak for a program built with ``fp8="blockwise"`` on a chip that has one (every
        dot counted as FP8, which keeps it a bound), else the bf16 peak; ``peak`` says which,
        and ``mfu`` is against that peak -- and collectives -- each kind's bytes per device at
        the chip's whole ICI bandwidth (GPUs: NVLink within a host, and the bytes of
        collectives whose groups span hosts at the network's), as if every link carried data
        all the step. Perfect overlap, no HBM or launch cost: a real step is slower, so a
        measured MFU above ``mfu`` here, or tokens/s above ``tokens_per_s``, would be a bug in
        it."""
        from zoo.targets import chip
        c = chip(self.device_kind)
        if c is None or self.oom:  # a refused program's counts are not a device's
            return None
        fp8 = self.fp8 == "blockwise" and c.fp8_peak_flops is not None
        peak_flops = c.fp8_peak_flops if fp8 else c.peak_flops
        compute_s = max(self.hlo_flops, self.model_flops) / peak_flops
        cross = self.cross_host_bytes if c.network_bytes_per_s else {}
        collective_s = {k: (v - cross.get(k, 0.0)) / c.ici_bytes_per_s +
                        cross.get(k, 0.0) / (c.network_bytes_per_s or 1.0)
                        for k, v in self.collective_bytes.items()}
        bound_s = max(compute_s, sum(collective_s.values()))
        return dict(bound_s=bound_s, compute_s=compute_s, collective_s=collective_s,
                    bound_by="compute" if bound_s == compute_s else "collectives",
                    mfu=self.model_flops / (bound_s * peak_flops) if bound_s else 0.0,
                    tokens_per_s=self.tokens_per_device / bound_s if bound_s else 0.0,
                    peak="fp8" if fp8 else "bf16", peak_flops=peak_flops,
                    peak_note=self._peak_note(fp8), ici_bytes_per_s=c.ici_bytes_per_s,
                    links="ICI" if c.network_bytes_per_s is None else
                    f"NVLink, {c.network_bytes_per_s / 1e9:,.0f} GB/s between hosts")

    def _peak_note(self, fp8: bool) -> str:
        """Which peak `roofline` used, and why not FP8's for an FP8 program."""
        if fp8:
            return "FP8 peak"
        if self.fp8 == "blockwise":
            return f"bf16 peak: {self.device_kind} has no published FP8 peak"
        return "bf16 peak"

    def fp32_dots(self, allowed: tuple[str, ...] = ("router", "loss")) -> list[str]:
        """Op names of f32 dots outside the scopes where fp32 is intended (router, loss)."""
        return [n for n in self.dot_names.get("f32", []) if not any(a in n for a in allowed)]

    def row(self) -> dict[str, Any]:
        """The README table's columns (a decode step's: `DECODE_COLUMNS`)."""
        if self.step == "decode":
            return self._decode_row()
        out = {"model": self.label, "target": self.device_kind or self.target,
               "devices": self.devices, "mesh": self.mesh,
               "strategy": self.strategy, "batch x seq": f"{self.batch_size} x {self.seq_len}",
               "dtype": f"{self.param_dtype}/{self.dtype}", "remat": self.remat or "none",
               "params GiB": self.param_bytes / GiB, "opt GiB": self.optimizer_bytes / GiB,
               "temp GiB": self.temp_bytes / GiB, "peak GiB": self.peak_bytes / GiB,
               "compile s": self.compile_s, "HLO ops": self.hlo_instructions,
               "HLO/model FLOPs": self.flops_ratio,
               "fits": {True: "yes", False: "no", None: "?"}[self.fits]}
        out.update({f"{k} GB": v / 1e9 for k, v in self.collective_bytes.items()})
        return self._unpartitioned_marked(out)

    def _unpartitioned_marked(self, out: dict[str, Any]) -> dict[str, Any]:
        """`out` with the FLOPs and collective columns "-" when the compiler refused the
        program (out of memory): they would be the unpartitioned lowered program's figures,
        not a device's."""
        if not self.oom:
            return out
        return {k: "-" if k == "HLO/model FLOPs" or k.endswith(" GB") else v
                for k, v in out.items()}

    def _decode_row(self) -> dict[str, Any]:
        out = {"model": self.label, "target": self.device_kind or self.target,
               "devices": self.devices, "mesh": self.mesh, "strategy": self.strategy,
               "batch x context": f"{self.batch_size} x {self.seq_len}",
               "dtype": f"{self.param_dtype}/{self.dtype}",
               "params GiB": self.param_bytes / GiB, "cache GiB": self.cache_bytes / GiB,
               "arguments GiB": self.argument_bytes / GiB, "temp GiB": self.temp_bytes / GiB,
               "peak GiB": self.peak_bytes / GiB, "compile s": self.compile_s,
               "HLO ops": self.hlo_instructions, "HLO/model FLOPs": self.flops_ratio,
               "fits": {True: "yes", False: "no", None: "?"}[self.fits]}
        out.update({f"{k} GB": v / 1e9 for k, v in self.collective_bytes.items()})
        return self._unpartitioned_marked(out)

    def __str__(self) -> str:
        if self.step == "decode":
            head = (f"decode rehearsal: {self.label} on {self.devices} "
                    f"{self.device_kind or self.target} devices, mesh {self.mesh}, strategy "
                    f"{self.strategy}, batch {self.batch_size}, cache of {self.seq_len} slots, "
                    f"params {self.param_dtype}, compute {self.dtype}")
            state = (f"parameters {self.param_bytes / GiB:.2f} GiB, cache "
                     f"{self.cache_bytes / GiB:.2f} GiB (donated)")
        else:
            head = (f"rehearsal: {self.label} on {self.devices} "
                    f"{self.device_kind or self.target} devices, mesh {self.mesh}, strategy "
                    f"{self.strategy}, batch {self.batch_size} x {self.seq_len}, params "
                    f"{self.param_dtype}, compute {self.dtype}, remat {self.remat}")
            state = (f"parameters {self.param_bytes / GiB:.2f} GiB, optimizer "
                     f"{self.optimizer_bytes / GiB:.2f} GiB")
        lines = [head]
        lines.append(f"  compile {self.compile_s:.1f} s, {self.hlo_instructions:,} HLO "
                     f"instructions")
        verdict = "fits" if self.fits else "does NOT fit" + (
            " (compiler: out of memory)" if self.oom else "")
        lines.append(f"  per device: {state}, temporaries "
                     f"{self.temp_bytes / GiB:.2f} GiB; arguments + temporaries + outputs "
                     f"{self.peak_bytes / GiB:.2f} GiB" + (
                         "" if self.hbm_bytes is None else
                         f" of {self.hbm_bytes / GiB:.2f} GiB: {verdict}"))
        if self.oom:
            lines.append("  (the compiler refused the program: the FLOPs and collectives "
                         "below are the unpartitioned lowered program's, not per device)")
        lines.append(f"  FLOPs per device per step: HLO {self.hlo_flops:.4g}, model "
                     f"{self.model_flops:.4g} (ratio {self.flops_ratio:.3f}); XLA cost "
                     f"analysis {self.xla_flops:.4g}")
        lines.append("  collectives per device per step: " + ", ".join(
            f"{k} {v / 1e9:.2f} GB" for k, v in self.collective_bytes.items()))
        lines.append("  dots by operand dtype: " + ", ".join(
            f"{k} {v}" for k, v in self.dots_by_dtype.items()))
        bound = self.roofline()
        if bound is not None:
            lines.append(
                f"  roofline BOUND (not a measurement): step >= {bound['bound_s'] * 1e3:,.1f} "
                f"ms ({bound['bound_by']}-bound: compute {bound['compute_s'] * 1e3:,.1f} ms at "
                f"{bound['peak_flops'] / 1e12:,.0f} TFLOP/s ({bound['peak_note']}), collectives "
                f"{sum(bound['collective_s'].values()) * 1e3:,.1f} ms at "
                f"{bound['ici_bytes_per_s'] / 1e9:,.0f} GB/s {bound['links']}); at the bound MFU "
                f"{bound['mfu']:.1%}, {bound['tokens_per_s']:,.0f} tokens/s per device")
        return "\n".join(lines)


def sharded_bytes(tree) -> int:
    """Bytes per device of the arrays (or `jax.ShapeDtypeStruct` s) in `tree`, from their
    shardings (a leaf without one counts whole)."""
    import jax
    total = 0
    for x in jax.tree.leaves(tree):
        shape = tuple(getattr(x, "shape", ()))
        sharding = getattr(x, "sharding", None)
        local = sharding.shard_shape(shape) if sharding is not None else shape
        total += math.prod(local) * x.dtype.itemsize
    return int(total)


def rehearse_step(*, make_model: Callable[[], Any], tx: Any, partitioner: Any,
                  batch_size: int, seq_len: int, aux_loss_weight: float = 0.0,
                  expert_bias_rate: float = 0.0, flops_per_token: float | None = None,
                  label: str = "model", mesh_text: str = "", remat: str | None = None,
                  dtype: Any = None, param_dtype: Any = None,
                  train_step: Callable | None = None, fp8: str | None = None,
                  breakdown: bool = False) -> Rehearsal:
    """Compile a train step (`train_step`, default `make_train_step(donate=True)` with the
    given weights) for `partitioner`'s mesh from abstract state and measure it; see the
    module docstring. ``fp8``: the model's FP8 mode, for the roofline's peak; ``breakdown``:
    also read the compiler's buffer assignment (`Rehearsal.peak_breakdown`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from zoo.ops.fp8 import check_mode
    from zoo.train import step as step_lib

    mesh = partitioner.mesh
    if train_step is None:
        train_step = step_lib.make_train_step(aux_loss_weight=aux_loss_weight,
                                              expert_bias_rate=expert_bias_rate, donate=True)
    model, optimizer = step_lib.abstract_state(make_model, tx, mesh)
    sharding = partitioner.sharding(("batch", "length"))
    dtypes = dict(inputs=jnp.int32, targets=jnp.int32, positions=jnp.int32,
                  segment_ids=jnp.int32, loss_weights=jnp.float32)
    batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), dtypes[k], sharding=sharding)
             for k in step_lib.BATCH_KEYS}
    lr = jax.ShapeDtypeStruct((), jnp.float32)
    param_b, opt_b = sharded_bytes(nnx.state(model)), sharded_bytes(nnx.state(optimizer))
    return measure(
        lambda: train_step.lower(model, optimizer, batch, lr), partitioner,
        state_bytes=param_b + opt_b, label=label, mesh=mesh_text, strategy=partitioner.strategy,
        batch_size=batch_size, seq_len=seq_len, dtype=dtype_name(dtype),
        param_dtype=dtype_name(param_dtype), remat=remat, param_bytes=param_b,
        optimizer_bytes=opt_b, fp8=check_mode(fp8), breakdown=breakdown,
        model_flops=(flops_per_token or 0.0) * batch_size * seq_len / mesh.devices.size)


def dtype_name(dtype: Any) -> str:
    """The dtype's name, ``"?"`` for None."""
    import numpy as np
    return np.dtype(dtype).name if dtype is not None else "?"


def measure(lower: Callable[[], Any], partitioner: Any, *, state_bytes: int,
            breakdown: bool = False, **fields: Any) -> Rehearsal:
    """Lower (``lower()``) and compile a program for `partitioner`'s mesh and read what the
    compiler says into a `Rehearsal` (`fields`: the ones that describe the program; compile
    seconds include the lowering). ``state_bytes``: the arguments' bytes from their shardings,
    reported when the compiler refuses the program for lack of memory. ``breakdown``: compile
    with the buffer-assignment dump and group the peak's temporaries
    (`zoo.targets.compile_with_buffers`; None when the compiler refuses the program)."""
    import jax
    start = time.perf_counter()
    mesh = partitioner.mesh
    # GPUs: which host each partition is on, to split off the collectives between hosts
    hosts = [d.process_index for d in mesh.devices.flat] if partitioner.platform == "gpu" \
        else None
    # lowered with the target's device as the default one: Pallas' Mosaic lowering reads the
    # TPU generation there (a mask's integer division in zoo's attention kernel, for one)
    target = partitioner.target_device
    with (jax.default_device(target) if target is not None else contextlib.nullcontext()):
        lowered = lower()
    lowered_stats = hlo_stats(lowered.as_text(dialect="hlo", debug_info=True), hosts)
    compiled, text, mem, oom, peak = _compile(lowered, partitioner.platform, breakdown)
    compile_s = time.perf_counter() - start
    stats = hlo_stats(text, hosts) if compiled is not None else lowered_stats
    cost = compiled.cost_analysis() if compiled is not None else None
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    kind = str(getattr(mesh.devices.flat[0], "device_kind", ""))
    from zoo.targets import hbm_bytes
    return Rehearsal(
        target=partitioner.platform, device_kind=kind,
        hbm_bytes=hbm_bytes(kind) if partitioner.platform != "cpu" else None, oom=oom,
        cross_host_bytes=dict(stats.cross_host_bytes) if hosts else {},
        custom_calls=_custom_calls(text) if compiled is not None else {},
        devices=int(mesh.devices.size), compile_s=compile_s,
        hlo_instructions=stats.instructions,
        # refused (out of memory): the arguments are at least the state's shards
        argument_bytes=int(mem.argument_size_in_bytes) or state_bytes,
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
        hlo_flops=stats.flops, xla_flops=float((cost or {}).get("flops", 0.0)),
        collective_bytes=stats.collective_bytes, dots_by_dtype=lowered_stats.dots_by_dtype,
        dot_names=lowered_stats.dot_names, peak_breakdown=peak, **fields)


@dataclasses.dataclass(frozen=True)
class _Memory:  # the figures of a program the compiler refused (out of device memory)
    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int


def _compile(lowered, platform: str, breakdown: bool = False):
    """``(compiled or None, its HLO text, memory analysis, out of memory?, the peak's
    breakdown or None)``: a TPU out-of-memory refusal is a result (temporaries from the
    compiler's message), any other error propagates."""
    from zoo.targets import compile_with_buffers, compile_with_text, out_of_memory
    peak = None
    try:
        if breakdown:
            compiled, text, peak = compile_with_buffers(lowered, platform)
        else:
            compiled, text = compile_with_text(lowered, platform)
    except Exception as e:
        oom = out_of_memory(e)
        if oom is None:
            raise
        return None, "", _Memory(0, 0, 0, oom[0]), True, None
    return compiled, text, compiled.memory_analysis(), False, peak


_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def _custom_calls(text: str) -> dict[str, int]:
    """Custom-call targets of a compiled program's HLO, counted (kernels, e.g. Mosaic's
    ``tpu_custom_call``; loop bodies counted once)."""
    out: dict[str, int] = {}
    for name in _CUSTOM_CALL.findall(text):
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def rehearse_built(built: Any, *, label: str = "model", breakdown: bool = False) -> Rehearsal:
    """Compile and measure the train step of a `zoo.train.build` result (built with
    ``donate=True``: the program an accelerator run compiles); ``breakdown``: see
    `rehearse_step`."""
    c, cfg = built.config, built.model_config
    return rehearse_step(make_model=built.make_model, tx=built.tx,
                         partitioner=built.partitioner, batch_size=c.batch_size,
                         seq_len=c.seq_len, flops_per_token=built.flops_per_token, label=label,
                         mesh_text=c.mesh, remat=cfg.remat_policy, dtype=cfg.dtype,
                         param_dtype=cfg.param_dtype, train_step=built.train_step,
                         fp8=cfg.fp8, breakdown=breakdown)


def presets() -> tuple[str, ...]:
    """Every preset `rehearse` takes by name: the registered families' presets, read from
    `zoo.models.registry` so a new family's presets are listed without naming it here."""
    from zoo.models import registry
    return tuple(registry.preset_names())


def model_config(model: str | Any) -> tuple[str, Any]:
    """``(label, config)`` of `rehearse`'s `model`: a preset name (one of `presets()`) or a
    registered family's config; anything else is refused with the valid names."""
    from zoo.models import registry
    if isinstance(model, str):
        return model, registry.resolve(model)[1]
    registry.family_of(model)  # a config no family takes is refused here
    return type(model).__name__, model


def __getattr__(name: str) -> Any:
    if name == "PRESETS":  # computed on access: the families register when zoo.models loads
        return presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_KEEP = object()


def rehearse(model: str | Any, *, mesh: str | Mapping[str, int] | None = None,
             strategy: str = "fsdp", batch_size: int, seq_len: int, dtype: Any = "bfloat16",
             param_dtype: Any = "float32", remat: Any = _KEEP,
             overrides: Mapping[str, Any] | Sequence[str] | None = None,
             aux_loss_weight: float | None = None,
             expert_bias_rate: float | None = None, target: str = "cpu",
             breakdown: bool = False) -> Rehearsal:
    """Rehearse a preset (a name of `zoo.models.registry.preset_names`) or a model config at
    scale, through `zoo.train.build`; see the module docstring.

    Args:
      model: a preset name or a registered family's config.
      mesh: ``"fsdp=4,expert=64"`` or a dict of axis sizes (default: fsdp over every device);
        the product must equal the device count (`set_virtual_devices` first).
      strategy: ``"fsdp"``, ``"cp"`` or ``"ep_as_cp"``.
      batch_size, seq_len: the global batch.
      dtype, param_dtype: compute and parameter dtypes (the model config's ``dtype`` and
        ``param_dtype``, set after `overrides`).
      remat: a `remat_policy` name or None (default: the config's).
      overrides: other config fields, e.g. ``{"num_hidden_layers": 4}``, or ``--set`` texts
        (``["num_hidden_layers=4"]``), parsed from the field types as the recipes parse them.
      aux_loss_weight, expert_bias_rate: default `zoo.train.TrainConfig`'s (the config's aux
        weight; DeepSeek-V3's bias rate, ignored by models without a bias).
      target: ``"cpu"`` (this host's devices), ``"cpu-N"``, or a TPU slice such as
        ``"tpu-v5p-256"`` / ``"tpu:v5p:4x8x8"`` (`zoo.targets.target_devices`): compiled by
        the TPU compiler here, with its memory verdict.
      breakdown: also dump and read the compiler's buffer assignment: the temporaries live at
        their peak, grouped by named scope (`Rehearsal.peak_breakdown`; more compile time).
    """
    label, built = build_for_rehearsal(
        model, mesh=mesh, strategy=strategy, batch_size=batch_size, seq_len=seq_len,
        dtype=dtype, param_dtype=param_dtype, remat=remat, overrides=overrides,
        aux_loss_weight=aux_loss_weight, expert_bias_rate=expert_bias_rate, target=target)
    return rehearse_built(built, label=label, breakdown=breakdown)


def build_for_rehearsal(model: str | Any, *, mesh, strategy: str, batch_size: int,
                        seq_len: int, dtype: Any, param_dtype: Any, remat: Any = _KEEP,
                        overrides=None, aux_loss_weight=None, expert_bias_rate=None,
                        target: str = "cpu"):
    """``(label, zoo.train.build result)`` of `rehearse`'s arguments (``donate=True``, no
    data), on `target`'s devices."""
    import jax.numpy as jnp

    from zoo.train.build import build
    from zoo.train.config import TrainConfig

    label, config = model_config(model)
    texts = () if overrides is None or isinstance(overrides, Mapping) else tuple(overrides)
    changes = dict(overrides) if isinstance(overrides, Mapping) else {}
    if remat is not _KEEP:
        changes["remat_policy"] = remat
    config = dataclasses.replace(config, **changes) if changes else config
    from zoo.targets import target_devices
    devices = target_devices(target)
    mesh = mesh or {"fsdp": len(devices)}
    mesh_text = mesh if isinstance(mesh, str) else ",".join(f"{k}={v}" for k, v in mesh.items())
    bias = {} if expert_bias_rate is None else {"expert_bias_rate": expert_bias_rate}
    # the dtypes are model config fields, set as --dtype/--param-dtype set them (after the
    # other overrides, so they win)
    texts += (f"dtype={jnp.dtype(dtype).name}", f"param_dtype={jnp.dtype(param_dtype).name}")
    train = TrainConfig(mesh=mesh_text, strategy=strategy, batch_size=batch_size,
                        seq_len=seq_len, overrides=texts, aux_loss_weight=aux_loss_weight,
                        rehearse=True, **bias)
    return label, build(train, model_config=config, with_data=False, donate=True,
                        devices=devices)
