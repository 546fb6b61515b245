"""The training loop: create or resume, step, log, checkpoint, stop cleanly.

`train` runs one run in ``run_dir``:

`train(config, pieces)` takes the run's `zoo.train.TrainConfig` and the built `Pieces`
(model factory, optimizer, train step, data, batch sharding).

* **create or resume** -- with checkpoints in ``run_dir/checkpoints`` the newest readable one
  is restored straight onto the shardings (a corrupt one is skipped with a warning), else the
  model and optimizer are created sharded; a checkpoint whose model has other shapes is refused
  with the differing config fields named.
* **compile first** -- the train step is compiled ahead of time in a background thread while
  the model is created or restored, so step 1's time is a real step time.
* **each step, no host sync** -- this process's rows -> global arrays, one jitted step
  dispatched; only then are the *previous* step's metrics read, so the device always has the
  next step queued while the host logs. A step's metrics are checked before anything of it is
  written or saved, and a checkpoint step reads its own metrics first (the state it saves is
  known finite). Faults (`zoo.train.guard`): a NaN/Inf loss, gradient or parameter norm raises
  `TrainingDiverged`; so does a loss above ``divergence_factor`` x the best of the last 100
  steps for 10 steps in a row. While the loss is above that bound no checkpoint is written;
  when the run stops for it, the checkpoints saved from the state that first produced the
  risen loss onwards are moved aside to ``checkpoints/diverged-<step>``, so a rerun resumes
  from the last good one (protected from rotation). The best-loss window is saved with each
  checkpoint, so a resumed run judges against the same past.
* **output (process 0)** -- a tqdm bar (step, loss, tokens/s, ETA), one JSON line per step in
  ``metrics.jsonl`` (a resumed run drops lines past its checkpoint, then appends),
  ``run.json`` (config, devices, processes, versions), ``loss.png`` at the end and a one-line
  summary.
* **checkpoints** -- every ``checkpoint_every`` steps, at the end, and when SIGTERM/SIGINT
  arrives (the step in flight finishes and is saved; with several processes they agree through
  a flag reduced on the devices with the step and all stop at the same step, at most one step
  later). All processes take part in saving.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from zoo.models import count_params
from zoo.train import guard
from zoo.train import step as step_lib
from zoo.train.checkpoint import Checkpointer, shape_differences, to_pure
from zoo.train.config import TrainConfig

__all__ = ["train", "Pieces", "TrainingDiverged", "IncompatibleCheckpoint", "Summary",
           "read_metrics", "plot_loss"]


class TrainingDiverged(RuntimeError):
    """The loss, gradient norm or parameter norm became NaN or Inf, or the loss stayed far
    above its recent best (see `zoo.train.guard`); nothing from those steps was saved."""


class IncompatibleCheckpoint(ValueError):
    """The run dir's checkpoint holds a model of other shapes than the one asked for."""


@dataclasses.dataclass
class Summary:
    run_dir: str
    start_step: int          # updates completed before this run (0 when fresh)
    step: int                # updates completed at the end
    steps: int               # the planned total
    stopped_by: str | None   # "SIGTERM"/"SIGINT" when a signal ended the run early
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float | None  # median over this run's steps
    compile_s: float
    wall_s: float

    def line(self, name: str = "train") -> str:
        if self.stopped_by:
            state = (f"stopped by {self.stopped_by} at step {self.step}/{self.steps} (rerun to "
                     f"resume)")
        else:
            state = f"finished {self.step}/{self.steps} steps"
        loss = (f"loss {self.first_loss:.3f} -> {self.last_loss:.3f}" if self.last_loss is not None
                else "no steps run")
        tps = f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else ""
        return (f"{name}: {state}; {loss}{tps}; compile {self.compile_s:.1f}s, wall "
                f"{self.wall_s:.1f}s; run dir {self.run_dir}")


# -- files -------------------------------------------------------------------------------------

def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (empty if none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_metrics(path: str, step: int) -> None:
    """Drop rows past `step`: steps run after the last checkpoint are about to be redone."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [ln for ln in f if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def plot_loss(run_dir: str | os.PathLike) -> str | None:
    """Write ``run_dir/loss.png`` from ``metrics.jsonl``; returns its path (None: no rows)."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(os.path.basename(os.path.abspath(run_dir)))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(run_dir, "loss.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def _versions() -> dict[str, str]:
    import flax
    import zoo
    return {"zoo": zoo.__version__, "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "python": sys.version.split()[0]}


def _json_default(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _normalise(x):
    return json.loads(json.dumps(x, default=_json_default))


# -- signals -----------------------------------------------------------------------------------

class _StopFlag:
    """SIGTERM/SIGINT set a flag the loop reads after each step; a second SIGINT aborts."""

    def __init__(self):
        self.signal: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # impatient second Ctrl-C: stop without saving
        self.signal = signal.Signals(signum).name
        print(f"\n{self.signal} received: finishing this step, then saving a checkpoint",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


# -- the loop ----------------------------------------------------------------------------------

def _model_changes(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    saved = saved or {}
    keys = sorted(set(saved) | set(now))
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


@dataclasses.dataclass(kw_only=True)
class Pieces:
    """What `train` runs, built from a `TrainConfig` (the recipes' `zoo.train.cli.setup` builds
    them; a notebook or test can build its own)."""

    make_model: Callable[[], nnx.Module]  # builds the model sharded (called under jax.jit)
    tx: optax.GradientTransformation      # zoo.train.step.make_tx
    train_step: Callable                  # zoo.train.step.make_train_step
    data: Any                             # checkpointable iterator (get_state/set_state) of
    #                                       this process's batches
    batch_sharding: Any                   # NamedSharding of the global [batch, seq_len] arrays
    record: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # JSON-able: what
    #   run.json and each checkpoint hold beside "train" ("model" is compared on resume)
    flops_per_token: float | None = None  # training FLOPs per token (None: 6 * parameters)
    create: Callable[[], tuple[nnx.Module, nnx.Optimizer]] | None = None  # a fresh run's
    #   model and optimizer (None: create_sharded(make_model, tx)), e.g. from Hugging Face


def train(config: TrainConfig, pieces: Pieces, *, name: str = "train",
          on_step: Callable[[int, dict[str, Any]], None] | None = None) -> Summary:
    """Train until ``config.steps`` updates are done (or a signal arrives); see the module
    docstring. The settings come from `config` (steps, batch, schedule, run dir, checkpoints,
    divergence factor, progress bar); ``config.run_dir`` must be set. ``run.json`` (its
    ``config``) and every checkpoint record ``pieces.record`` plus ``train``:
    ``dataclasses.asdict(config)``.

    Args:
      on_step: called as ``on_step(step, metrics)`` after each step's metrics are written.

    Raises:
      TrainingDiverged: the loss became NaN/Inf or diverged (the last good checkpoint is kept).
      IncompatibleCheckpoint: the checkpoint holds a model of another shape.
    """
    if config.run_dir is None:
        raise ValueError("TrainConfig.run_dir is None: pass the folder of the run "
                         "(zoo.train.cli fills in runs/<recipe name>)")
    make_model, tx, train_step = pieces.make_model, pieces.tx, pieces.train_step
    data, batch_sharding, create = pieces.data, pieces.batch_sharding, pieces.create
    steps, global_batch, seq_len = config.steps, config.batch_size, config.seq_len
    checkpoint_every, flops_per_token = config.checkpoint_every, pieces.flops_per_token
    progress = config.progress
    schedule = step_lib.lr_schedule(config.lr, steps, warmup=config.warmup,
                                    final_fraction=config.final_lr_fraction)
    t_start = time.perf_counter()
    run_dir = os.path.abspath(os.fspath(config.run_dir))
    main = jax.process_index() == 0
    os.makedirs(run_dir, exist_ok=True)
    # what run.json and each checkpoint record: the settings beside the pieces' record
    record = _normalise(dict(pieces.record, train=dataclasses.asdict(config)))
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=config.max_to_keep)
    mesh = getattr(batch_sharding, "mesh", None)
    model, optimizer = step_lib.abstract_state(make_model, tx, mesh)
    tokens_per_step = global_batch * seq_len
    if flops_per_token is None:
        flops_per_token = 6.0 * count_params(model)

    # Compile the step from shapes alone while the model is created or restored.
    batch_abstract = {k: jax.ShapeDtypeStruct((global_batch, seq_len),
                                              np.float32 if k == "loss_weights" else np.int32,
                                              sharding=batch_sharding) for k in step_lib.BATCH_KEYS}
    compiled: dict[str, Any] = {}

    def compile_step(model, optimizer):
        t = time.perf_counter()
        try:
            compiled["fn"] = train_step.lower(model, optimizer, batch_abstract,
                                              np.float32(0)).compile()
        except Exception as e:
            compiled["error"] = e
        compiled["s"] = time.perf_counter() - t

    compiler = threading.Thread(target=compile_step, args=(model, optimizer), name="zoo-compile",
                                daemon=True)
    if main:
        print(f"{name}: compiling the train step ...", file=sys.stderr, flush=True)
    compiler.start()

    def check(step: int, saved: Mapping[str, Any]) -> None:
        changes = _model_changes(saved.get("model"), record.get("model", {}))
        if not changes:
            return
        diffs = shape_differences(ckpt.saved_shapes(step)["model"],
                                  to_pure(model, optimizer)["model"])
        if diffs:
            raise IncompatibleCheckpoint(
                f"{ckpt.directory} holds a model of another shape (step {step}); changed model "
                f"fields: {'; '.join(changes)}. Parameter shapes that differ: {'; '.join(diffs)}. "
                f"Use another --run-dir, or undo the changes to resume")
        warnings.warn(f"model config changed since step {step} without changing shapes; "
                      f"resuming anyway: {'; '.join(changes)}", stacklevel=2)

    try:
        try:
            restored = ckpt.restore(model, optimizer, check=check) if ckpt.steps() else None
            history = []
            if restored is None:
                model, optimizer = create() if create else step_lib.create_sharded(make_model, tx)
                start = 0
            else:
                history = restored.config.get(_HISTORY_KEY) or []
                model, optimizer = restored.model, restored.optimizer
                data.set_state(restored.data)
                start = restored.step
                changed = [f"{k}.{kk}" for k, v in record.items()
                           if k != "model" and isinstance(v, dict)
                           for kk in v if (restored.config.get(k) or {}).get(kk) != v[kk]]
                if main:
                    extra = f" (changed: {', '.join(changed)})" if changed else ""
                    print(f"{name}: resuming from step {start}{extra}", file=sys.stderr,
                          flush=True)
        finally:
            compiler.join()  # never leave a compile running (e.g. when the restore was refused)
        if "error" in compiled:
            raise compiled["error"]
        step_fn = compiled["fn"]
        if main:
            print(f"{name}: compiled in {compiled['s']:.1f}s", file=sys.stderr, flush=True)
            _truncate_metrics(metrics_path, start)
            run_info = dict(config=record, device_count=jax.device_count(),
                            local_device_count=jax.local_device_count(),
                            process_count=jax.process_count(), backend=jax.default_backend(),
                            mesh=dict(mesh.shape) if mesh is not None else None,
                            versions=_versions(), resumed_from=start or None,
                            flops_per_token=flops_per_token, tokens_per_step=tokens_per_step)
            with open(os.path.join(run_dir, "run.json"), "w") as f:
                json.dump(_normalise(run_info), f, indent=2)
        if start >= steps:
            if main:
                print(f"{name}: the checkpoint is already at step {start} of the planned "
                      f"{steps}; raise --steps to train further", file=sys.stderr, flush=True)
            return Summary(run_dir, start, start, steps, None, None, None, None, compiled["s"],
                           time.perf_counter() - t_start)
        step, stopped_by, losses, speeds = _loop(
            step_fn=step_fn, model=model, optimizer=optimizer, schedule=schedule, data=data,
            batch_sharding=batch_sharding, ckpt=ckpt, start=start, steps=steps,
            checkpoint_every=checkpoint_every, config=record, metrics_path=metrics_path,
            tokens_per_step=tokens_per_step, flops_per_token=flops_per_token, name=name,
            progress=progress and main, on_step=on_step,
            monitor=guard.DivergenceMonitor(config.divergence_factor, history=history))
    finally:
        ckpt.wait()
        ckpt.close()
    summary = Summary(run_dir, start, step, steps, stopped_by, losses[0] if losses else None,
                      losses[-1] if losses else None,
                      statistics.median(speeds[1:] or speeds) if speeds else None,
                      compiled["s"], time.perf_counter() - t_start)
    if main:
        plot_loss(run_dir)
        print(summary.line(name), flush=True)
    return summary


_HISTORY_KEY = "loss_history"  # saved beside the run config in each checkpoint


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    out: dict[str, Any]           # device arrays
    stop: Any                     # device scalar from StopAgreement, or None (one process)
    t0: float                     # when its batch was requested
    t_data: float


def _loop(*, step_fn, model, optimizer, schedule, data, batch_sharding, ckpt, start, steps,
          checkpoint_every, config, metrics_path, tokens_per_step, flops_per_token, name,
          progress, on_step, monitor):
    """The steps themselves; returns (step reached, signal name or None, losses, tokens/s).

    Step ``k`` is dispatched before step ``k-1``'s metrics are read (see the module
    docstring); a step that is saved has its own metrics read first.
    """
    from tqdm.auto import tqdm

    main = jax.process_index() == 0
    mesh = getattr(batch_sharding, "mesh", None)
    agree = guard.StopAgreement(mesh) if jax.process_count() > 1 else None
    bar = tqdm(total=steps, initial=start, disable=not progress, unit="step",
               dynamic_ncols=True, mininterval=0.5, desc=name)
    losses, speeds = [], []
    step, saved_step, stopped_by, held_back = start, start, None, False
    last_ready = [time.perf_counter()]
    stop_agreed = [False]

    def finish(f: _InFlight, mfile) -> None:
        """Read step `f`'s metrics (waits for it), check them, log them."""
        out = jax.device_get(f.out)
        if f.stop is not None and int(jax.device_get(f.stop)):
            stop_agreed[0] = True
        ready = time.perf_counter()
        dt = ready - max(last_ready[0], f.t0)  # the step's share of the pipeline
        last_ready[0] = ready
        bad = guard.check_finite(out)
        if bad:  # nothing of this step (or the one in flight after it) is written or saved
            raise TrainingDiverged(
                f"step {f.step}: {', '.join(bad)} -- training diverged. Nothing from this "
                f"step was saved; the last good checkpoint is step {saved_step} in "
                f"{ckpt.directory}. Lower --lr or check the data, then rerun to resume from it")
        loss = float(out["loss"])
        monitor.update(f.step, loss)
        row = dict(step=f.step, loss=loss, aux_loss=float(out["aux_loss"]),
                   objective=float(out["objective"]), grad_norm=float(out["grad_norm"]),
                   param_norm=float(out["param_norm"]), lr=float(out["lr"]),
                   tokens_per_s=tokens_per_step / dt,
                   model_flops_per_s=flops_per_token * tokens_per_step / dt,
                   step_time_s=dt, data_time_s=f.t_data,
                   target_tokens=int(out["weight_sum"]))
        if "dropped_tokens" in out:  # MoE token copies over the all_to_all buffers
            row["dropped_tokens"] = int(out["dropped_tokens"])
        counts = out.get("expert_counts")
        if counts is not None:
            counts = np.asarray(counts, np.float64).reshape(-1, np.shape(counts)[-1])
            mean = np.maximum(counts.mean(-1), 1e-9)
            row["expert_max_over_mean"] = float(np.max(counts.max(-1) / mean))
            if counts.size <= 1024:
                row["expert_counts"] = counts.astype(np.int64).tolist()
        losses.append(loss)
        speeds.append(row["tokens_per_s"])
        if main:
            mfile.write(json.dumps(row) + "\n")
            mfile.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}", refresh=False)
        if on_step is not None:
            on_step(f.step, row)
        if monitor.diverged:
            raise TrainingDiverged(monitor.message(f.step))

    try:
        with _StopFlag() as stop, open(metrics_path, "a") if main else _Null() as mfile:
            pending: _InFlight | None = None
            try:
                while step < steps:
                    t0 = time.perf_counter()
                    local = next(data)
                    t_data = time.perf_counter() - t0
                    batch = step_lib.make_global_batch(local, batch_sharding)
                    lr = np.float32(schedule(step))
                    model, optimizer, out = step_fn(model, optimizer, batch, lr)  # dispatch
                    step += 1
                    flight = _InFlight(step, out, agree(stop.signal is not None) if agree
                                       else None, t0, t_data)
                    if pending is not None:  # the previous step, while this one runs
                        finish(pending, mfile)
                    pending = flight
                    # one process: its own flag; several: the flag they all read for step-1
                    stopping = stop_agreed[0] if agree else stop.signal is not None
                    if step % checkpoint_every == 0 or step == steps or stopping:
                        pending = None
                        finish(flight, mfile)
                        stopping = stopping or (agree is not None and stop_agreed[0])
                        if monitor.rising:
                            if main and not held_back:
                                print(f"\n{name}: step {step}: loss {losses[-1]:.4g} is above "
                                      f"{monitor.factor:g} x its recent best; holding back "
                                      f"checkpoints (last good: step "
                                      f"{_last_good(ckpt, monitor.first_rise)})",
                                      file=sys.stderr, flush=True)
                            held_back = True
                        else:
                            held_back = False
                            ckpt.save(step, model, optimizer, data_state=data.get_state(),
                                      config=dict(config, **{_HISTORY_KEY: monitor.history()}))
                            saved_step = step
                    if monitor.rising and monitor.first_rise is not None:
                        _protect_last_good(ckpt, monitor.first_rise)
                    if stopping:
                        if stop.signal is None:
                            stop.signal = "a signal to another process"
                        stopped_by = stop.signal
                        break
            except TrainingDiverged as e:
                if monitor.diverged:
                    moved = _set_aside_suspect(ckpt, monitor.first_rise)
                    if moved:
                        raise TrainingDiverged(
                            f"{e}. Checkpoints saved from the state that first gave the risen "
                            f"loss were moved aside ({', '.join(moved)}); the last good "
                            f"checkpoint is step {ckpt.latest_step()} in {ckpt.directory}. "
                            f"Lower --lr or check the data, then rerun to resume from it"
                        ) from None
                    last = ckpt.latest_step()
                    where = (f"the last good checkpoint is step {last} in {ckpt.directory}"
                             if last is not None else "there is no checkpoint to resume from")
                    raise TrainingDiverged(
                        f"{e}. Nothing was saved from step {monitor.first_rise} on; {where}. "
                        f"Lower --lr or check the data, then rerun") from None
                raise
    finally:
        bar.close()
    return step, stopped_by, losses, speeds


def _last_good(ckpt: Checkpointer, first_rise: int) -> int | None:
    """The newest checkpoint whose state gave a loss within the bound: the state saved at step
    ``s`` is the one step ``s+1``'s loss was computed on."""
    good = [s for s in ckpt.steps() if s + 1 < first_rise]
    return good[-1] if good else None


def _protect_last_good(ckpt: Checkpointer, first_rise: int) -> None:
    good = _last_good(ckpt, first_rise)
    if good is not None:
        ckpt.protect(good)


def _set_aside_suspect(ckpt: Checkpointer, first_rise: int | None) -> list[str]:
    """Move aside the checkpoints of states that gave risen losses (steps >= first_rise - 1)."""
    if first_rise is None:
        return []
    suspect = [s for s in ckpt.steps() if s >= first_rise - 1]
    if len(suspect) == len(ckpt.steps()):
        return []  # nothing better to fall back to: keep what there is
    return [os.path.basename(ckpt.move_aside(s, "diverged")) for s in suspect]


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
