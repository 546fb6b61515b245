"""The `Trainer`: create or resume, compile, step, check, checkpoint, stop cleanly.

``Trainer(config)`` builds everything with `zoo.train.build` (or takes a `Built`), and
``trainer.train(steps=None)`` trains until ``steps`` updates are done (default: the planned
``config.steps``), returning a `Summary` (``summary.line()`` is the closing line the recipes
print; the trainer itself prints only progress to stderr). Calling `train` again continues
from there; a run dir whose checkpoint is already there returns at once, nothing compiled or
restored (``trainer.model`` stays None; `zoo.train.load` gives that model).

* **checks first** -- the run dir is created, probed and locked (process 0); an existing
  checkpoint's model shapes and data-pipeline arguments are compared with this run's before
  anything is compiled (`IncompatibleCheckpoint`, `zoo.data.PipelineStateMismatch`), and the
  data stream proves it yields a first batch with a target (`NoTrainingData`, `Feed.probe`).
* **compile beside the restore** -- the train step is compiled ahead of time in a background
  thread while the model is restored or created, so step 1's time is a real step time. A
  SIGTERM/SIGINT during the compile ends the run at once with `CompileInterrupted` (nothing
  was trained; the lock is released by `close`).
* **each step, no host sync** -- a step is dispatched before the previous one's metrics are
  read, so the device always has work queued while the host logs. A step's metrics are
  checked before anything of it is written or saved (`zoo.train.guard`): a NaN/Inf loss,
  gradient norm, parameter norm or updated state raises `TrainingDiverged`; so does a loss
  above ``divergence_factor`` x the best of the last 100 steps for 10 steps in a row. While
  the loss is above that bound no checkpoint is written; when the run stops for it, the
  checkpoints saved from the state that first produced the risen loss onwards are moved aside
  to ``checkpoints/diverged-<step>``, so a rerun resumes from the last good one.
* **hooks** -- (`zoo.train.hooks`) the held-out loss (``eval_every``), metrics.jsonl, progress
  bar, TensorBoard, W&B and loss plot, plus ``hooks=``; a step some hook ``needs_model`` for is
  finished before the next is dispatched, so its ``on_step`` sees that step's model.
  A logger that cannot write (its file or folder unwritable, checked before compiling; the
  disk full) raises `zoo.train.hooks.LoggingFailed`: the save in flight is awaited (its own
  failure, `CheckpointSaveFailed`, comes first), the message names the last good checkpoint.
* **checkpoints** -- every ``checkpoint_every`` steps, at the end of each `train`, and when
  SIGTERM/SIGINT arrives: the step in flight finishes and is saved; several processes agree
  through a flag reduced on the devices with the step. A hook with a ``should_stop`` of its
  own has each step finished before the next is dispatched, so the run ends (and saves) after
  the very step whose metrics made it true. Each
  asynchronous save's result is checked at every step after it and before the next save
  starts: a failed one (no space, read-only, permission) or one past the save timeout raises
  `CheckpointSaveFailed`, naming the last good checkpoint on disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from zoo.train import guard, hooks as hooks_lib
from zoo.train import step as step_lib
from zoo.train.build import Built, build
from zoo.train.checkpoint import (CheckpointSaveFailed, Checkpointer, shape_differences,
                                  to_pure)
from zoo.train.config import TrainConfig
from zoo.train.evaluation import Evaluate
from zoo.train.feed import DataStreamError, Feed, NoTrainingData
from zoo.train.records import Summary, changes, normalise, versions, write_json

__all__ = ["Trainer", "standard_hooks", "Summary", "TrainingDiverged", "IncompatibleCheckpoint",
           "CompileInterrupted", "DataStreamError", "NoTrainingData", "CheckpointSaveFailed"]

_HISTORY_KEY = "loss_history"  # saved beside the run config in each checkpoint
MIN_TIMED_STEPS = 2  # steps past a run's first that the summary's tokens/s needs


class TrainingDiverged(RuntimeError):
    """A NaN/Inf loss or norm, or a loss far above its best (`zoo.train.guard`); unsaved."""


class IncompatibleCheckpoint(ValueError):
    """The run dir's checkpoint holds a model of other shapes than the one asked for."""


class CompileInterrupted(RuntimeError):
    """A signal arrived while the train step compiled: nothing was trained or saved."""


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    out: dict[str, Any]           # device arrays
    stop: Any                     # device scalar from StopAgreement, or None (one process)
    t0: float                     # when its batch was requested
    t_data: float


def _background(name: str, fn, *args) -> threading.Thread:
    """`fn(*args)` in a daemon thread; its exception lands in the last argument (a dict)."""
    out = args[-1]

    def run():
        try:
            fn(*args)
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _as_built(settings: TrainConfig | Built, **kwargs) -> Built:
    return settings if isinstance(settings, Built) else build(settings, **kwargs)


# -- the trainer -------------------------------------------------------------------------------


def standard_hooks(config, run_dir: str, name: str) -> list[hooks_lib.Hook]:
    """The hooks a run has unless told otherwise: the held-out evaluation (if
    ``config.eval_every``), metrics.jsonl, the progress bar (if ``config.progress``),
    TensorBoard (if ``config.tensorboard``), W&B (if ``config.wandb`` names a project) and the
    loss plot."""
    hooks: list[hooks_lib.Hook] = []
    if config.eval_every:
        hooks.append(Evaluate(config.eval_every, config.eval_batches))
    hooks.append(hooks_lib.MetricsFile(run_dir))
    if config.progress:
        hooks.append(hooks_lib.Progress(name))
    if config.tensorboard:
        hooks.append(hooks_lib.TensorBoard(run_dir))
    if config.wandb:
        hooks.append(hooks_lib.Wandb(config.wandb, run_dir))
    hooks.append(hooks_lib.LossPlot())
    return hooks


class Trainer:
    """Runs training for a `TrainConfig` (see the module docstring).

    Args:
      config: the settings, or a `Built` (`zoo.train.build`) to train as it is.
      tx, schedule: an optax transformation instead of the default AdamW, and optionally
        the schedule it follows (logged as ``lr``); see `zoo.train.step.make_train_step`.
      hooks: more hooks after the default loggers (`zoo.train.hooks`).
      model_config, model_cls, decoder_layer_cls: passed to `build`.
      name: the run's name in messages (default: the family); the run dir defaults to
        ``runs/<name>``.
      default_hooks: False keeps only `hooks` (no metrics.jsonl, bar, TensorBoard, plot).
      lock: take the run dir's lock (`zoo.train.lock`) on process 0.
    """

    def __init__(self, config: TrainConfig | Built, *, tx: Any = None, schedule: Any = None,
                 hooks: Sequence[Any] = (), model_config: Any = None,
                 model_cls: type | None = None, decoder_layer_cls: type | None = None,
                 name: str | None = None, default_hooks: bool = True, lock: bool = True):
        self.built = _as_built(config, tx=tx, schedule=schedule, model_config=model_config,
                               model_cls=model_cls, decoder_layer_cls=decoder_layer_cls)
        self.name = name or self.built.config.family or "train"
        if self.built.config.run_dir is None:
            self.built.config = self.built.config.replace(run_dir=os.path.join("runs",
                                                                                self.name))
        self.config = self.built.config
        self.run_dir = os.path.abspath(self.config.run_dir)
        self.record = normalise(dict(self.built.record, recipe=self.name,
                                     train=dataclasses.asdict(self.config)))
        self.hooks = [*(standard_hooks(self.config, self.run_dir, self.name)
                        if default_hooks else []), *hooks]
        self.model = self.optimizer = None
        self.step = 0
        self.compile_s = 0.0
        self._lock, self._take_lock = None, lock
        self._ckpt: Checkpointer | None = None
        self._step_fn = None
        self._monitor: guard.DivergenceMonitor | None = None
        self._saved_step: int | None = None
        self._agree = None
        self._feed: Feed | None = None
        self._data_restart: dict[str, Any] | None = None  # set when resuming on other data
        self.abandoned: list[threading.Thread] = []  # still running after a compile signal

    # -- public --------------------------------------------------------------------------------
    def train(self, steps: int | None = None) -> Summary:
        """Train until `steps` updates are done (default ``config.steps``); see the module
        docstring. Raises `TrainingDiverged`, `IncompatibleCheckpoint`, `NoTrainingData`,
        `zoo.data.PipelineStateMismatch`, `DataStreamError`, `CheckpointSaveFailed`,
        `zoo.train.hooks.LoggingFailed` or `CompileInterrupted`."""
        t_start = time.perf_counter()
        target = self.config.steps if steps is None else int(steps)
        with guard.StopFlag() as stop:
            if not self._prepare(stop, target) or self.step >= target:
                return self._already_done(self.step, target, t_start)
            start = self.step
            self._hooks("on_start")
            stopped_by, losses, speeds = self._run(target, stop)
        timed = speeds[1:]  # the first step of a run or resume carries first-call costs
        summary = Summary(self.run_dir, start, self.step, self.config.steps, stopped_by,
                          losses[0] if losses else None, losses[-1] if losses else None,
                          statistics.median(timed) if len(timed) >= MIN_TIMED_STEPS else None,
                          self.compile_s, time.perf_counter() - t_start, self.name,
                          target=target)
        self._ckpt.wait()
        self._hooks("on_end", summary)
        return summary

    def save(self) -> None:
        """Checkpoint the current state (if this step is not saved yet) and wait for it."""
        if self.model is None:
            raise RuntimeError("Trainer.save: nothing to save before train() has run")
        if self._saved_step != self.step:
            self._save(self.step)
        self._ckpt.wait()

    def close(self) -> None:
        """Finish pending saves, close the loggers and the data, release the run dir."""
        try:
            if self._ckpt is not None:
                ckpt, self._ckpt = self._ckpt, None
                ckpt.close()  # waits for the save in flight (bounded)
            self._hooks("close", pass_trainer=False)
            getattr(self._feed or self.built.data, "close", lambda: None)()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _hooks(self, method: str, *args, pass_trainer: bool = True) -> None:
        """Call `method` on every hook that has it (a hook's methods are all optional)."""
        for hook in self.hooks:
            fn = getattr(hook, method, None)
            if fn is not None:
                try:
                    fn(*((self, *args) if pass_trainer else args))
                except hooks_lib.LoggingFailed as e:
                    raise self._logging_failed(e) from None

    def _logging_failed(self, e: hooks_lib.LoggingFailed) -> Exception:
        """A logger cannot write: the save in flight is awaited first (when it failed too, as
        on a full disk, its `CheckpointSaveFailed` is the error), then the run stops here."""
        hint = f" ({e.hint})" if e.hint else ""
        if self._ckpt is None or self._step_fn is None:
            return hooks_lib.LoggingFailed(
                f"{e}. Nothing was trained (checked before compiling). Make that path "
                f"writable or free space{hint}, then rerun the same command")
        self._ckpt.wait()  # raises CheckpointSaveFailed
        return hooks_lib.LoggingFailed(
            f"{e}. Training stopped at step {self.step}; {guard.last_checkpoint(self._ckpt)}. "
            f"Free space or make that path writable{hint}, then rerun the same command to "
            f"resume")

    def _check_loggers(self) -> None:
        """Every hook's ``check`` (the loggers probe their files) before anything is compiled;
        with several processes they agree, so that all stop or none."""
        problem = None
        try:
            self._hooks("check")
        except hooks_lib.LoggingFailed as e:
            problem = e
        if jax.process_count() > 1:
            from zoo.train.checkpoint import all_processes_agree
            if not all_processes_agree(problem is None) and problem is None:
                problem = hooks_lib.LoggingFailed(
                    "another process of this job cannot write its logs (see its message)")
        if problem is not None:
            raise problem

    # -- preparation ---------------------------------------------------------------------------
    def _prepare(self, stop: guard.StopFlag, target: int) -> bool:
        """Once: lock, checks against the run dir, compile beside restore/create, run.json.
        False, with nothing compiled or restored: the run dir's checkpoint is already at
        `target` (``self.step`` is its step)."""
        if self._step_fn is not None:
            return True
        from zoo.train import validate
        from zoo.train.lock import RunLock
        validate.check_run_dir(self.run_dir)
        if self._take_lock and jax.process_index() == 0 and self._lock is None:
            self._lock = RunLock(self.run_dir).acquire()
        if self._ckpt is None:
            self._ckpt = Checkpointer(os.path.join(self.run_dir, "checkpoints"),
                                      max_to_keep=self.config.max_to_keep)
        model, optimizer = self.built.abstract_state()
        self._check_run_dir(model, optimizer)
        done = self._finished_step(target)
        if done is not None:
            self.step = done
            return False
        self._check_loggers()
        self._feed = Feed(self.built.data, files=self.built.data_files,
                          timeout_s=self.config.data_timeout)
        self._feed.probe(stop)  # a first batch with a target, before anything is compiled
        if jax.process_index() == 0:
            print(f"{self.name}: compiling the train step ...", file=sys.stderr, flush=True)
        # compile from shapes while the model is restored or created; the main thread only
        # waits, so a signal is seen at once
        compiled: dict[str, Any] = {}
        made: dict[str, Any] = {}
        threads = [_background("zoo-compile", self._compile, model, optimizer, compiled),
                   _background("zoo-create", self._create, model, optimizer, made)]
        stop.compiling = True
        while any(t.is_alive() for t in threads):
            next(t for t in threads if t.is_alive()).join(0.2)
            if stop.signal is not None:
                self.abandoned = [t for t in threads if t.is_alive()]  # a script exits without
                raise CompileInterrupted(f"{stop.signal} during the compile: nothing was "
                                         f"trained or saved; rerun to start")
        stop.compiling = False
        for out in (made, compiled):
            if "error" in out:
                raise out["error"]
        history = made["history"]
        self._step_fn, self.compile_s = compiled["fn"], compiled["s"]
        self._monitor = guard.DivergenceMonitor(self.config.divergence_factor, history=history)
        self._agree = guard.StopAgreement(self.built.mesh) if jax.process_count() > 1 else None
        if jax.process_index() == 0:
            print(f"{self.name}: compiled in {self.compile_s:.1f}s", file=sys.stderr, flush=True)
            self._write_run_info()
        return True

    def _finished_step(self, target: int) -> int | None:
        """The latest checkpoint's step when it is intact (its digests match), readable and
        at or past `target`."""
        step = self._ckpt.latest_step()
        if step is None or step < target:
            return None
        if not self._ckpt.intact(step):
            return None  # corrupt or unverified: the restore sets it aside and falls back
        try:
            self._ckpt.read_config(step)
        except Exception:
            return None  # unreadable: the restore falls back to an older one
        return step

    def _compile(self, model, optimizer, out: dict[str, Any]) -> None:
        t = time.perf_counter()
        out["fn"] = self.built.train_step.lower(
            model, optimizer, self.built.batch_abstract(), np.float32(0)).compile()
        out["s"] = time.perf_counter() - t

    def _create(self, model, optimizer, out: dict[str, Any]) -> None:
        out["history"] = self._restore_or_create(model, optimizer)

    def _check_run_dir(self, model, optimizer) -> None:
        """The latest checkpoint against this run: model shapes and data arguments, from its
        config and array metadata alone (before anything is compiled or read)."""
        step = self._ckpt.latest_step()
        if step is None:
            return
        try:
            saved = self._ckpt.read_config(step)
        except Exception:
            return  # unreadable: the restore falls back to an older one (with a warning)
        changed = changes(saved.get("model"), self.record.get("model", {}))
        if changed:
            diffs = shape_differences(self._ckpt.saved_shapes(step)["model"],
                                      to_pure(model, optimizer)["model"])
            if diffs:
                raise IncompatibleCheckpoint(
                    f"{self._ckpt.directory} holds a model of another shape (step {step}); "
                    f"changed model fields: {'; '.join(changed)}. Parameter shapes that "
                    f"differ: {'; '.join(diffs)}. Use another --run-dir, or undo the changes "
                    f"to resume")
            warnings.warn(f"model config changed since step {step} without changing shapes; "
                          f"resuming anyway: {'; '.join(changed)}", stacklevel=3)
        self._check_data_arguments(step, saved.get("data_arguments"))

    def _check_data_arguments(self, step: int, saved: dict | None) -> None:
        """Other data than the checkpoint's: refused, or (``data_changed="restart"``) noted
        so the restore keeps the weights and optimizer and starts the stream afresh."""
        now = self.record.get("data_arguments")
        if not saved or not now or saved == now:
            return
        from zoo.data import argument_changes
        diffs = argument_changes(saved, now)
        if not diffs:
            return
        if self.config.data_changed == "restart":
            self._data_restart = dict(step=step, changes=diffs)
            return
        from zoo.data import PipelineStateMismatch
        raise PipelineStateMismatch(
            f"{self._ckpt.directory} (step {step}) holds a data-pipeline state saved with "
            f"other arguments: {'; '.join(diffs)}. Resume with the saved arguments; or pass "
            f"--data-changed restart to keep the weights and optimizer and restart the data "
            f"stream on the new data; or start a new run (another --run-dir)")

    def _restore_or_create(self, model, optimizer) -> list:
        restored = self._ckpt.restore(model, optimizer) if self._ckpt.steps() else None
        if restored is None:
            self.model, self.optimizer = self.built.create_sharded()
            self.step, self._saved_step = 0, None
            return []
        self.model, self.optimizer = restored.model, restored.optimizer
        if self._data_restart is None:
            self._feed.set_state(restored.data)
        elif jax.process_index() == 0:
            print(f"{self.name}: the data changed since step {restored.step} "
                  f"({'; '.join(self._data_restart['changes'])}); --data-changed restart: the "
                  f"data stream starts afresh", file=sys.stderr, flush=True)
        self.step = self._saved_step = restored.step
        changed = [c for c in changes({k: v for k, v in restored.config.items()
                                        if k not in ("model", _HISTORY_KEY)},
                                       {k: v for k, v in self.record.items() if k != "model"})]
        if jax.process_index() == 0:
            extra = (f" (changed: {', '.join(c.split(':')[0] for c in changed)})"
                     if changed else "")
            print(f"{self.name}: resuming from step {self.step}{extra}", file=sys.stderr,
                  flush=True)
        return restored.config.get(_HISTORY_KEY) or []

    def _write_run_info(self) -> None:
        mesh = self.built.mesh
        info = dict(config=self.record, device_count=jax.device_count(),
                    local_device_count=jax.local_device_count(),
                    process_count=jax.process_count(), backend=jax.default_backend(),
                    mesh=dict(mesh.shape), versions=versions(),
                    resumed_from=self.step or None, flops_per_token=self.flops_per_token,
                    tokens_per_step=self.tokens_per_step,
                    data_restarts=self._data_restarts())
        write_json(os.path.join(self.run_dir, "run.json"), info)

    def _data_restarts(self) -> list[dict[str, Any]]:
        """run.json's record of the resumes that restarted the data (``--data-changed
        restart``): the earlier ones, kept from the previous run.json, and this one."""
        try:
            with open(os.path.join(self.run_dir, "run.json")) as f:
                earlier = list(json.load(f).get("data_restarts") or [])
        except (OSError, ValueError, AttributeError, TypeError):
            earlier = []
        return earlier + ([self._data_restart] if self._data_restart else [])

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.config.seq_len

    @property
    def flops_per_token(self) -> float:
        if self.built.flops_per_token is not None:
            return self.built.flops_per_token
        from zoo.models import count_params
        return 6.0 * count_params(self.built.abstract_state()[0])

    def _already_done(self, start: int, target: int, t_start: float) -> Summary:
        """Nothing to train: the summary says so (`Summary.line`)."""
        return Summary(self.run_dir, start, start, self.config.steps, None, None, None, None,
                       self.compile_s, time.perf_counter() - t_start, self.name, target=target)

    # -- the steps -----------------------------------------------------------------------------
    def _run(self, target: int, stop: guard.StopFlag) -> tuple[str | None, list, list]:
        """Steps until `target`; returns (what stopped it early or None, losses, tokens/s)."""
        self._losses, self._speeds, self._last_ready = [], [], time.perf_counter()
        self._stop_agreed, self._hook_stop, held_back = False, None, False
        pending: _InFlight | None = None
        try:
            while self.step < target:
                try:
                    flight = self._dispatch(stop)
                except DataStreamError as e:
                    raise self._data_failed(e, pending) from None
                if flight is None:  # SIGTERM while waiting for data: save what was reached
                    if pending is not None:
                        self._finish(pending)
                    self._checkpoint(held_back)
                    return stop.signal, self._losses, self._speeds
                if pending is not None:  # the previous step, while this one runs
                    self._finish(pending)
                pending = flight
                stopping = self._stopping(stop)
                save = self.step % self.config.checkpoint_every == 0 or self.step == target
                stop_hooks = self._stop_hooks()
                if save or stopping or stop_hooks or self._model_needed(self.step):
                    pending = None  # this step's state: finished before the next is dispatched
                    self._finish(flight)
                    if stop_hooks and self._agree is not None:  # all processes, this step
                        want = stop.signal is not None or self._hook_stop is not None
                        self._stop_agreed |= bool(int(jax.device_get(self._agree(want))))
                    stopping = self._stopping(stop)
                    held_back = self._checkpoint(held_back) if save or stopping else held_back
                if self._monitor.rising and self._monitor.first_rise is not None:
                    guard.protect_last_good(self._ckpt, self._monitor.first_rise)
                if stopping:
                    return (stop.signal or self._hook_stop or "a signal to another process",
                            self._losses, self._speeds)
        except TrainingDiverged as e:
            raise self._diverged(e) from None
        return None, self._losses, self._speeds

    def _data_failed(self, e: DataStreamError, pending: _InFlight | None) -> DataStreamError:
        """Save the state the model reached on the batches it got, then say so."""
        if pending is not None:
            self._finish(pending)
        if self._saved_step != self.step and not self._monitor.rising:
            self._save(self.step)
            self._ckpt.wait()
        return DataStreamError(f"{e}. Training stopped at step {self.step}; "
                               f"{guard.last_checkpoint(self._ckpt)}. Fix the data, then rerun "
                               f"to resume (or start over on new files with another --run-dir)")

    def _stop_hooks(self) -> bool:
        """Whether a hook has a ``should_stop`` of its own: the run then finishes each step
        before dispatching the next, so it ends after the step whose metrics asked."""
        return any(getattr(type(h), "should_stop", None) not in (None, hooks_lib.Hook.should_stop)
                   for h in self.hooks)

    def _model_needed(self, step: int) -> bool:
        """A hook's ``needs_model``: its ``on_step`` reads `model` as of this step."""
        return any(getattr(h, "needs_model", lambda *a: False)(self, step) for h in self.hooks)

    def _stopping(self, stop: guard.StopFlag) -> bool:
        if self._agree is not None:  # several processes: the flag they all read
            return self._stop_agreed
        return stop.signal is not None or self._hook_stop is not None

    def _dispatch(self, stop: guard.StopFlag) -> _InFlight | None:
        """Dispatch the next step (None: a signal arrived while waiting for its batch)."""
        t0 = time.perf_counter()
        local = self._feed.get(stop)
        if local is None:
            return None
        t_data = time.perf_counter() - t0
        batch = step_lib.make_global_batch(local, self.built.batch_sharding)
        schedule = self.built.schedule
        lr = np.float32(schedule(self.step) if schedule is not None else 0.0)
        self.model, self.optimizer, out = self._step_fn(self.model, self.optimizer, batch, lr)
        self.step += 1
        want_stop = stop.signal is not None or self._hook_stop is not None
        return _InFlight(self.step, out, self._agree(want_stop) if self._agree else None, t0,
                         t_data)

    def _finish(self, f: _InFlight) -> None:
        """Read step `f`'s metrics (waits for it), check them, hand them to the hooks; raise
        `CheckpointSaveFailed` as soon as a save in flight is known to have failed."""
        self._ckpt.check()
        out = jax.device_get(f.out)
        if f.stop is not None and int(jax.device_get(f.stop)):
            self._stop_agreed = True
        ready = time.perf_counter()
        dt = ready - max(self._last_ready, f.t0)  # the step's share of the pipeline
        self._last_ready = ready
        bad = guard.check_finite(out)
        if bad:  # nothing of this step (or the one in flight after it) is written or saved
            raise TrainingDiverged(
                f"step {f.step}: {', '.join(bad)} -- training diverged. Nothing from this "
                f"step was saved; {guard.last_checkpoint(self._ckpt)}. Lower --lr or check the "
                f"data, then rerun to resume from it")
        row = hooks_lib.metrics_row(f, out, dt, self.tokens_per_step, self.flops_per_token)
        self._monitor.update(f.step, row["loss"])
        self._losses.append(row["loss"])
        self._speeds.append(row["tokens_per_s"])
        self._hooks("on_step", f.step, row)
        for hook in self.hooks:
            should_stop = getattr(hook, "should_stop", None)
            if self._hook_stop is None and should_stop is not None and should_stop(self, f.step):
                self._hook_stop = type(hook).__name__
        if self._monitor.diverged:
            raise TrainingDiverged(self._monitor.message(f.step))

    def _checkpoint(self, held_back: bool) -> bool:
        """Save this step unless the loss is above its bound; returns whether held back."""
        if not self._monitor.rising:
            self._save(self.step)
            return False
        if jax.process_index() == 0 and not held_back:
            print(f"\n{self.name}: step {self.step}: loss {self._losses[-1]:.4g} is above "
                  f"{self._monitor.factor:g} x its recent best; holding back checkpoints (last "
                  f"good: step {guard.last_good(self._ckpt, self._monitor.first_rise)})",
                  file=sys.stderr, flush=True)
        return True

    def _save(self, step: int) -> None:
        self._ckpt.save(step, self.model, self.optimizer, data_state=self._feed.state,
                        config=dict(self.record, **{_HISTORY_KEY: self._monitor.history()}))
        self._saved_step = step
        self._hooks("on_checkpoint", step)

    def _diverged(self, e: TrainingDiverged) -> TrainingDiverged:
        monitor, ckpt = self._monitor, self._ckpt
        if not monitor.diverged:
            return e
        moved = guard.set_aside_suspect(ckpt, monitor.first_rise)
        if moved:
            return TrainingDiverged(
                f"{e}. Checkpoints saved from the state that first gave the risen loss were "
                f"moved aside ({', '.join(moved)}); {guard.last_checkpoint(ckpt)}. Lower --lr or "
                f"check the data, then rerun to resume from it")
        return TrainingDiverged(f"{e}. Nothing was saved from step {monitor.first_rise} on; "
                                f"{guard.last_checkpoint(ckpt)}. Lower --lr or check the data, "
                                f"then rerun")
