"""zoo.inference: generation with KV caches, on the model layers' own cached calls.

* `zoo.inference.cache` -- `KVCache` (a pytree the layers read and return), `cache_slots`,
  `cache_bytes_per_token`, the cache's sharding (`constrain_cache`).
* `zoo.inference.engine` -- `prefill` (prompts -> logits and a filled cache), `decode` /
  `Decoder` (a token per row from the cache, one compiled step), on the model's inference
  view (`CausalLM.for_inference`: MoE dropless whatever the training settings).
* `zoo.inference.sampling` -- greedy, temperature, top-k, top-p; the argument checks.
* `zoo.inference.prompts` -- prompts checked and left-padded into a batch.
* `zoo.inference.generation` -- `generate`, `generate_with_logits`.
* `zoo.inference.speculative` -- speculative decoding with a model's MTP module
  (`generate_speculative`, `SpeculativeStats`).
* `zoo.inference.cli` -- ``python -m zoo.generate`` (also ``python -m zoo.inference.cli``).
* `zoo.inference.rehearsal` -- `rehearse_decode`: one decode step compiled ahead of time for
  a mesh (it builds the model as the training floor does, so it is imported on its own:
  ``from zoo.inference.rehearsal import rehearse_decode``).

Each attention-like layer owns its cache (`zoo.layers.AttentionBlock`: ``cache_axes``,
``cache_shape``, ``cache_slots``, ``prefill_cache``, ``decode_step``), so a new layer kind
brings its own cache without changing this package -- slots per token, or a state constant in
the context (`zoo.layers.GatedDeltaNet`'s convolution window and recurrent state).
"""

from zoo.inference.cache import KVCache, cache_bytes_per_token, cache_slots
from zoo.inference.engine import Decoder, decode, prefill
from zoo.inference.generation import generate, generate_with_logits
from zoo.inference.speculative import SpeculativeStats, generate_speculative

__all__ = ["Decoder", "KVCache", "SpeculativeStats", "cache_bytes_per_token", "cache_slots",
           "decode", "generate", "generate_speculative", "generate_with_logits", "prefill"]
