"""Pure functions without parameters.

Attention as an open op (`attention`, `mla_attention`; `dot_product_attention` is the
reference): masks as values (`zoo.ops.masks`: `Causal`, `SlidingWindow`, `Chunked`, `PrefixLM`,
`Document`, `MaskFn`, combined with ``&``/``|``), score modifiers (`ScoreMod`, soft caps, sinks),
context-parallel strategies (`zoo.ops.ring`) calling pluggable block kernels
(`zoo.ops.kernels`: `FlashKernel`, `TokamaxKernel`, `register_kernel`). `zoo.ops.moe` holds the
mixture-of-experts routing and dispatch functions, beside the experts' grouped products
(`zoo.ops.grouped`), the all_to_all dispatch's wire (`zoo.ops.moe_wire`), the exact dispatch in
rounds (`zoo.ops.moe_rounds`), the execution value (`zoo.ops.moe_execution`) and row moves
inside `jax.shard_map` (`zoo.ops.rows`); `zoo.ops.hlo` reads compiled programs' HLO
text (executions, collective bytes, FLOPs: the rehearsal's counter).
"""

from zoo.ops.attention import (IMPLEMENTATIONS, KV_WIRES, attention, choose_implementation,
                               choose_mla_wire, dot_product_attention, mla_attention)
from zoo.ops import fp8 as fp8  # blockwise-scaled FP8: fp8.quantize, fp8.dot, fp8.ragged_dot
from zoo.ops.flash import FlashKernel
from zoo.ops.gated_delta import causal_conv1d, gated_delta_rule
from zoo.ops.kernels import (BlockKernel, ScoreMod, Scores, TokamaxKernel, get_kernel,
                             register_kernel)
from zoo.ops.masks import (Causal, Chunked, Document, Mask, MaskFn, PrefixLM, SlidingWindow,
                           attention_mask, block_may_attend)
from zoo.ops.sparse_attention import (TopK, choose_sparse_implementation, sparse_attention,
                                      sparse_mla_attention)

__all__ = ["IMPLEMENTATIONS", "KV_WIRES", "BlockKernel", "Causal", "Chunked", "Document",
           "FlashKernel", "Mask", "MaskFn", "PrefixLM", "ScoreMod", "Scores", "SlidingWindow",
           "TokamaxKernel",
           "attention", "attention_mask", "block_may_attend",
           "choose_implementation", "choose_mla_wire", "dot_product_attention", "get_kernel",
           "mla_attention",
           "register_kernel"]
__all__ += ["TopK", "choose_sparse_implementation", "sparse_attention",
            "sparse_mla_attention"]
__all__ += ["causal_conv1d", "gated_delta_rule"]
