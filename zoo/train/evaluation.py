"""Held-out evaluation: a model's loss and perplexity on documents it never trained on.

* `eval_sums(model, batch)` -- the forward pass alone (no gradient, no state written back):
  ``{"ce_sum", "weight_sum"}``, the next-token cross-entropy summed over the global batch with
  its ``loss_weights`` (the main head only; multi-token-prediction modules are not run).
* `Evaluator(built)` -- that function jitted for the run's batch sharding and compiled once, on
  the first model it sees (the trainer's shardings, on the trainer's mesh); `evaluate(model,
  batches, max_batches)` returns an `Evaluation`.
* `Evaluation` -- ``loss = sum(ce) / sum(weights)`` over every batch read (a mean over target
  tokens, as the training ``loss`` is per batch), ``ppl = exp(loss)``; `row()` gives the
  ``metrics.jsonl`` columns ``eval_loss``, ``eval_ppl``, ``eval_tokens``, ``eval_time_s``.
* `Evaluate(every, batches)` -- the `Trainer` hook: at every ``every``-th step and at the last
  planned step it evaluates ``batches`` batches of the held-out split (`zoo.data.split`,
  through ``Built.eval_data``; read at the first evaluation and kept, so every evaluation
  sees the same batches) and adds the columns to that step's row, so the loggers after it
  (metrics.jsonl, TensorBoard, W&B, the loss plot) show them. It asks the trainer for the
  model of exactly that step (``needs_model``).

``python -m zoo.evaluate --run DIR`` (`zoo.evaluate`) runs the same `Evaluator` on a saved run.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zoo.train.hooks import Hook

__all__ = ["eval_sums", "Evaluator", "Evaluation", "Evaluate"]


def eval_sums(model, batch) -> dict[str, jax.Array]:
    """``{"ce_sum", "weight_sum"}`` of one global batch (see the module docstring)."""
    logits, _ = model(batch["inputs"], positions=batch["positions"],
                      segment_ids=batch["segment_ids"])  # [B, L, V]
    w = batch["loss_weights"].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         batch["targets"])
    return {"ce_sum": jnp.sum(ce * w), "weight_sum": jnp.sum(w)}


@dataclasses.dataclass(frozen=True)
class Evaluation:
    loss: float      # mean cross-entropy per target token (nats)
    tokens: int      # target tokens evaluated
    batches: int     # batches read
    seconds: float   # wall time, the compile included when it happened here

    @property
    def ppl(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def row(self) -> dict[str, Any]:
        return dict(eval_loss=self.loss, eval_ppl=self.ppl, eval_tokens=self.tokens,
                    eval_time_s=self.seconds)


class Evaluator:
    """Evaluates models built by `built` (a `zoo.train.Built`) on its batch sharding."""

    def __init__(self, built):
        self.batch_sharding = built.batch_sharding
        self.batch_abstract = built.batch_abstract
        self._compiled = None

    def compile(self, model) -> None:
        if self._compiled is None:
            self._compiled = jax.jit(eval_sums).lower(model, self.batch_abstract()).compile()

    def evaluate(self, model, batches: Iterable[dict[str, Any]],
                 max_batches: int | None = None) -> Evaluation:
        """The loss over the first `max_batches` (all when None) of `batches`, this process's
        rows of each global batch (a `zoo.data.text_dataset` iterator; one is closed after)."""
        from zoo.train.step import make_global_batch
        t0 = time.perf_counter()
        self.compile(model)
        ce, weight, n = 0.0, 0.0, 0
        try:
            for local in batches:
                if max_batches is not None and n >= max_batches:
                    break
                out = jax.device_get(self._compiled(
                    model, make_global_batch(local, self.batch_sharding)))
                ce, weight, n = ce + float(out["ce_sum"]), weight + float(out["weight_sum"]), n + 1
        finally:
            getattr(batches, "close", lambda: None)()
        if weight <= 0:
            raise ValueError(f"evaluation: the {n} batch(es) read hold no target token; pass "
                             f"more held-out text (--validation-fraction, --data)")
        return Evaluation(ce / weight, int(weight), n, time.perf_counter() - t0)


class Evaluate(Hook):
    """The held-out loss every `every` steps and at the last planned step (see the module
    docstring). `data`: a function returning a fresh iterator of batches (default: the
    trainer's ``built.eval_data``)."""

    def __init__(self, every: int, batches: int, data: Callable[[], Any] | None = None):
        if every < 1 or batches < 1:
            raise ValueError(f"Evaluate(every={every}, batches={batches}): both must be >= 1")
        self.every, self.batches, self.data = every, batches, data
        self._evaluator: Evaluator | None = None
        self._held: list[dict[str, Any]] | None = None  # this process's rows of the batches
        self.last: Evaluation | None = None

    def needs_model(self, trainer, step: int) -> bool:
        return step % self.every == 0 or step == trainer.config.steps

    def on_step(self, trainer, step: int, row: dict[str, Any]) -> None:
        if not self.needs_model(trainer, step):
            return
        if trainer.step != step:  # the trainer honours needs_model; a caller's loop may not
            raise RuntimeError(f"Evaluate: step {step}'s metrics came with the model of step "
                               f"{trainer.step}; call on_step when the model is that step's")
        if self._evaluator is None:
            self._evaluator = Evaluator(trainer.built)
        if self._held is None:  # read once: the same batches every time, no re-reading
            data = (self.data or trainer.built.eval_data)()
            try:
                self._held = list(itertools.islice(data, self.batches))
            finally:
                getattr(data, "close", lambda: None)()
        self.last = self._evaluator.evaluate(trainer.model, self._held)
        row.update(self.last.row())
