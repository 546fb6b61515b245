"""zoo.train: one builder, one Trainer, and what they are made of.

* `zoo.train.config` -- `TrainConfig`: every training setting, in sections (the recipes'
  flags).
* `zoo.train.build` -- `build(config) -> Built`: model factory, optimizer, train step, batch
  sharding and data from a config; the CLI, the `Trainer`, `rehearse` and the benchmarks all
  start here.
* `zoo.train.trainer` -- `Trainer` (create or resume, compile, step, checkpoint, signals, NaN
  and divergence guard), `Summary`.
* `zoo.train.hooks` -- the trainer's loggers and stop conditions (metrics.jsonl, progress bar,
  TensorBoard, Weights & Biases, loss plot), `read_metrics`, `plot_loss`.
* `zoo.train.evaluation` -- the held-out loss: `Evaluator` (compiled once), the `Evaluate`
  hook (``eval_every``); ``python -m zoo.evaluate`` uses them on a saved run.
* `zoo.train.load` -- `load(run_dir)`: a run's trained model on any mesh.
* `zoo.train.step` -- `make_tx`, `lr_schedule`, `loss_fn`, `make_train_step`,
  `create_sharded`, `abstract_state`, `make_global_batch`, `BATCH_KEYS`.
* `zoo.train.checkpoint` -- `Checkpointer` (Orbax, corrupt-checkpoint fallback).
* `zoo.train.rehearse` -- `rehearse` / `Rehearsal`: the train step compiled ahead of time for
  a (virtual) mesh at full size; per-device memory, HLO FLOPs, collective bytes (one decode
  step against a KV cache: `zoo.inference.rehearsal.rehearse_decode`, the same way).
* `zoo.train.cli` -- the recipes' `Recipe` and `main`.
* `zoo.train.launch`, `validate`, `lock`, `guard`, `fields` -- devices and processes, input
  checks, the run-dir lock, NaN/divergence/stop agreement, typed values from text.
"""

from zoo.train.build import Built, build
from zoo.train.checkpoint import Checkpointer
from zoo.train.config import TrainConfig
from zoo.train.hooks import Hook, plot_loss, read_metrics
from zoo.train.launch import set_cpu_devices
from zoo.train.load import Loaded, load
from zoo.train.rehearse import Rehearsal, rehearse
from zoo.targets import target_devices
from zoo.train.step import (BATCH_KEYS, abstract_state, create_sharded, loss_fn, lr_schedule,
                            make_global_batch, make_train_step, make_tx)
from zoo.train.trainer import (CompileInterrupted, IncompatibleCheckpoint, Summary, Trainer,
                               TrainingDiverged)

__all__ = ["BATCH_KEYS", "Built", "Checkpointer", "CompileInterrupted", "Hook",
           "IncompatibleCheckpoint", "Loaded", "Rehearsal", "Summary", "TrainConfig", "Trainer",
           "TrainingDiverged", "abstract_state", "build", "create_sharded", "load", "loss_fn",
           "lr_schedule", "make_global_batch", "make_train_step", "make_tx", "plot_loss",
           "read_metrics", "rehearse", "set_cpu_devices",
           "target_devices"]
