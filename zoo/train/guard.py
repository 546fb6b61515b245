"""Faults the loop watches for without a host barrier: NaN/Inf, divergence, stop requests.

* `check_finite` -- a step whose loss, gradient norm or parameter norm is NaN/Inf.
* `DivergenceMonitor` -- the loss above ``factor`` x the best of the last `window` steps for
  `patience` steps in a row. While the loss is above the bound (a *rise*) the loop holds back
  checkpoints; when the rise lasts `patience` steps the run stops. Every process sees the same
  global losses, so every process reaches the same verdict at the same step with no exchange.
* `StopAgreement` -- whether any process was asked to stop (SIGTERM/SIGINT), computed *on the
  devices*: each process contributes its flag to a tiny global array whose maximum is
  dispatched with the step and read with that step's metrics, one step later. It is ordinary
  queued device work, not a barrier: the host never waits for the other processes to reach
  the same line, and all of them read the same answer for the same step.
* `StopFlag` -- SIGTERM/SIGINT as a flag the trainer reads after each step and while it
  compiles.
* `last_good`, `protect_last_good`, `set_aside_suspect`, `last_checkpoint` -- which
  checkpoints a rising or diverged loss leaves trustworthy, and the message naming them.
"""

from __future__ import annotations

import collections
import math
import os
import signal
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["check_finite", "DivergenceMonitor", "StopAgreement", "WINDOW", "PATIENCE"]

WINDOW = 100   # steps whose best loss sets the bound
PATIENCE = 10  # steps in a row above the bound that stop the run


def check_finite(metrics: Mapping[str, Any]) -> list[str]:
    """``["loss nan", ...]`` for the watched metrics that are not finite: the loss, the norms
    and every updated state (``nonfinite_state``: ``{path: count}``, see
    `zoo.train.step.nonfinite_state`)."""
    bad = [f"{k} {float(metrics[k])}" for k in ("loss", "grad_norm", "param_norm")
           if not math.isfinite(float(metrics[k]))]
    state = metrics.get("nonfinite_state") or {}
    return bad + [f"the updated state {path} holds {int(n)} NaN/Inf value(s)"
                  for path, n in state.items() if int(n)]


class DivergenceMonitor:
    """Feed it each step's loss (`update`); it says whether the loss has risen past the bound
    (`rising`, since step `first_rise`) and whether the rise has lasted long enough to stop
    (`diverged`). ``factor=inf`` never fires."""

    def __init__(self, factor: float = 5.0, *, window: int = WINDOW, patience: int = PATIENCE,
                 history: Iterable[float] = ()):
        if not factor > 1:
            raise ValueError(f"divergence factor {factor} must be > 1")
        self.factor, self.patience = float(factor), int(patience)
        self.losses: collections.deque[float] = collections.deque(
            (float(x) for x in history), maxlen=window)
        self.first_rise: int | None = None   # the step whose loss first rose past the bound
        self.streak = 0
        self.bound: float | None = None

    def update(self, step: int, loss: float) -> None:
        bound = self.factor * max(min(self.losses), 1e-6) if self.losses else math.inf
        if loss > bound:
            if not self.streak:
                self.first_rise, self.bound = step, bound
            self.streak += 1
        else:
            self.streak, self.first_rise = 0, None
        self.losses.append(float(loss))

    @property
    def rising(self) -> bool:
        return self.streak > 0

    @property
    def diverged(self) -> bool:
        return self.streak >= self.patience

    def history(self) -> list[float]:
        """The window, saved with each checkpoint so a resume judges against the same past."""
        return list(self.losses)

    def message(self, step: int) -> str:
        return (f"step {step}: the loss stayed above {self.factor:g} x the best of the last "
                f"{self.losses.maxlen} steps ({self.bound:.4g}) for {self.streak} steps since "
                f"step {self.first_rise} -- training diverged")


class StopAgreement:
    """``agree(flag)`` -> a device scalar, the maximum of every process's flag (asynchronous)."""

    def __init__(self, mesh: jax.sharding.Mesh):
        self.sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        self.shape = (mesh.devices.size,)
        self._max = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))

    def __call__(self, flag: bool) -> jax.Array:
        # every shard of this process holds the same flag, so shard order does not matter
        local = np.full((1,), int(flag), np.int32)
        arrays = [jax.device_put(local, d) for d in self.sharding.addressable_devices]
        x = jax.make_array_from_single_device_arrays(self.shape, self.sharding, arrays)
        return self._max(x)


# -- signals and checkpoints of a diverged run -------------------------------------------------

class StopFlag:
    """SIGTERM/SIGINT set a flag the trainer reads after each step (and while it compiles);
    a second SIGINT aborts at once."""

    def __init__(self):
        self.signal: str | None = None
        self.compiling = False  # the trainer's own message covers a signal during the compile
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
        if not self.compiling:
            print(f"\n{self.signal} received: finishing this step, then saving a checkpoint",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def last_checkpoint(ckpt) -> str:
    """Names the checkpoint a rerun resumes from -- the newest verified one (complete, with
    its digest record: `Checkpointer.verified_steps`) once the save in flight has finished (or
    failed, or timed out) -- or says there is none."""
    from zoo.train.checkpoint import CheckpointSaveFailed
    try:
        ckpt.wait()
    except CheckpointSaveFailed:
        pass  # name what is on disk; the failed save was, or is about to be, reported
    done = ckpt.verified_steps()
    if done:
        return f"the last good checkpoint is step {done[-1]} in {ckpt.directory}"
    if ckpt.steps_on_disk():  # only steps from before digest records: read unverified
        return (f"the last checkpoint is step {ckpt.steps_on_disk()[-1]} in {ckpt.directory} "
                f"(unverified: it has no digest record)")
    return f"there is no checkpoint to resume from in {ckpt.directory}"


def last_good(ckpt, first_rise: int) -> int | None:
    """The newest verified checkpoint (or the one being saved) whose state gave a loss within
    the bound: the state saved at step ``s`` is the one step ``s+1``'s loss was computed on."""
    verified = {*ckpt.verified_steps(), ckpt.saving}
    good = [s for s in ckpt.steps() if s + 1 < first_rise and s in verified]
    return good[-1] if good else None


def protect_last_good(ckpt, first_rise: int) -> None:
    good = last_good(ckpt, first_rise)
    if good is not None:
        ckpt.protect(good)


def set_aside_suspect(ckpt, first_rise: int | None) -> list[str]:
    """Move aside the checkpoints of states that gave risen losses (steps >= first_rise - 1)."""
    if first_rise is None:
        return []
    suspect = [s for s in ckpt.steps() if s >= first_rise - 1]
    if len(suspect) == len(ckpt.steps()):
        return []  # nothing better to fall back to: keep what there is
    return [os.path.basename(ckpt.move_aside(s, "diverged")) for s in suspect]
