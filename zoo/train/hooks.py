"""Trainer hooks: what a run reports and when it stops, as small objects.

A hook is any object with some of these methods (`Hook` has them all, doing nothing):

* ``check(trainer)`` -- before anything is compiled or restored: raise `LoggingFailed` if the
  hook cannot write where it will (the loggers probe their file or folder);
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

A logger that cannot write (its file or folder unwritable, the disk full) raises
`LoggingFailed` naming the path and the reason, at its ``check`` (before compiling) or at the
write or flush that failed; the trainer stops the run on it (the recipes exit 7) and the
checkpoints on disk stay as they are. TensorBoard's events are written in the calling thread
(no writer thread whose failure would go unseen), flushed at each checkpoint and at the end.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["Hook", "LoggingFailed", "MetricsFile", "Progress", "TensorBoard", "Wandb", "LossPlot",
           "OnStep", "read_metrics", "repair_metrics", "plot_loss",
           "metrics_row", "SCALARS", "probe_file", "probe_folder"]

# the metrics.jsonl columns the scalar loggers (TensorBoard, W&B) plot
SCALARS = ("loss", "aux_loss", "objective", "grad_norm", "param_norm", "lr", "tokens_per_s",
           "model_flops_per_s", "step_time_s", "data_time_s", "target_tokens", "dropped_tokens",
           "expert_max_over_mean", "eval_loss", "eval_ppl", "mtp_loss", "moe_rounds",
           "indexer_loss", "fp8/saturated_blocks", "fp8/underflow")


class LoggingFailed(RuntimeError):
    """A logger cannot write its file or folder (unwritable, the disk full); the message names
    the path and the reason, ``hint`` another way out (e.g. turning that logger off). The run
    stops; the checkpoints on disk are kept."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class Hook:
    """The hook interface; subclass and override what you need."""

    def check(self, trainer) -> None:
        pass

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


# -- writing, and what stops it ----------------------------------------------------------------

_WORDS = {errno.EISDIR: "it is a folder, not a file", errno.ENOTDIR: "it is not a folder",
          errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
          errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
          errno.EPERM: "permission denied"}


def _failed(what: str, path: str, e: OSError, hint: str = "") -> LoggingFailed:
    reason = _WORDS.get(e.errno, "")
    reason = f"{reason} ({type(e).__name__}: {e})" if reason else f"{type(e).__name__}: {e}"
    return LoggingFailed(f"{what}: cannot write {path}: {reason}", hint)


def probe_file(path: str) -> None:
    """Open `path` for appending, as `MetricsFile` does, and close it: nothing is written, and
    a file created for the probe is removed. Raises `OSError` (a folder or anything else that
    is not a regular file, no permission, a read-only file system)."""
    existed = os.path.lexists(path)
    if existed and not os.path.isfile(path):
        code = errno.EISDIR if os.path.isdir(path) else errno.EINVAL
        raise OSError(code, "not a regular file" if code == errno.EINVAL else
                      os.strerror(code), path)
    os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    if not existed:
        os.unlink(path)


def probe_folder(path: str) -> None:
    """Create a file in folder `path` (made if missing) and remove it, as `probe_file`; a
    folder made for the probe is removed too. Raises `OSError`."""
    made = not os.path.lexists(path)
    if made:
        os.makedirs(path)
    elif not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    probe = os.path.join(path, f".zoo-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        os.unlink(probe)
    finally:
        if made:
            os.rmdir(path)


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

    def check(self, trainer) -> None:
        if _main_process():
            try:
                probe_file(self.path)
            except OSError as e:
                raise _failed("metrics.jsonl", self.path, e) from None

    def on_start(self, trainer) -> None:
        if _main_process() and self._fd is None:
            try:
                repair_metrics(self.path, trainer.step)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:
                raise _failed("metrics.jsonl", self.path, e) from None

    def on_step(self, trainer, step, row) -> None:
        if self._fd is not None:
            data = (json.dumps(row) + "\n").encode()
            try:
                written = os.write(self._fd, data)
                if written < len(data):  # e.g. the disk filled: finish the row or fail
                    os.write(self._fd, data[written:])
                if self.fsync:
                    os.fsync(self._fd)
            except OSError as e:  # a torn row is cut by the resume (`repair_metrics`)
                self.close()
                raise _failed("metrics.jsonl", self.path, e) from None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass  # every row was written by its own call (or its failure reported)


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
    for key in ("mtp_loss", "indexer_loss", "fp8/saturated_blocks", "fp8/underflow"):
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
            fp8 = ({} if "fp8/underflow" not in row else  # FP8 layers: quantisation's losses
                   dict(fp8_sat=f"{row['fp8/saturated_blocks']:.1e}",
                        fp8_under=f"{row['fp8/underflow']:.1e}"))
            self._bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                                  **fp8, refresh=False)
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
    """TensorBoard event files under ``RUN_DIR/tensorboard``: one scalar per `metrics.jsonl`
    column of `SCALARS`, at its step (``tensorboard --logdir RUN_DIR``). Written with
    tensorboardX's event writer in the calling thread, flushed at each checkpoint and at the
    end; a failed write or flush raises `LoggingFailed`. A resumed run's first event tells
    TensorBoard to drop the events past the step it resumed from."""

    _HINT = "or leave TensorBoard out (--no-tensorboard)"

    def __init__(self, run_dir: str | os.PathLike):
        self.logdir = os.path.join(os.fspath(run_dir), "tensorboard")
        self._writer = None  # tensorboardX.event_file_writer.EventsWriter

    def check(self, trainer) -> None:
        if _main_process():
            try:
                probe_folder(self.logdir)
            except OSError as e:
                raise _failed("TensorBoard", self.logdir, e, self._HINT) from None

    def on_start(self, trainer) -> None:
        if _main_process() and self._writer is None:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            purge = trainer.step + 1
            self._write(lambda: os.makedirs(self.logdir, exist_ok=True))
            self._writer = self._write(lambda: EventsWriter(os.path.join(self.logdir, "events")))
            self._write(lambda: self._writer.write_event(
                Event(step=purge, file_version="brain.Event:2")))
            self._write(lambda: self._writer.write_event(
                Event(step=purge, session_log=SessionLog(status=SessionLog.START))))

    def on_step(self, trainer, step, row) -> None:
        if self._writer is not None:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import scalar
            now = time.time()
            for k, v in _scalars(row).items():
                self._write(self._writer.write_event,
                            Event(wall_time=now, step=step, summary=scalar(k, v)))

    def on_checkpoint(self, trainer, step) -> None:
        if self._writer is not None:
            self._write(self._writer.flush)

    def on_end(self, trainer, summary) -> None:
        if self._writer is not None:
            self._write(self._writer.flush)

    def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            self.close()
            raise _failed("TensorBoard", self.logdir, e, self._HINT) from None

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except OSError:
                pass  # the run has failed already, or ended with a flush (`on_end`)


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
            try:
                plot_loss(trainer.run_dir)
            except OSError as e:
                raise _failed("loss.png", os.path.join(trainer.run_dir, "loss.png"), e) from None
