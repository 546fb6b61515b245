"""NNX layers built with their shapes and a `Partitioner`.

Each layer takes explicit keyword arguments, ``partitioner`` (None: unsharded) and ``*, rngs``;
parameters are created already sharded. Subclass a layer and override one method.
"""

from zoo.layers.embed import Embed
from zoo.layers.linear import Linear
from zoo.layers.mlp import MLP
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import RoPE, YaRN, apply_rope

__all__ = ["Embed", "Linear", "MLP", "RMSNorm", "RoPE", "YaRN", "apply_rope"]

