"""NNX layers built with their shapes and a `Partitioner`.

Each layer takes explicit keyword arguments, ``partitioner`` (None: unsharded) and ``*, rngs``;
parameters are created already sharded. Subclass a layer and override one method.
"""

from zoo.layers.attention import Attention
from zoo.layers.compressed_attention import CompressedAttention, GroupedOutputProjection
from zoo.layers.compressor import CompressedIndexer, Compressor
from zoo.layers.embed import Embed
from zoo.layers.gated_attention import GatedAttention
from zoo.layers.gated_deltanet import GatedDeltaNet
from zoo.layers.hyper_connection import HyperConnection, HyperHead
from zoo.layers.indexer import Indexer, LayerNorm
from zoo.layers.linear import Linear
from zoo.layers.mla import MLA
from zoo.layers.mlp import MLP
from zoo.layers.moe import MoE, RouterBias, moe_modules, update_expert_bias
from zoo.layers.norm import GatedRMSNorm, RMSNorm, ZeroCentredRMSNorm
from zoo.layers.rope import RoPE, YaRN, apply_rope
from zoo.layers.shared_expert import SharedExpertMoE

__all__ = ["MLA", "MLP", "Attention", "Embed", "Linear", "MoE", "RMSNorm", "RoPE", "RouterBias",
           "YaRN", "apply_rope", "moe_modules", "update_expert_bias"]
__all__ += ["GatedAttention", "GatedDeltaNet", "GatedRMSNorm", "SharedExpertMoE",
            "ZeroCentredRMSNorm"]
__all__ += ["Indexer", "LayerNorm"]
__all__ += ["HyperConnection", "HyperHead"]
__all__ += ["CompressedAttention", "CompressedIndexer", "Compressor", "GroupedOutputProjection"]
