"""The one module that reads library internals (``jax._src``, ``tokamax._src``), each use
keyed to the versions it was checked on (`CHECKED_ON`) and guarded, so a newer release that
moves a name fails here with the name and the versions rather than deep inside a run.

* `backends_are_initialized()`, `tpu_chips_on_host()` -- jax's backend state and its TPU count.
* `distributed_state()` -- jax.distributed's client and coordinator address.
* `tokamax_attention_implementations()` -- tokamax's attention implementations by name.
* `defer_gpu_compiler()` / `load_gpu_compiler()` -- keep the CUDA plugin (XLA's GPU compiler)
  out of a process until it compiles for a GPU. jax imports every installed plugin when its
  backends start, and the CUDA plugin's libraries print "Could not find cuda drivers" three
  or four times in every process of a host without a GPU (`zoo.targets.quiet_cuda_stub`
  keeps them off stderr); a deferred plugin is imported and registered by `zoo.targets` when
  a GPU target is first named.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

CHECKED_ON = {"jax": "0.10.2", "tokamax": "0.0.12"}
_CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def _internal(module: str, library: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"zoo reads {module}, checked on {library} "
                          f"{CHECKED_ON[library]}; this {library} moved it ({e}). Install "
                          f"{library}=={CHECKED_ON[library]} or update zoo/_jax_compat.py"
                          ) from e


def xla_bridge():
    return _internal("jax._src.xla_bridge", "jax")


def backends_are_initialized() -> bool:
    return xla_bridge().backends_are_initialized()


def tpu_chips_on_host() -> int | None:
    """TPU chips attached to this host as jax counts them (None if jax has no such helper)."""
    try:
        hardware = _internal("jax._src.hardware_utils", "jax")
        return hardware.num_available_tpu_chips_and_device_id()[0]
    except Exception:
        return None


def distributed_state():
    """jax.distributed's global state (``.client``, ``.coordinator_address``)."""
    return _internal("jax._src.distributed", "jax").global_state


def tokamax_attention_implementations() -> dict[str, Any]:
    return _internal("tokamax._src.ops.attention.api", "tokamax").IMPLEMENTATIONS


class _Deferred(types.ModuleType):
    """Stands in for a GPU plugin module while jax starts: registers nothing."""

    def initialize(self) -> None:
        pass


def defer_gpu_compiler() -> None:
    """Before jax's backends start: let jax import a stand-in for the installed CUDA plugin,
    so the plugin's libraries load only in a process that compiles for a GPU."""
    if backends_are_initialized():
        return
    import importlib.util
    for name in _CUDA_PLUGINS:
        if name not in sys.modules and importlib.util.find_spec(name) is not None:
            sys.modules[name] = _Deferred(name)


def load_gpu_compiler() -> None:
    """Import and register the CUDA plugin that `defer_gpu_compiler` held back (nothing if
    jax registered it at start)."""
    for name in _CUDA_PLUGINS:
        if isinstance(sys.modules.get(name), _Deferred):
            del sys.modules[name]
            plugin = importlib.import_module(name)
            if "cuda" not in xla_bridge()._backend_factories:
                plugin.initialize()
