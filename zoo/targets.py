"""Compile targets: the devices a program is compiled for, which need not be this host's.

The TPU compiler ships in libtpu (``pip install "jax[tpu]"``, the ``tpu-compile`` extra) and
runs on a CPU-only host: `jax.experimental.topologies` describes a slice's chips without
owning any, a mesh over those descriptions lowers and compiles for them, and XLA's memory
analysis (or its out-of-memory error) is the TPU's. `zoo.train.rehearse.rehearse` takes
``target=`` and compiles the train step this way; every program choice zoo makes follows the
mesh's platform (`zoo.partitioning.mesh_platform`), so this is the program a run on that
slice builds.

* `target_devices(target)` -- ``"cpu"`` (this host's devices) or a TPU slice,
  ``"tpu:v5p:2x2x2"`` / ``"v5p:8x8x4"`` (generation, then the topology's chip grid), as a
  list of device descriptions.
* `configure_process()` -- the environment libtpu needs on a host without TPUs (called by
  `target_devices`): no metadata-server query, several processes may load it (test workers,
  subprocesses), and jax's own platform stays the CPU.
* `cpu_unless_accelerator()` -- with the TPU compiler installed on a host that has no TPU
  (the ``test`` extra on a CPU box), jax starts on its CPU quietly rather than probing libtpu
  first; `import zoo` calls it.
* `hbm_bytes(device_kind)` -- a chip's memory as the TPU compiler counts it (what its
  out-of-memory message states), None when not known; `chip(device_kind)` its published
  peaks (bf16 FLOP/s, ICI and HBM bytes/s), which `Rehearsal.roofline` bounds a step with.

GPU targets (``jax[cuda12]`` and a ``gpu_device_info`` description) compile the same way but
need the CUDA plugin and toolchain (several GB); they are not wired here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

__all__ = ["CHIPS", "Chip", "target_devices", "configure_process", "chip",
           "cpu_unless_accelerator", "hbm_bytes", "parse_target", "TPU_CHIPS"]

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
    """A chip's published peaks (Cloud TPU docs, per chip): dense bf16 FLOP/s, bidirectional
    inter-chip interconnect (ICI) bytes/s and HBM bytes/s."""
    peak_flops: float
    ici_bytes_per_s: float
    hbm_bytes_per_s: float


# by jax's device_kind; v4's ICI is not stated per chip in the same terms, so it has no entry
CHIPS = {"TPU v5": Chip(459e12, 1200e9, 2765e9),        # v5p
         "TPU v5 lite": Chip(197e12, 400e9, 819e9),     # v5e
         "TPU v6 lite": Chip(918e12, 800e9, 1638e9)}    # v6e (Trillium)


def chip(device_kind: str) -> Chip | None:
    """The published peaks of a device kind (`CHIPS`), None if not known (CPU, v4)."""
    return CHIPS.get(device_kind)


def cpu_unless_accelerator() -> None:
    """Start jax on its CPU when the TPU compiler is installed on a host with no TPU chip and
    no other accelerator plugin, unless platforms were named (``JAX_PLATFORMS`` or
    ``jax_platforms``). jax would otherwise try libtpu's TPU backend first, which prints
    warnings (no accelerator type, no worker hostnames) before falling back to the CPU.
    `import zoo` calls it; it changes nothing once a backend has started, and nothing on a
    TPU or GPU host."""
    import importlib.util

    import jax
    if jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS"):
        return
    if importlib.util.find_spec("libtpu") is None or _tpu_chips() or any(
            importlib.util.find_spec(m) is not None
            for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                      "jax_rocm7_plugin")):
        return
    from jax._src import xla_bridge
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def _tpu_chips() -> int:
    """TPU chips attached to this host (PCI devices of Google's vendor id, as jax counts)."""
    try:
        from jax._src.hardware_utils import num_available_tpu_chips_and_device_id
        return num_available_tpu_chips_and_device_id()[0]
    except Exception:  # a jax without the helper: look for the TPU device files instead
        import glob
        return len(glob.glob("/dev/accel*")) + len(glob.glob("/dev/vfio/[0-9]*"))


def parse_target(target: str) -> tuple[str, str | None, str | None]:
    """``(platform, generation, topology)`` of a target text; ValueError naming the forms."""
    text = target.strip().lower()
    if text == "cpu":
        return "cpu", None, None
    if text.startswith("tpu:"):
        text = text[4:]
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)+)", text)
    if m is None or m.group(1) not in TPU_CHIPS:
        raise ValueError(
            f"target={target!r}: expected 'cpu' or a TPU slice 'tpu:<generation>:<grid>' "
            f"with generation one of {sorted(TPU_CHIPS)} and grid like 2x2x2 (v4/v5p) or 4x4 "
            f"(v5e/v6e), e.g. 'tpu:v5p:8x8x4' for a v5p-256")
    return "tpu", m.group(1), m.group(2)


def target_devices(target: str) -> list[Any]:
    """The devices `target` names (see `parse_target`): this host's for ``"cpu"``, else the
    chips of a TPU slice described by libtpu (no TPU needed; raises with the install command
    when libtpu is missing)."""
    platform, gen, grid = parse_target(target)
    if platform == "cpu":
        import jax
        return list(jax.devices())
    configure_process()
    try:
        import libtpu  # noqa: F401  (the compiler; jax finds it by itself)
    except ImportError:
        raise ValueError(f"target={target!r} needs the TPU compiler: pip install -e "
                         f"'.[tpu-compile]' (jax[tpu], libtpu)") from None
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{gen}:{grid}",
                                        chip_config_name=TPU_CHIPS[gen], num_slices=1)
    return list(topo.devices)


def hbm_bytes(device_kind: str) -> int | None:
    """Per-device memory of a TPU kind, as its compiler counts it; None if not known."""
    v = _HBM.get(device_kind)
    return None if v is None else int(v)


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
