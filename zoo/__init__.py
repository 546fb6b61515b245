"""zoo: an NNX-native model zoo for JAX whose layers are parallel from birth."""

from zoo import ops
from zoo.partitioning import MESH_AXES, STRATEGIES, Partitioner, make_mesh

__version__ = "0.1.0"

__all__ = ["MESH_AXES", "STRATEGIES", "Partitioner", "__version__", "make_mesh", "ops"]
