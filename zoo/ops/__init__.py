"""Pure functions without parameters.

Attention (`attention`: reference, all-gather, ring, cuDNN; `dot_product_attention`: the
reference) and its masks from positions/segment ids; `zoo.ops.moe` holds the mixture-of-experts
routing and dispatch functions.
"""

from zoo.ops.attention import (IMPLEMENTATIONS, attention, check_attention_shapes,
                               choose_implementation, dot_product_attention)
from zoo.ops.masks import attention_mask, block_may_attend

__all__ = ["IMPLEMENTATIONS", "attention", "attention_mask", "block_may_attend",
           "check_attention_shapes", "choose_implementation", "dot_product_attention"]
