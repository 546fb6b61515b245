"""Trainer hooks: what a run reports and when it stops, as small objects.

A hook is any object with some of these methods (`Hook` has them all, doing nothing):

* ``on_start(trainer)`` -- the model is created or restored and the step compiled;
  ``trainer.step`` is the step the run starts from;
* ``on_step(trainer, step, row)`` -- step `step`'s metrics (``row``, the `metrics.jsonl` row)
  were read and checked; a hook may add columns to ``row`` for the hooks after it;
* ``needs_model(trainer, step) -> bool`` -- True: `on_step` of `step` sees ``trainer.model``
  as of that step (the trainer waits for it before dispatching the next);
* ``on_checkpoint(trainer, step)`` -- a checkpoint of `step` was started;
* ``should_stop(trainer, step) -> bool`` -- True ends the run after this step, with a
  checkpoint, as SIGTERM does;
* ``on_end(trainer, summary)`` -- `Trainer.train` returns `summary`;
* ``close()`` -- the trainer closes.

`zoo.train.evaluation.Evaluate` (the held-out loss, ``eval_every``) comes first, so the
loggers write its columns. The loggers users already read are hooks: `MetricsFile`
(``metrics.jsonl``), `Progress` (a tqdm bar), `TensorBoard` (event files under
``RUN_DIR/tensorboard``), `Wandb` (Weights & Biases, when installed and asked for), `LossPlot`
(``loss.png``). The loggers write on process 0 only; a hook of one's own runs on every
process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["Hook", "MetricsFile", "Progress", "TensorBoard", "Wandb", "LossPlot", "OnStep",
           "default_hooks", "read_metrics", "repair_metrics", "plot_loss", "metrics_row",
           "SCALARS"]

# the metrics.jsonl columns the scalar loggers (TensorBoard, W&B) plot
SCALARS = ("loss", "aux_loss", "objective", "grad_norm", "param_norm", "lr", "tokens_per_s",
           "model_flops_per_s", "step_time_s", "data_time_s", "target_tokens", "dropped_tokens",
           "expert_max_over_mean", "eval_loss", "eval_ppl", "mtp_loss", "moe_rounds")


class Hook:
    """The hook interface; subclass and override what you need."""

    def on_start(self, trainer) -> None:
        pass

    def on_step(self, trainer, step: int, row: dict[str, Any]) -> None:
        pass

    def on_checkpoint(self, trainer, step: int) -> None:
        pass

    def needs_model(self, trainer, step: int) -> bool:
        return False

    def should_stop(self, trainer, step: int) -> bool:
        return False

    def on_end(self, trainer, summary) -> None:
        pass

    def close(self) -> None:
        pass


def _main_process() -> bool:
    import jax
    return jax.process_index() == 0


# -- metrics.jsonl -----------------------------------------------------------------------------

def _parse_row(line: bytes) -> dict[str, Any] | None:
    """A metrics row from one line of bytes (None: garbage, bad UTF-8, not a JSON object)."""
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return row if isinstance(row, dict) else None


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (empty if none); damaged lines are skipped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        rows = [_parse_row(line) for line in f if line.strip()]
    return [r for r in rows if r is not None]


def repair_metrics(path: str, step: int) -> list[int]:
    """Make ``metrics.jsonl`` fit a run resumed at `step`: rows past `step` are dropped (those
    steps are about to be redone), a torn last line (no newline: a write cut short) is cut, and
    any damaged line (garbage, bad UTF-8, JSON that is not an object; the torn one included)
    is appended to ``metrics.jsonl.corrupt``, never lost, and named in a warning. Returns the
    damaged lines' 1-based numbers."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    torn = lines[-1]  # b"" when the file ends with a newline
    kept, bad = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = _parse_row(line)
        if row is None:
            bad.append(n)
        elif not isinstance(row.get("step"), int) or row["step"] <= step:
            kept.append(line)
    if bad:
        with open(path + ".corrupt", "ab") as f:
            f.write(b"".join(lines[n - 1] + b"\n" for n in bad))
    if len(kept) != len(lines) - 1 or torn:
        with open(path + ".tmp", "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
        os.replace(path + ".tmp", path)
    if bad:
        import warnings
        warnings.warn(f"{path}: {len(bad)} damaged line(s) (line {', '.join(map(str, bad))}) "
                      f"moved to {path}.corrupt; the other rows are kept", stacklevel=2)
    return bad


class MetricsFile(Hook):
    """One JSON line per step in ``RUN_DIR/metrics.jsonl``, each written whole by one
    ``write`` call on an unbuffered append-only file (``fsync=True`` also syncs it to disk);
    a resumed run first repairs the file (`repair_metrics`), then appends."""

    def __init__(self, run_dir: str | os.PathLike, *, fsync: bool = False):
        self.path = os.path.join(os.fspath(run_dir), "metrics.jsonl")
        self.fsync = fsync
        self._fd: int | None = None

    def on_start(self, trainer) -> None:
        if _main_process() and self._fd is None:
            repair_metrics(self.path, trainer.step)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def on_step(self, trainer, step, row) -> None:
        if self._fd is not None:
            data = (json.dumps(row) + "\n").encode()
            written = os.write(self._fd, data)
            if written < len(data):  # e.g. the disk filled: finish the row or fail
                os.write(self._fd, data[written:])
            if self.fsync:
                os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def metrics_row(f, out: Mapping[str, Any], dt: float, tokens_per_step: int,
                 flops_per_token: float) -> dict[str, Any]:
    """The metrics.jsonl row of one step (`f`: the step, its data time) from its device
    metrics `out`, `dt` seconds after the previous one."""
    row = dict(step=f.step, loss=float(out["loss"]), aux_loss=float(out["aux_loss"]),
               objective=float(out["objective"]), grad_norm=float(out["grad_norm"]),
               param_norm=float(out["param_norm"]))
    if "lr" in out:
        row["lr"] = float(out["lr"])
    row.update(tokens_per_s=tokens_per_step / dt,
               model_flops_per_s=flops_per_token * tokens_per_step / dt, step_time_s=dt,
               data_time_s=f.t_data, target_tokens=int(out["weight_sum"]))
    for key in ("dropped_tokens", "moe_rounds"):  # MoE copies over all_to_all buffers
        if key in out:
            row[key] = int(out[key])
    for key in ("mtp_loss",):
        if key in out:
            row[key] = float(out[key])
    counts = out.get("expert_counts")
    if counts is not None:
        counts = np.asarray(counts, np.float64).reshape(-1, np.shape(counts)[-1])
        mean = np.maximum(counts.mean(-1), 1e-9)
        row["expert_max_over_mean"] = float(np.max(counts.max(-1) / mean))
        if counts.size <= 1024:
            row["expert_counts"] = counts.astype(np.int64).tolist()
    return row


# -- terminal ----------------------------------------------------------------------------------

class Progress(Hook):
    """A tqdm bar: step, loss, tokens/s, ETA (process 0)."""

    def __init__(self, name: str = "train"):
        self.name = name
        self._bar = None

    def on_start(self, trainer) -> None:
        if not _main_process():
            return
        from tqdm.auto import tqdm
        if self._bar is not None:
            self._bar.close()
        self._bar = tqdm(total=trainer.config.steps, initial=trainer.step, unit="step",
                         dynamic_ncols=True, mininterval=0.5, desc=self.name)

    def on_step(self, trainer, step, row) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                                  refresh=False)
            if "eval_loss" in row:
                self._bar.write(f"{self.name}: step {step}: eval_loss {row['eval_loss']:.3f}, "
                                f"perplexity {row['eval_ppl']:.2f} (held out)")

    def on_end(self, trainer, summary) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class OnStep(Hook):
    """``fn(step, row)`` after each step (the recipes' ``main(on_step=...)``)."""

    def __init__(self, fn: Callable[[int, dict[str, Any]], None]):
        self.fn = fn

    def on_step(self, trainer, step, row) -> None:
        self.fn(step, row)


# -- loggers -----------------------------------------------------------------------------------

def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(row[k]) for k in SCALARS if isinstance(row.get(k), (int, float))}


class TensorBoard(Hook):
    """TensorBoard event files (tensorboardX) under ``RUN_DIR/tensorboard``: one scalar per
    `metrics.jsonl` column of `SCALARS`, at its step (``tensorboard --logdir RUN_DIR``)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.logdir = os.path.join(os.fspath(run_dir), "tensorboard")
        self._writer = None

    def on_start(self, trainer) -> None:
        if _main_process() and self._writer is None:
            from tensorboardX import SummaryWriter
            self._writer = SummaryWriter(logdir=self.logdir, purge_step=trainer.step + 1)

    def on_step(self, trainer, step, row) -> None:
        if self._writer is not None:
            for k, v in _scalars(row).items():
                self._writer.add_scalar(k, v, global_step=step)

    def on_checkpoint(self, trainer, step) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def wandb_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("wandb") is not None


class Wandb(Hook):
    """Weights & Biases: one run per run dir (resumed by the id kept in
    ``RUN_DIR/wandb_id``), the settings as its config, the `SCALARS` per step."""

    def __init__(self, project: str, run_dir: str | os.PathLike, **init_kwargs: Any):
        if not wandb_available():
            raise ValueError(f"--wandb {project}: the wandb package is not installed; run "
                             f"`pip install wandb`, or leave --wandb out")
        self.project, self.run_dir, self.init_kwargs = project, os.fspath(run_dir), init_kwargs
        self._run = None

    def _run_id(self) -> str:
        path = os.path.join(self.run_dir, "wandb_id")
        if os.path.exists(path):
            with open(path) as f:
                return f.read().strip()
        import secrets
        run_id = secrets.token_hex(8)
        with open(path, "w") as f:
            f.write(run_id)
        return run_id

    def on_start(self, trainer) -> None:
        if _main_process() and self._run is None:
            import wandb
            self._run = wandb.init(project=self.project, dir=self.run_dir, id=self._run_id(),
                                   resume="allow", config=trainer.record, **self.init_kwargs)

    def on_step(self, trainer, step, row) -> None:
        if self._run is not None:
            self._run.log(_scalars(row), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def plot_loss(run_dir: str | os.PathLike) -> str | None:
    """Write ``run_dir/loss.png`` from ``metrics.jsonl`` (the training loss, and the
    evaluation loss where rows hold one); returns its path (None: no rows)."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    train = [r for r in rows if "loss" in r]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1.2, label="train")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", lw=1.2,
                label="eval")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(os.path.basename(os.path.abspath(run_dir)))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(run_dir, "loss.png")
    fig.savefig(path)
    plt.close(fig)
    return path


class LossPlot(Hook):
    """``RUN_DIR/loss.png`` at the end of each `Trainer.train`."""

    def on_end(self, trainer, summary) -> None:
        if _main_process():
            plot_loss(trainer.run_dir)


def default_hooks(config, run_dir: str, name: str) -> list[Hook]:
    """The hooks a run has unless told otherwise: the held-out evaluation (if
    ``config.eval_every``), metrics.jsonl, the progress bar (if ``config.progress``),
    TensorBoard (if ``config.tensorboard``), W&B (if ``config.wandb`` names a project) and the
    loss plot."""
    hooks: list[Hook] = []
    if config.eval_every:
        from zoo.train.evaluation import Evaluate
        hooks.append(Evaluate(config.eval_every, config.eval_batches))
    hooks.append(MetricsFile(run_dir))
    if config.progress:
        hooks.append(Progress(name))
    if config.tensorboard:
        hooks.append(TensorBoard(run_dir))
    if config.wandb:
        hooks.append(Wandb(config.wandb, run_dir))
    hooks.append(LossPlot())
    return hooks
