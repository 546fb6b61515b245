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
