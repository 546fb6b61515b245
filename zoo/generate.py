"""``python -m zoo.generate`` and the names ``zoo.generate`` has always exported: a thin
re-export of `zoo.inference` (generation with KV caches; see its modules and
docs/generate.md)."""

from zoo.inference import (Decoder, KVCache, cache_bytes_per_token, cache_slots, decode,
                           generate, generate_with_logits, prefill)
from zoo.inference.cache import cache_axes
from zoo.inference.cli import main

__all__ = ["Decoder", "KVCache", "cache_axes", "cache_bytes_per_token", "cache_slots",
           "decode", "generate", "generate_with_logits", "main", "prefill"]

if __name__ == "__main__":
    raise SystemExit(main())
