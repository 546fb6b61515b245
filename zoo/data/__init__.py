"""zoo.data: a Grain text pipeline for language-model training, knowing nothing of models.

* `text_dataset` -- files (or the built-in standard-library corpus, whole files or
  ``corpus_docs="short"`` top-level definitions) -> tokenized, packed (first-fit, nothing
  dropped), shifted, load-balanced, per-process batches; checkpointable, and refusing a state
  saved under other arguments (`PipelineStateMismatch`, `argument_changes`).
* `load_balance` / `restore_order` / `balance_permutation` -- per-row reordering for context
  parallelism: ``"auto"`` (default), ``"row"``, ``"document"``, ``"none"`` (`zoo.data.reorder`).
* `shard_tiles` / `shard_pairs` -- the work each context shard's attention does
  (`zoo.data.work`): kernel tiles not skipped, causal pairs.
* `split` -- the held-out validation documents, chosen by a hash of their text
  (``text_dataset(validation_fraction=, split=)``).
* `ByteTokenizer` (default), `HFTokenizer` (a local ``tokenizer.json``).
"""

from zoo.data.pipeline import PipelineStateMismatch, argument_changes, text_dataset
from zoo.data.reorder import (STRATEGIES, balance_candidates, balance_permutation,
                              best_candidate, load_balance, restore_order)
from zoo.data.tokenizer import ByteTokenizer, HFTokenizer
from zoo.data.work import TILE, shard_pairs, shard_tiles

__all__ = ["STRATEGIES", "TILE", "ByteTokenizer", "HFTokenizer", "PipelineStateMismatch",
           "argument_changes", "balance_candidates", "balance_permutation", "best_candidate",
           "load_balance", "restore_order",
           "shard_pairs", "shard_tiles", "text_dataset"]
