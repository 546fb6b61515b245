"""zoo.data: a Grain text pipeline for language-model training, knowing nothing of models.

* `text_dataset` -- files (or the built-in standard-library corpus) -> tokenized, packed
  (first-fit, nothing dropped), shifted, load-balanced, per-process batches; checkpointable.
* `load_balance` / `restore_order` -- the ``2*cp``-chunk reorder for context parallelism.
* `ByteTokenizer` (default), `HFTokenizer` (a local ``tokenizer.json``).
"""

from zoo.data.pipeline import text_dataset
from zoo.data.reorder import load_balance, restore_order
from zoo.data.tokenizer import ByteTokenizer, HFTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "load_balance", "restore_order", "text_dataset"]
