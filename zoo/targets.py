"""Compile targets: the devices a program is compiled for, which need not be this host's.

The TPU compiler ships in libtpu (``libtpu==0.0.52``, MaxText 0.2.5's, in the
``tpu-compile`` and ``test`` extras) and runs on a CPU-only host:
`jax.experimental.topologies` describes a slice's chips without owning any, a mesh over those
descriptions lowers and compiles for them, and XLA's memory analysis (or its out-of-memory
error) is the TPU's. `zoo.train.rehearse.rehearse` takes
``target=`` and compiles the train step this way; every program choice zoo makes follows the
mesh's platform (`zoo.partitioning.mesh_platform`), so this is the program a run on that
slice builds.

* `target_devices(target)` -- ``"cpu"`` (this host's devices), ``"cpu-N"`` (N of them) or a
  TPU slice by chips, ``"tpu-v5p-256"`` (256 chips: what Cloud and MaxText call v5p-512;
  ``"tpu-v5p-128x2"`` is two slices of 128), or by chip grid, ``"tpu:v5p:4x8x8"``, as a list
  of device descriptions; or ``"h100-N"`` / ``"h200-N"``, N GPUs of 8 a host (fewer than 8:
  one host), compiled by XLA's GPU compiler from a description of the chip (`gpu_target_config`;
  the ``gpu-compile`` extra, ``jax[cuda12]``, brings it: no GPU or driver needed).
* `configure_process()` -- the environment libtpu needs on a host without TPUs (called by
  `target_devices`): no metadata-server query, several processes may load it (test workers,
  subprocesses), and jax's own platform stays the CPU.
* `cpu_unless_accelerator()` -- with the TPU compiler installed on a host that has no TPU
  (the ``test`` extra on a CPU box), jax starts on its CPU quietly rather than probing libtpu
  first; `import zoo` calls it.
* `quiet_cuda_stub()` -- around an import that loads the CUDA plugin's libraries on a host
  without a GPU (`import zoo` imports jax inside it): drops their "Could not find cuda
  drivers" lines from stderr and passes everything else through.
* `compile_with_text(lowered, platform)` -- the compiled program and its optimized HLO text;
  a TPU program's text is the compiler's own dump (jaxlib 0.10 cannot read libtpu 0.0.52's).
* `compile_with_buffers(lowered, platform)` -- the same, with the compiler's buffer assignment
  dumped and read by `peak_breakdown`: the temporaries live at their peak, grouped by named
  scope (`scope_group`: fwd/bwd, the layer's sublayer, ``[scan carry]``), with bytes, counts
  and shapes (`PeakBreakdown`); ``benchmarks/targets.py --breakdown N`` prints it.
* `hbm_bytes(device_kind)` -- a chip's memory as its compiler counts it (the TPU's
  out-of-memory message; a GPU's description), None when not known; `chip(device_kind)` its
  published peaks (bf16 and, where the chip has it, FP8 FLOP/s, ICI or NVLink, the network
  between GPU hosts, HBM bytes/s),
  which `Rehearsal.roofline` bounds a step with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["CHIPS", "Chip", "GPUS", "Target", "parse", "target_devices", "configure_process",
           "chip", "compile_with_text", "wraparound", "cpu_unless_accelerator", "gpu_target_config",
           "compile_with_buffers", "peak_breakdown", "scope_group", "PeakBreakdown", "PeakBuffer",
           "hbm_bytes", "TPU_CHIPS", "quiet_cuda_stub"]

# generation -> chip config name of `get_topology_desc` (megacore chips: one device per chip)
TPU_CHIPS = {"v4": "megacore", "v5p": "megacore", "v5e": "default", "v6e": "default"}
GiB = 2 ** 30
# per-device memory the TPU compiler allows (its RESOURCE_EXHAUSTED message: "available HBM")
_HBM = {"TPU v4": 32 * GiB, "TPU v5": 95.74 * GiB, "TPU v5 lite": 15.75 * GiB,
        "TPU v6 lite": 31.25 * GiB}


def configure_process() -> None:
    """Environment for libtpu on a host without TPUs (set only where not already set)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


@dataclasses.dataclass(frozen=True)
class Chip:
    """A chip's published peaks, per chip: dense bf16 FLOP/s, bidirectional inter-chip bytes/s
    (a TPU's ICI; a GPU's NVLink, within its host), HBM bytes/s, for GPUs the network's
    bidirectional bytes/s between hosts (one 400 Gb/s NIC a GPU), and dense FP8 FLOP/s (None
    where none is published: FP8 products then run at `peak_flops` at best)."""
    peak_flops: float
    ici_bytes_per_s: float
    hbm_bytes_per_s: float
    network_bytes_per_s: float | None = None
    fp8_peak_flops: float | None = None


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What XLA's GPU compiler needs to know of a GPU (`gpu_target_config`) and its peaks."""
    device_kind: str
    memory_bytes: int
    hbm_bytes_per_s: int
    chip: Chip


# H100 SXM and H200 SXM (NVIDIA's datasheets): 989 TFLOP/s dense bf16, 1,979 dense FP8 (the
# datasheets' 3,958 is with 2:4 sparsity), NVLink 4 at 900 GB/s
GPUS = {"h100": Gpu("NVIDIA H100 80GB HBM3", 84_929_347_584, 3_352_320_000_000,
                    Chip(989e12, 900e9, 3352e9, 100e9, fp8_peak_flops=1979e12)),
        "h200": Gpu("NVIDIA H200", 150_754_820_096, 4_800_000_000_000,
                    Chip(989e12, 900e9, 4800e9, 100e9, fp8_peak_flops=1979e12))}
GPUS_PER_HOST = 8

# by jax's device_kind; v4's ICI is not stated per chip in the same terms, so it has no entry.
# No FP8 peak: v5p and v5e have no FP8 matrix unit; for v6e Google publishes bf16 (918 TFLOP/s)
# and int8 (1,836 TOP/s) peaks, none for FP8 (docs.cloud.google.com/tpu/docs/v6e)
CHIPS = {"TPU v5": Chip(459e12, 1200e9, 2765e9),        # v5p
         "TPU v5 lite": Chip(197e12, 400e9, 819e9),     # v5e
         "TPU v6 lite": Chip(918e12, 800e9, 1638e9),    # v6e (Trillium)
         **{g.device_kind: g.chip for g in GPUS.values()}}


def chip(device_kind: str) -> Chip | None:
    """The published peaks of a device kind (`CHIPS`), None if not known (CPU, v4)."""
    return CHIPS.get(device_kind)


def cpu_unless_accelerator() -> None:
    """Start jax on its CPU when the TPU or GPU compiler is installed on a host with no TPU
    chip and no GPU, unless platforms were named (``JAX_PLATFORMS`` or ``jax_platforms``).
    jax would otherwise try libtpu's TPU backend and the CUDA plugin first, which print
    warnings (no accelerator type, no worker hostnames, no CUDA) before falling back to the
    CPU.
    `import zoo` calls it; it changes nothing once a backend has started, and nothing on a
    TPU or GPU host."""
    import importlib.util

    import jax

    from zoo import _jax_compat
    named = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or ""
    gpu_plugins = [m for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                               "jax_rocm7_plugin") if importlib.util.find_spec(m) is not None]
    # the GPU compiler alone (`gpu-compile`) on a host without a GPU counts as no accelerator:
    # it loads when a GPU target is named (`target_devices`), not in every process
    if gpu_plugins and not _gpu_present() and not {"cuda", "gpu"} & set(named.split(",")):
        _jax_compat.defer_gpu_compiler()
    if named or (gpu_plugins and _gpu_present()):
        return
    if (importlib.util.find_spec("libtpu") is None and not gpu_plugins) or _tpu_chips():
        return
    if not _jax_compat.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


# what the CUDA plugin's libraries print when they load on a host without CUDA's runtime
# (each carries its own copy of XLA's ``cudart_stub.cc`` and of absl's logging, so the pair
# comes once per library: three from `import jax`, one more when the GPU compiler loads)
_CUDA_STUB_LINE = re.compile(rb"cudart_stub\.cc:\d+\] Could not find cuda drivers")
_ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written"


@contextlib.contextmanager
def quiet_cuda_stub() -> Iterator[None]:
    """Run the body with this process's stderr (file descriptor 2) caught, then write back
    all of it except the CUDA plugin's "Could not find cuda drivers" lines and the absl
    notice before each. Those lines are printed by native code while jax imports the plugin's
    kernel libraries (no environment variable or log level reaches them: absl's logging is
    not initialised yet), and say nothing true on a host that only compiles for GPUs.

    Filters only where the lines are noise: a CUDA plugin installed, no GPU on this host
    (`_gpu_present`), and no GPU platform named in ``JAX_PLATFORMS``. Elsewhere, or when
    stderr has no file descriptor, the body runs untouched."""
    import importlib.util
    named = set(os.environ.get("JAX_PLATFORMS", "").split(","))
    plugin = any(importlib.util.find_spec(m) is not None
                 for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    saved = None
    if plugin and not _gpu_present() and not {"cuda", "gpu"} & named:
        try:
            if sys.stderr is not None:
                sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            saved = None
    if saved is None:
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            try:
                if sys.stderr is not None:
                    sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            _write_fd(2, _without_stub_lines(caught.read()))


def _without_stub_lines(text: bytes) -> bytes:
    lines = text.splitlines(keepends=True)
    keep = []
    for i, line in enumerate(lines):
        stub = _CUDA_STUB_LINE.search(line)
        notice = line.startswith(_ABSL_PREAMBLE) and i + 1 < len(lines) \
            and _CUDA_STUB_LINE.search(lines[i + 1])
        if not (stub or notice):
            keep.append(line)
    return b"".join(keep)


def _write_fd(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _gpu_present() -> bool:
    """A GPU driver's device files on this host (NVIDIA's, or AMD's ``/dev/kfd``)."""
    import glob
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/nvidiactl")
                or os.path.exists("/dev/kfd"))


def _tpu_chips() -> int:
    """TPU chips attached to this host (PCI devices of Google's vendor id, as jax counts)."""
    from zoo import _jax_compat
    chips = _jax_compat.tpu_chips_on_host()
    if chips is None:  # a jax without the helper: look for the TPU device files instead
        import glob
        return len(glob.glob("/dev/accel*")) + len(glob.glob("/dev/vfio/[0-9]*"))
    return chips


# chips -> the chip grid of a slice of that many, as Cloud TPU names its slices (v5p-512 is
# 4x8x8): 3-D for v4/v5p, 2-D for v5e/v6e
_GRIDS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
             256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_GRIDS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}
_FORMS = ("'cpu' or 'cpu-N' (N of this host's devices), a TPU slice by chips 'tpu-v5p-256' "
          "(multi-slice 'tpu-v5p-128x2'; generations v5p, v5e, v6e, v4) or by grid "
          "'tpu:v5p:4x8x8', or GPUs 'h100-N' / 'h200-N'")


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target: ``platform`` ("cpu", "tpu", "gpu"), the TPU ``generation`` and chip
    ``grid`` of one slice, ``slices``, and ``count`` (devices named, None for all of "cpu")."""
    platform: str
    generation: str | None = None
    grid: str | None = None
    slices: int = 1
    count: int | None = None


def _tpu_grid(gen: str, chips: int, target: str) -> str:
    grids = _GRIDS_2D if gen in ("v5e", "v6e") else _GRIDS_3D
    if chips not in grids:
        raise ValueError(f"target={target!r}: a {gen} slice of {chips} chips has no standard "
                         f"grid; chips per slice must be one of {sorted(grids)} (or name the "
                         f"grid, e.g. 'tpu:{gen}:{grids[8]}')")
    return grids[chips]


def wraparound(generation: str, grid: str) -> tuple[bool, bool, bool]:
    """Which axes of a slice's chip grid close into a ring, as on the real slice: a v4/v5p
    slice whose every side is a multiple of 4 (4x4x4 and up) is a 3-D torus, a smaller one
    an open grid; a v5e/v6e side wraps where it spans the whole 16-chip pod edge.

    The compiler plans collectives on these links: without them it cannot run an all-gather
    over a whole 256-chip v5p slice and builds it from a zero-padded all-reduce instead
    (twice the bytes, and more code to compile)."""
    dims = [int(d) for d in grid.split("x")]
    if generation in ("v5e", "v6e"):
        return (*(d == 16 for d in dims), False, False)[:3]
    torus = all(d % 4 == 0 for d in dims)
    return (torus,) * 3


def parse(target: str) -> Target:
    """The `Target` a target text names (forms: `_FORMS`); ValueError naming the forms."""
    text = target.strip().lower()
    if text == "cpu":
        return Target("cpu")
    if m := re.fullmatch(r"cpu-(\d+)", text):
        return Target("cpu", count=int(m.group(1)))
    if m := re.fullmatch(r"(h100|h200)-(\d+)", text):
        return Target("gpu", generation=m.group(1), count=int(m.group(2)))
    if m := re.fullmatch(r"tpu-(v\d+[a-z]*)-(\d+)(?:x(\d+))?", text):
        gen, chips, slices = m.group(1), int(m.group(2)), int(m.group(3) or 1)
        if gen in TPU_CHIPS:
            return Target("tpu", gen, _tpu_grid(gen, chips, target), slices, chips * slices)
    m = re.fullmatch(r"(?:tpu:)?(v\d+[a-z]*):(\d+(?:x\d+)+)", text)
    if m is None or m.group(1) not in TPU_CHIPS:
        raise ValueError(f"target={target!r}: expected {_FORMS}; TPU generations are "
                         f"{sorted(TPU_CHIPS)}, e.g. 'tpu-v5p-256' or 'tpu:v5p:4x8x8'")
    chips = 1
    for n in m.group(2).split("x"):
        chips *= int(n)
    return Target("tpu", m.group(1), m.group(2), 1, chips)


def _cpu_devices(t: Target, target: str) -> list[Any]:
    import jax
    devices = list(jax.devices())
    if t.count is None:
        return devices
    if not 0 < t.count <= len(devices):
        raise ValueError(f"target={target!r}: this process has {len(devices)} CPU devices; "
                         f"set XLA_FLAGS=--xla_force_host_platform_device_count={t.count} "
                         f"before jax starts (the recipes' --devices does)")
    return devices[:t.count]


def gpu_target_config(generation: str) -> str:
    """The ``GpuTargetConfigProto`` text XLA's GPU compiler compiles for (`GPUS`): a Hopper
    (compute capability 9.0) of 132 cores with the generation's memory and bandwidth, CUDA
    12.8 and cuDNN 9.7 (the versions of the ``gpu-compile`` extra's wheels)."""
    g = GPUS[generation]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {g.hbm_bytes_per_s} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {g.memory_bytes}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
runtime_version {{ major: 12 minor: 8 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
device_description_str: "{g.device_kind}"
"""


def _gpu_devices(t: Target, target: str) -> list[Any]:
    import importlib.util
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        raise ValueError(f"target={target!r} needs XLA's GPU compiler: pip install -e "
                         f"'.[gpu-compile]' (jax[cuda12], about 5 GB with its CUDA wheels)")
    per_host = min(GPUS_PER_HOST, t.count)
    if t.count % per_host:
        raise ValueError(f"target={target!r}: {t.count} GPUs do not fill hosts of "
                         f"{GPUS_PER_HOST}; name a multiple of {GPUS_PER_HOST} (or fewer "
                         f"than {GPUS_PER_HOST}: one host)")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
    from zoo import _jax_compat
    with quiet_cuda_stub():
        _jax_compat.load_gpu_compiler()
    import jax
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=gpu_target_config(t.generation),
        topology=f"1x{t.count // per_host}x{per_host}")
    return list(topo.devices)


def target_devices(target: str) -> list[Any]:
    """The devices `target` names (see `parse`): this host's for ``"cpu"`` / ``"cpu-N"``, else
    the chips of a TPU slice described by libtpu, or GPUs described to XLA's GPU compiler
    (no TPU or GPU needed; raises with the install command when the compiler is missing)."""
    t = parse(target)
    if t.platform == "cpu":
        return _cpu_devices(t, target)
    if t.platform == "gpu":
        return _gpu_devices(t, target)
    configure_process()
    try:
        import libtpu  # noqa: F401  (the compiler; jax finds it by itself)
    except ImportError:
        raise ValueError(f"target={target!r} needs the TPU compiler: pip install -e "
                         f"'.[tpu-compile]' (libtpu)") from None
    from jax.experimental import topologies
    # libtpu's default host is 2x2 chips; a slice smaller than that (v5e/v6e's one chip) is
    # one host of its own size
    dims = (*(int(d) for d in t.grid.split("x")), 1, 1)[:3]
    host = {} if dims[0] >= 2 and dims[1] >= 2 else {"chips_per_host_bounds": dims}
    topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{t.generation}:{t.grid}",
                                        chip_config_name=TPU_CHIPS[t.generation],
                                        num_slices=t.slices, wrap=wraparound(t.generation, t.grid),
                                        **host)
    return list(topo.devices)


def hbm_bytes(device_kind: str) -> int | None:
    """Per-device memory of a TPU or GPU kind, as its compiler counts it; None if not
    known."""
    v = _HBM.get(device_kind)
    if v is None:
        v = next((g.memory_bytes for g in GPUS.values() if g.device_kind == device_kind), None)
    return None if v is None else int(v)


def compile_with_text(lowered: Any, platform: str) -> tuple[Any, str]:
    """``(compiled, the optimized HLO module's text)`` of a lowered program for `platform`
    (its mesh's, `zoo.partitioning.mesh_platform`); the compiler's errors propagate.

    The TPU compiler (libtpu) is newer than jaxlib's HLO reader: libtpu 0.0.52, the one
    MaxText 0.2.5 compiles with, writes ops (an ``async-update`` with several operands) that
    jaxlib 0.10's ``compiled.as_text()`` refuses, logging a stack trace as it does. So for TPU
    programs the compiler itself writes the text (XLA's dump options, into a folder removed
    afterwards, without the buffer-assignment analysis, which would add about 60 s to the
    DeepSeek-V3 goal row's 135 s compile) and that is what is returned."""
    if platform != "tpu":
        compiled = lowered.compile()
        return compiled, compiled.as_text()
    import glob
    import tempfile
    with tempfile.TemporaryDirectory(prefix="zoo-hlo-") as folder:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": folder, "xla_dump_hlo_as_text": True,
            "xla_dump_buffer_assignment_analysis": False})
        found = glob.glob(os.path.join(folder, "*.after_optimizations.txt"))
        if len(found) != 1:  # a compiler that ignored the dump options: jaxlib's reader
            return compiled, compiled.as_text()
        with open(found[0]) as f:
            return compiled, f.read()


def compile_with_buffers(lowered: Any, platform: str, *, depth: int = 4
                         ) -> tuple[Any, str, PeakBreakdown]:
    """``(compiled, the optimized HLO module's text, its peak temporaries grouped)``: like
    `compile_with_text`, with the compiler's buffer assignment dumped and read by
    `peak_breakdown` (``depth``: named scopes a group keeps). The analysis costs compile time
    (about 60 s on a full-size TPU train step), which is why `compile_with_text` does not."""
    import glob
    import tempfile
    with tempfile.TemporaryDirectory(prefix="zoo-buffers-") as folder:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": folder, "xla_dump_hlo_as_text": True,
            "xla_dump_buffer_assignment_analysis": True})

        def one(suffix: str) -> str:
            found = [f for f in glob.glob(os.path.join(folder, f"*{suffix}"))
                     if "after_optimizations" in f]
            if len(found) != 1:
                raise ValueError(f"the {platform} compiler wrote {len(found)} files ending "
                                 f"{suffix!r} (expected one) with the buffer-assignment dump "
                                 f"options on; found {sorted(os.listdir(folder))[:20]}")
            with open(found[0]) as f:
                return f.read()
        text = one("after_optimizations.txt")
        breakdown = peak_breakdown(one("after_optimizations-buffer-assignment.txt"),
                                   one("after_optimizations-live-range.txt"), text,
                                   depth=depth)
    return compiled, text, breakdown


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One temporary buffer live at the peak: its bytes, shape, the value (instruction
    ``name{shape index}``) that defines it, its op_name metadata and `scope_group`."""
    bytes: int
    shape: str
    value: str
    op_name: str
    group: str


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
    """The temporaries live at their peak, from the compiler's buffer assignment.

    ``temp_bytes``: the temporaries' allocations (``preallocated-temp``; what
    ``memory_analysis().temp_size_in_bytes`` counts); ``peak_bytes``: the buffers live at
    once at the peak of the largest one (below ``temp_bytes`` by the heap's fragmentation and
    the smaller allocations); ``peak_time``: that point of the schedule; ``buffers``: the live
    ones, largest first."""
    temp_bytes: int
    peak_bytes: int
    peak_time: int
    buffers: tuple[PeakBuffer, ...]

    def groups(self) -> list[tuple[str, int, int]]:
        """``(group, bytes, count)`` of the live buffers by `PeakBuffer.group`, largest
        first."""
        out: dict[str, list[int]] = {}
        for b in self.buffers:
            g = out.setdefault(b.group, [0, 0])
            g[0] += b.bytes
            g[1] += 1
        return sorted(((k, v[0], v[1]) for k, v in out.items()), key=lambda r: (-r[1], r[0]))

    def shapes(self, group: str, n: int = 3) -> list[tuple[str, int, int]]:
        """``(shape, bytes, count)`` of a group's live buffers by shape, largest first."""
        out: dict[str, list[int]] = {}
        for b in self.buffers:
            if b.group == group:
                g = out.setdefault(b.shape, [0, 0])
                g[0] += b.bytes
                g[1] += 1
        return sorted(((k, v[0], v[1]) for k, v in out.items()), key=lambda r: -r[1])[:n]


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(\d+),offset=(\d+)\): (\S+)")
_LIVE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"(?<![=\w])%([\w.\-]+)")
# named scopes that say how a computation was reached, not what it computes
_PLUMBING = re.compile(r"^(jit\(.*\)|while|body|cond|closed_call|checkpoint|"
                       r"rematted_computation|shard_map|branch_\d+_fun|pjit|remat|"
                       r"layers_\d+_to_\d+)$")


def scope_group(op_name: str, depth: int = 4) -> str:
    """The group of an op_name (``jit(train_step)/transpose(jvp(deepseekv4))/layers_0_to_41/
    while/body/closed_call/checkpoint/layer_3/moe/experts/gather``): ``"bwd"`` (under a
    ``transpose(...)``, the backward pass), ``"fwd"`` (under ``jvp``) or nothing, then the
    first ``depth`` named scopes (the model's own first: ``deepseekv4``) with the plumbing left
    out (jit, while/body, checkpoint, shard_map, a scan's ``layers_I_to_J``), ``layer_N`` as
    ``layer`` (every layer together) -- the primitive itself (the last name) is left out.
    A loop's own value (the primitive ``while``) is ``... [scan carry]``: under ``fwd`` the
    residuals a forward scan stacks for the backward one, under ``bwd`` what the backward scan
    carries (the stacked parameters' gradients, the cotangent). No op_name:
    ``"(no op_name)"``; an op_name that is no scope path: ``"param model.layers[*]...``" (a
    copy of an argument: its path) or ``"(compiler: broadcast)"`` (made by the compiler)."""
    if not op_name:
        return "(no op_name)"
    if "/" not in op_name:
        if re.fullmatch(r"[\w\-]+\.\d+", op_name):  # named by the compiler after an op
            return f"(compiler: {op_name.rsplit('.', 1)[0]})"
        # an argument's path: a copy of a parameter (its bf16 cast, a layout change)
        return "param " + re.sub(r"\[\d+\]", "[*]", op_name.removesuffix(".value"))
    parts = op_name.split("/")
    primitive = parts[-1]
    phase = "bwd" if "transpose(" in op_name else "fwd" if "jvp(" in op_name else ""
    scopes = []
    for part in parts[:-1]:
        inner = re.sub(r"^(?:transpose\()?(?:jvp\()?(.*?)\)*$", r"\1", part)
        if _PLUMBING.match(part) or _PLUMBING.match(inner):
            continue
        scopes.append(re.sub(r"^layer_\d+$", "layer", inner))
    name = " ".join(x for x in (phase, "/".join(scopes[:depth]) or "(top)") if x)
    return f"{name} [scan carry]" if primitive == "while" else name


def peak_breakdown(assignment: str, live_ranges: str, hlo: str, depth: int = 4
                   ) -> PeakBreakdown:
    """The temporaries live at their peak, from what XLA dumps with
    ``xla_dump_buffer_assignment_analysis``: ``assignment`` the
    ``*after_optimizations-buffer-assignment.txt`` (allocations and the values each holds, at
    offsets), ``live_ranges`` the ``*after_optimizations-live-range.txt`` (each value's
    ``start-end`` in the schedule) and ``hlo`` the optimized module's text (op_name metadata).

    The largest ``preallocated-temp`` allocation of the device memory (the heap; not a TPU's
    VMEM) is swept: values at
    the same offset and size whose live ranges touch or overlap are one buffer (an in-place
    update, a loop's carry); the point where the live buffers' bytes are largest is the peak
    and those buffers are grouped by `scope_group` of the op_name of the instruction that
    defines the buffer's value live there (an asynchronous copy's or other instruction
    without one: its first operand's); ``[scan carry]`` is added when a loop carries the
    buffer there (one of its live values is a ``while``'s), whose group it takes when no
    live value has a scope path (a loop body's parameter; a zero-filled accumulator the
    compiler made), else the values that held the buffer before name it."""
    temp_bytes, heaps, current = 0, [], None
    for line in assignment.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            current = None
            # the device memory's (color 0) heap; another color is another memory (a TPU's
            # VMEM, SMEM), which memory_analysis does not count
            if "preallocated-temp" in m.group(3) and not re.match(r"color [1-9]", m.group(3)):
                temp_bytes += int(m.group(2))
                current = []
                heaps.append((int(m.group(2)), current))
            continue
        if current is not None:
            v = _VALUE.match(line)
            if v:
                current.append((v.group(1) + (v.group(2) or "{}"), int(v.group(3)),
                                int(v.group(4)), v.group(5)))
    if not heaps:
        raise ValueError("no 'preallocated-temp' allocation in the buffer assignment: pass "
                         "the *after_optimizations-buffer-assignment.txt XLA dumps with "
                         "xla_dump_buffer_assignment_analysis on")
    values = max(heaps, key=lambda h: h[0])[1]
    live = {m.group(1): (int(m.group(2)), int(m.group(3)))
            for m in map(_LIVE.match, live_ranges.splitlines()) if m}
    # one buffer: the values at one offset and size whose live ranges touch
    chunks = []
    by_place: dict[tuple[int, int], list] = {}
    for name, size, offset, shape in values:
        if name in live and size:
            by_place.setdefault((offset, size), []).append((*live[name], name, shape))
    for (_, size), vs in by_place.items():
        vs.sort()
        start, end, members = vs[0][0], vs[0][1], [vs[0]]
        for v in vs[1:]:
            if v[0] <= end:
                end = max(end, v[1])
                members.append(v)
            else:
                chunks.append((start, end, size, members))
                start, end, members = v[0], v[1], [v]
        chunks.append((start, end, size, members))
    # live over [start, end): a buffer handed on at ``end`` is not counted twice there
    events: dict[int, int] = {}
    for start, end, size, _ in chunks:
        end = max(end, start + 1)
        events[start] = events.get(start, 0) + size
        events[end] = events.get(end, 0) - size
    peak = total = 0
    peak_time = 0
    for t in sorted(events):
        total += events[t]
        if total > peak:
            peak, peak_time = total, t
    at_peak = [c for c in chunks if c[0] <= peak_time < max(c[1], c[0] + 1)]
    op_names, operands = _hlo_names(hlo)
    buffers = []
    for _, _, size, members in sorted(at_peak, key=lambda c: -c[2]):
        buffers.append(_named(size, members, peak_time, op_names, operands, depth))
    return PeakBreakdown(temp_bytes=temp_bytes, peak_bytes=peak, peak_time=peak_time,
                         buffers=tuple(buffers))


def _named(size: int, members: list, peak_time: int, op_names: dict[str, str],
           operands: dict[str, str], depth: int) -> PeakBuffer:
    """A buffer at the peak named by its values live there (the one with a scope path first,
    else the loop's that carries the buffer, else the values that held it before, nearest
    first)."""
    live = [m for m in members if m[0] <= peak_time <= m[1]] or \
        [max((m for m in members if m[0] <= peak_time), key=lambda m: m[0])]
    before = [m for m in reversed(members) if m[1] < peak_time and m not in live]
    after = [m for m in members if m[0] > peak_time]
    ops = [(m, _origin(m[2].split("{")[0], op_names, operands)) for m in live + before]
    later = [(m, _origin(m[2].split("{")[0], op_names, operands)) for m in after]

    def is_loop(op):
        return op.rsplit("/", 1)[-1] == "while"
    plain = next(((m, op) for m, op in ops[:len(live)] if "/" in op and not is_loop(op)), None)
    loop = next(((m, op) for m, op in ops + later if is_loop(op)), None)
    if plain is not None:
        (m, op), group = plain, scope_group(plain[1], depth)
        if any(is_loop(o) for _, o in ops[:len(live)]):
            group += " [scan carry]"
    elif loop is not None:
        (m, op), group = loop, scope_group(loop[1], depth)
    else:
        m, op = next(((m, op) for m, op in ops if op), ops[0])
        group = scope_group(op, depth)
    return PeakBuffer(bytes=size, shape=_shape(m[3]), value=m[2], op_name=op, group=group)


def _shape(text: str) -> str:
    """``f32[256,1024]`` of a value's shape with its layout; ``(tuple)`` for a tuple's (the
    pointers an asynchronous op keeps)."""
    return "(tuple)" if text.startswith("(") else text.split("{")[0]


def _hlo_names(hlo: str) -> tuple[dict[str, str], dict[str, str]]:
    """Every instruction's op_name, and its first operand (for the instructions without
    one)."""
    op_names, operands = {}, {}
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, rhs = m.groups()
        o = _OP_NAME.search(rhs)
        op_names[name] = o.group(1) if o else ""
        if not o:
            first = _OPERAND.search(rhs.split(", metadata=")[0])
            if first:
                operands[name] = first.group(1)
    return op_names, operands


def _origin(name: str, op_names: dict[str, str], operands: dict[str, str]) -> str:
    for _ in range(8):  # copy-start -> copy-done -> ... -> the instruction that has one
        if op_names.get(name):
            return op_names[name]
        if name not in operands:
            return ""
        name = operands[name]
    return ""


_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
                  r"\(([\d.]+)([KMGT])\)")
_UNIT = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def out_of_memory(error: BaseException) -> tuple[int, int] | None:
    """``(temporaries, available)`` bytes of a TPU compiler out-of-memory error, else None."""
    m = _OOM.search(str(error))
    if m is None:
        return None
    return (int(float(m.group(1)) * _UNIT[m.group(2)]),
            int(float(m.group(3)) * _UNIT[m.group(4)]))
