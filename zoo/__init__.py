"""zoo: an NNX-native model zoo for JAX whose layers are parallel from birth.

``import zoo`` gives the subpackages ``zoo.ops``, ``zoo.layers``, ``zoo.models``, ``zoo.data``,
``zoo.train`` (imported on first use, so ``import zoo`` stays quick and starts no backend) and
the mesh helpers `make_mesh`, `Partitioner`.
"""

import importlib

from zoo.targets import cpu_unless_accelerator, quiet_cuda_stub

with quiet_cuda_stub():  # the CUDA plugin's "no cuda drivers" lines, on hosts without a GPU
    importlib.import_module("jax")

from zoo.partitioning import MESH_AXES, STRATEGIES, Partitioner, make_mesh

cpu_unless_accelerator()  # the TPU compiler installed on a CPU host: no libtpu probe

__version__ = "0.1.0"

_SUBPACKAGES = ("ops", "layers", "models", "data", "train", "inference", "generate",
                "evaluate", "shardings")

__all__ = ["MESH_AXES", "STRATEGIES", "Partitioner", "__version__", "make_mesh",
           "set_cpu_devices", *_SUBPACKAGES]


def set_cpu_devices(n: int) -> None:
    """Give this process `n` virtual CPU devices (before anything touches a device): the
    first line of a script that simulates a mesh on one machine."""
    from zoo.train.launch import set_cpu_devices as _set
    _set(n)


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        try:
            return importlib.import_module(f"zoo.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"zoo.{name}":
                raise AttributeError(f"module 'zoo' has no attribute {name!r}") from None
            raise
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBPACKAGES))
