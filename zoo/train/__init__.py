"""zoo.train: the train step, optimizer, checkpoints and loop shared by every recipe.

* `zoo.train.step` -- `lr_schedule`, `make_tx`, `loss_fn`, `make_train_step`,
  `create_sharded`, `abstract_state`, `make_global_batch`.
* `zoo.train.checkpoint` -- `Checkpointer` (Orbax, corrupt-checkpoint fallback).
* `zoo.train.config` -- `TrainConfig`: every training setting (the recipes' flags).
* `zoo.train.loop` -- `train(config, pieces)` (progress bar, metrics.jsonl, run.json,
  loss.png, signals, NaN guard), `Pieces`, `read_metrics`, `plot_loss`.
* `zoo.train.rehearse` -- `rehearse` / `Rehearsal`: the train step compiled ahead of time for
  a (virtual) mesh at full size; per-device memory, HLO FLOPs, collective bytes.
* `zoo.train.cli` -- the recipes' `Recipe`, flags, setup and `main`.
* `zoo.train.launch` -- virtual CPU devices, multi-process join, default mesh, compile cache.
* `zoo.train.validate` / `zoo.train.lock` -- the recipes' input checks and run-dir lock.
* `zoo.train.guard` -- NaN, divergence and stop agreement without a per-step host barrier.
"""

from zoo.train.checkpoint import Checkpointer
from zoo.train.config import TrainConfig
from zoo.train.loop import (IncompatibleCheckpoint, Pieces, Summary, TrainingDiverged,
                            plot_loss, read_metrics, train)
from zoo.train.rehearse import Rehearsal, rehearse
from zoo.train.step import (abstract_state, create_sharded, loss_fn, lr_schedule,
                            make_global_batch, make_train_step, make_tx)

# `zoo.train.cli` is imported by the recipes themselves (it is not needed to train from code).

__all__ = ["Checkpointer", "IncompatibleCheckpoint", "Pieces", "Rehearsal", "Summary",
           "TrainConfig", "TrainingDiverged",
           "abstract_state", "create_sharded", "loss_fn", "lr_schedule", "make_global_batch",
           "make_train_step", "make_tx", "plot_loss", "read_metrics", "rehearse", "train"]
