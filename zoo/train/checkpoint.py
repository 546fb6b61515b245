"""Checkpoints of a training run: Orbax `CheckpointManager` with a corrupt-checkpoint fallback.

One checkpoint per saved step in ``RUN_DIR/checkpoints/<step>/``, three items:

* ``state`` -- the model and optimizer state (`nnx.state` as pure dicts), saved sharded by
  every process (`ocp.args.StandardSave`) and restored straight onto the target shardings;
* ``data`` -- each process's data-iterator state, ``process_<i>-of-<n>.json`` (every process
  reads a different slice, so each keeps its own);
* ``config`` -- the run's configuration (JSON, written by process 0).

The step is the checkpoint's name: the number of updates completed. Saves are asynchronous
(the device-to-host copy happens before `save` returns, so the next step may reuse the donated
buffers); `wait` blocks until the last one is on disk. Orbax writes each checkpoint to a
temporary folder and renames it when complete, so a half-written save never looks like a step.
A step that exists but cannot be read (truncated or missing files) is skipped by `restore` with
a warning, moved aside to ``checkpoints/corrupt-<step>`` and the previous one is used.

Integrity: once Orbax has renamed a step's folder, process 0 records the size and SHA-256 of
every file in it in ``<step>/zoo-digests.json`` (`DIGESTS`), in the background thread that
waits for the save. `restore` checks a step's files against that record before reading them
(the files split over the processes); a step whose bytes differ (bit rot that keeps the size,
a truncated or missing file) is corrupt, and handled as an unreadable one. A *verified* step
has a record its files match; "the last good checkpoint" in messages is the newest step with
a record (`verified_steps`). A step with no record -- the run stopped between Orbax's rename
and the record's write, or the checkpoint predates records -- is used only when no older step
has one (an older run: it is read unverified, with a warning); otherwise it is skipped, and a
writer moves it to ``unverified-<step>``. Cost: one more read of each saved byte on process 0
(SHA-256 on a pool of up to 8 threads: about 1-2 GB/s per thread, so milliseconds for a mini
run and minutes per TB, overlapping training until the next save waits for it), and one more
read of each restored byte at load.

Readers (`zoo.train.load`, generation, evaluation) open the folder with ``read_only=True``:
Orbax creates nothing, deletes no temporary folder (a live trainer's save in flight is left
alone), and nothing is moved aside; a step that fails is skipped with a warning, and the
listing is read again before each try, so a step rotated out by a live trainer is passed over.

Rotation keeps the newest `max_to_keep` checkpoints plus any step passed to `protect` (the
loop protects the last checkpoint saved before the loss rose past its divergence bound, so
saves after a recovered rise never rotate it out). `move_aside` takes a step out of the
manager without deleting it (the loop moves the checkpoints a divergence made suspect to
``diverged-<step>``).
"""

from __future__ import annotations

import dataclasses
import concurrent.futures
import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

__all__ = ["Checkpointer", "Restored", "shape_differences", "all_processes_agree",
           "CheckpointSaveFailed", "SAVE_TIMEOUT_S", "DIGESTS", "record_digests",
           "check_digests"]

SAVE_TIMEOUT_S = 600.0  # the longest wait for one checkpoint save before it counts as failed
DIGESTS = "zoo-digests.json"  # in each step's folder: every file's size and SHA-256
_HASH_THREADS = 8



def _listed(list_steps: Callable[[], Any], attempts: int = 20) -> Any:
    """``list_steps()`` (which lists the checkpoint folder: Orbax names the steps, then stats
    each), again whenever a step vanished in between: a live trainer rotates old steps out
    while a reader (``zoo.generate --run``, ``zoo.evaluate``) looks at the same folder."""
    for attempt in range(attempts):
        try:
            return list_steps()
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05)

class CheckpointSaveFailed(RuntimeError):
    """A checkpoint save failed (no space, read-only, permission, ...) or did not finish within
    the save timeout. The checkpoints already on disk are untouched."""


_ERRNO_WORDS = {errno.ENOSPC: "no space left on the device",
                errno.EDQUOT: "the disk quota is exceeded",
                errno.EROFS: "the file system is read-only",
                errno.EACCES: "permission denied", errno.EPERM: "permission denied"}


def _causes(e: BaseException):
    seen = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        stack += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]


class _QuietSaveTracebacks(logging.Filter):
    """Orbax logs a failed background save with each thread's traceback (hundreds of lines);
    `CheckpointSaveFailed` says it in one paragraph, so those records lose their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in (record.pathname or ""):
            return True
        if record.exc_info and record.levelno >= logging.ERROR:
            record.exc_info, record.exc_text = None, None
        # a reader's manager is read-only on purpose: not news
        return not str(record.msg).startswith(("Given directory is read only",
                                               "CheckpointManagerOptions.read_only=True"))


_QUIET = _QuietSaveTracebacks()


def _watch(fn: Callable[[], Any], name: str) -> tuple[threading.Thread, dict[str, Any]]:
    """`fn()` in a daemon thread (joined with a timeout by the caller); its exception lands in
    the returned dict's ``"error"``."""
    out: dict[str, Any] = {}

    def run():
        try:
            fn()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, out


def save_failure_reason(e: BaseException) -> str:
    """What went wrong, in words first (no space, read-only, permission), then the error."""
    for x in _causes(e):
        if isinstance(x, OSError) and x.errno in _ERRNO_WORDS:
            return f"{_ERRNO_WORDS[x.errno]} ({type(x).__name__}: {x})"
    return f"{type(e).__name__}: {str(e)[:300]}"


# -- digests: what each step's files held when saved ------------------------------------------

def _files(step_dir: str) -> list[str]:
    """Every file under `step_dir` but the digest record, as sorted relative paths."""
    out = []
    for root, _, names in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names
                if not n.startswith(DIGESTS)]
    return sorted(out)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _digests(step_dir: str, names: list[str]) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(min(_HASH_THREADS, len(names) or 1)) as pool:
        return list(pool.map(lambda n: _sha256(os.path.join(step_dir, n)), names))


def record_digests(step_dir: str | os.PathLike) -> None:
    """Write `step_dir`'s ``zoo-digests.json``: every file's size and SHA-256 (atomically)."""
    step_dir = os.fspath(step_dir)
    names = _files(step_dir)
    files = {n: {"bytes": os.path.getsize(os.path.join(step_dir, n)), "sha256": d}
             for n, d in zip(names, _digests(step_dir, names))}
    path = os.path.join(step_dir, DIGESTS)
    with open(f"{path}.tmp-{os.getpid()}", "w") as f:
        json.dump({"algorithm": "sha256", "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp-{os.getpid()}", path)


def check_digests(step_dir: str | os.PathLike, share: tuple[int, int] = (0, 1),
                  item: str | None = None) -> str | None:
    """None when the files of `step_dir` match its digest record, else what differs. ``share``
    ``(i, n)`` checks every n-th recorded file from the i-th (each process its share); `item`
    only the files of that item (e.g. ``"config"``). A missing or unreadable record is
    reported as such (see `Checkpointer.has_digests`)."""
    step_dir = os.fspath(step_dir)
    try:
        with open(os.path.join(step_dir, DIGESTS)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its digest record {DIGESTS} cannot be read ({type(e).__name__}: {e})"
    names = [n for n in sorted(files) if item is None or n.startswith(item + os.sep)]
    names = names[share[0]::share[1]]
    for n in names:
        path = os.path.join(step_dir, n)
        if not os.path.isfile(path):
            return f"{n} is missing"
        if os.path.getsize(path) != files[n]["bytes"]:
            return f"{n} holds {os.path.getsize(path)} bytes, {files[n]['bytes']} when saved"
    for n, digest in zip(names, _digests(step_dir, names)):
        if digest != files[n]["sha256"]:
            return (f"{n} does not match the SHA-256 recorded when it was saved (same size: "
                    f"its bytes changed on disk)")
    return None


# -- per-process JSON item (the data iterators) ------------------------------------------------

class ProcessJsonHandler(ocp.JsonCheckpointHandler):
    """Every process writes and reads its own ``process_<i>-of-<n>.json``."""

    @staticmethod
    def _name() -> str:
        return f"process_{jax.process_index()}-of-{jax.process_count()}.json"

    async def _save_fn(self, x, directory):
        (directory / self._name()).write_text(json.dumps(x))

    def restore(self, directory: epath.Path, item=None, args=None):
        path = directory / self._name()
        if not path.exists():
            found = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
            raise FileNotFoundError(
                f"{path} not found (files: {found}); the data state is kept per process, so "
                f"resume with the process count that wrote the checkpoint")
        return json.loads(path.read_text())


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    item: Any = None


# -- helpers -----------------------------------------------------------------------------------

def all_processes_agree(ok: bool) -> bool:
    """True iff `ok` on every process (one tiny all-gather; free with one process)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.asarray([int(ok)], np.int32))
    return bool(np.all(flags))


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(x.shape)
            for path, x in flat if hasattr(x, "shape")}


def shape_differences(saved, current, limit: int = 5) -> list[str]:
    """Human-readable differences between two trees' array shapes (at most `limit`)."""
    a, b = _shapes(saved), _shapes(current)
    out = [f"{k}: saved {a[k]} vs now {b[k]}" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    out += [f"{k}: only in the checkpoint" for k in sorted(a.keys() - b.keys())]
    out += [f"{k}: not in the checkpoint" for k in sorted(b.keys() - a.keys())]
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def to_pure(model: nnx.Module, optimizer: nnx.Optimizer | None) -> dict[str, Any]:
    out = {"model": nnx.to_pure_dict(nnx.state(model))}
    if optimizer is not None:
        out["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
    return out


@dataclasses.dataclass
class _Protected(pp.PreservationPolicy):
    """Preserve the steps in a set that can grow while the manager lives."""

    steps: set[int] = dataclasses.field(default_factory=set)

    def should_preserve(self, checkpoints, *, context):
        return [c.step in self.steps for c in checkpoints]


@dataclasses.dataclass
class Restored:
    step: int
    model: nnx.Module
    optimizer: nnx.Optimizer
    data: Any
    config: dict[str, Any]


# -- the manager -------------------------------------------------------------------------------

class Checkpointer:
    """`ocp.CheckpointManager` over ``directory`` keeping the last `max_to_keep` checkpoints.

    ``read_only=True`` (every reader of a run: `zoo.train.load`, generation, evaluation):
    nothing in ``directory`` is created, cleaned up, moved or deleted, and `save` refuses.
    """

    ITEMS = ("state", "data", "config")

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3,
                 async_save: bool = True, save_timeout_s: float = SAVE_TIMEOUT_S,
                 read_only: bool = False):
        self.directory = os.path.abspath(os.fspath(directory))
        self.read_only = bool(read_only)
        self.save_timeout_s = float(save_timeout_s)
        self.failed: CheckpointSaveFailed | None = None
        self._waiter: tuple[int, threading.Thread, dict[str, Any]] | None = None
        self._bad: set[int] = set()  # steps a read-only look found corrupt
        if _QUIET not in logging.getLogger("absl").filters:
            logging.getLogger("absl").addFilter(_QUIET)
        self._protected = _Protected()
        if self.read_only:
            options = ocp.CheckpointManagerOptions(
                read_only=True, create=False, cleanup_tmp_directories=False,
                save_interval_steps=0, enable_async_checkpointing=False)
        else:
            policy = pp.AnyPreservationPolicy([pp.LatestN(max_to_keep), self._protected])
            options = ocp.CheckpointManagerOptions(
                preservation_policy=policy, create=True, cleanup_tmp_directories=True,
                enable_async_checkpointing=async_save)
        handlers = dict(state=ocp.StandardCheckpointHandler(), data=ProcessJsonHandler(),
                        config=ocp.JsonCheckpointHandler())
        self.manager = _listed(lambda: ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers))

    # -- queries -------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def steps_on_disk(self) -> list[int]:
        """The steps whose checkpoint is complete on disk now: Orbax writes each into a
        temporary folder and names it ``<step>`` only when it is whole."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(n) for n in os.listdir(self.directory)
                      if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def has_digests(self, step: int) -> bool:
        """Whether `step`'s folder holds its digest record (see the module docstring)."""
        return os.path.isfile(os.path.join(self.directory, str(step), DIGESTS))

    def verified_steps(self) -> list[int]:
        """The complete steps on disk with a digest record, less any this manager found
        corrupt: the checkpoints "the last good checkpoint" may name."""
        return [s for s in self.steps_on_disk() if s not in self._bad and self.has_digests(s)]

    def intact(self, step: int) -> bool:
        """Whether `restore` would take `step` as it is: its files match its digest record
        (every process checks its share), or it has no record and no older step has one (an
        older run). Reads every byte of the step once."""
        if not all_processes_agree(self.has_digests(step)):
            return all_processes_agree(not any(self.has_digests(s) for s in self.steps()
                                               if s < step))
        return self._verify(step) is None

    @property
    def saving(self) -> int | None:
        """The step whose save is in flight (its digests are recorded when it finishes)."""
        return self._waiter[0] if self._waiter is not None else None

    def read_config(self, step: int, *, verify: bool = False) -> dict[str, Any]:
        """The ``config`` item of `step`; ``verify`` first checks its files against the
        step's digest record (when it has one), raising ValueError if they differ."""
        where = os.path.join(self.directory, str(step))
        problem = check_digests(where, item="config") if verify and self.has_digests(step) \
            else None
        if problem:
            raise ValueError(f"checkpoint {where}: {problem}")
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))[
            "config"]

    def saved_shapes(self, step: int):
        """The ``state`` item's tree of array metadata (shapes), read without the arrays."""
        return self.manager.item_metadata(step)["state"]

    # -- save / restore ------------------------------------------------------------------------
    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, *, data_state: Any,
             config: Mapping[str, Any]) -> None:
        """Start saving `step` (asynchronous; see `check` and `wait`) once the previous save is
        known to have succeeded (`CheckpointSaveFailed` otherwise). All processes call it;
        once the save is whole, process 0 records its digests (in the waiting thread)."""
        if self.read_only:
            raise RuntimeError(f"{self.directory} is open read-only; a reader never saves")
        self.wait()
        args = ocp.args.Composite(state=ocp.args.StandardSave(to_pure(model, optimizer)),
                                  data=DataStateSave(data_state),
                                  config=ocp.args.JsonSave(dict(config)))
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as e:
            raise self._failure(step, save_failure_reason(e)) from None
        def finish():
            self.manager.wait_until_finished()
            if jax.process_index() == 0:
                record_digests(os.path.join(self.directory, str(step)))

        self._waiter = (step, *_watch(finish, f"zoo-save-{step}"))

    def check(self, timeout_s: float = 0.0) -> None:
        """Raise `CheckpointSaveFailed` if the save in flight failed, or (``timeout_s > 0``)
        has not finished within `timeout_s` seconds; return at once while it is still going
        (``timeout_s=0``), or when there is none."""
        if self.failed is not None:
            raise self.failed
        if self._waiter is None:
            return
        step, thread, out = self._waiter
        thread.join(timeout_s)
        if thread.is_alive():
            if timeout_s > 0:
                raise self._failure(step, f"it did not finish within {timeout_s:g} s (a hung "
                                          f"or very slow file system)")
            return
        self._waiter = None
        if "error" in out:
            raise self._failure(step, save_failure_reason(out["error"]))

    def _failure(self, step: int, reason: str) -> CheckpointSaveFailed:
        done = [s for s in self.verified_steps() if s != step]
        last = (f"the last good checkpoint is step {done[-1]} in {self.directory}" if done
                else f"there is no checkpoint in {self.directory} yet")
        self.failed = CheckpointSaveFailed(
            f"saving the checkpoint of step {step} failed: {reason}. Training stopped there; "
            f"{last} (checkpoints on disk are never replaced by a partial one). Free space or "
            f"make the run dir writable, then rerun the same command to resume"
            f"{' from it' if done else ''}")
        return self.failed

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None, *,
                check: Callable[[int, dict[str, Any]], None] | None = None,
                step: int | None = None, move_bad: bool = True) -> Restored | None:
        """Restore the newest good checkpoint into copies of `model` and `optimizer`.

        `model`/`optimizer` may be abstract (`zoo.train.step.abstract_state`): their
        `jax.ShapeDtypeStruct` leaves give the shapes, dtypes and shardings to restore onto.
        Each step tried is first checked against its digest record (the module docstring
        says what a step without one gets); ``check(step, config)`` runs on the saved config
        before the arrays are read, and an exception from it (e.g. the model shape changed)
        propagates. A checkpoint that is corrupt or fails to read is moved aside with a
        warning and the previous one is tried. Returns None when there is no good checkpoint;
        else `Restored` with the new model and optimizer. ``optimizer=None`` restores the
        model alone (`Restored.optimizer` is None); ``step`` restores that step only;
        ``move_bad=False`` (and a read-only manager) leaves bad checkpoints where they are.
        """
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            to_pure(model, optimizer))
        move_bad = move_bad and not self.read_only
        for s in self._candidates(step):
            where = os.path.join(self.directory, str(s))
            if self.read_only and step is None and jax.process_count() == 1 and \
                    not os.path.isdir(where):
                continue  # rotated out by a live trainer since the listing
            skip = self._unverified(s, asked=step is not None)
            if skip is not None:
                if move_bad:
                    warnings.warn(f"checkpoint {where} {skip}; moving it to unverified-{s} and "
                                  f"trying the previous one", stacklevel=2)
                    self._move_aside(s, "unverified")
                else:
                    warnings.warn(f"checkpoint {where} {skip}; skipping it", stacklevel=2)
                continue
            error = self._verify(s)
            config = None
            if error is None:
                try:
                    config = self.read_config(s)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
            if all_processes_agree(config is not None):
                if check is not None:
                    check(s, config)
                out = None
                try:
                    out = self._read(s, target, partial=optimizer is None)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
                if all_processes_agree(out is not None):
                    return self._restored(s, model, optimizer, out, config)
            if self.read_only and not os.path.isdir(where):
                continue  # rotated out by a live trainer while being read: try the newest
            reason = error if error is not None else "unreadable on another process"
            self._bad.add(s)
            if not move_bad:
                warnings.warn(f"checkpoint {where} cannot be read ({reason[:500]}); trying the "
                              f"previous one", stacklevel=2)
                continue
            warnings.warn(f"checkpoint {where} cannot be read ({reason[:500]}); moving it to "
                          f"corrupt-{s} and trying the previous one", stacklevel=2)
            self._move_aside(s)
        return None

    def _candidates(self, step: int | None):
        """The steps to try, newest first, each once; a read-only manager of one process lists
        the folder again before each (a live trainer saves and rotates meanwhile)."""
        if step is not None:
            yield step
            return
        tried: set[int] = set()
        while True:
            if self.read_only and jax.process_count() == 1:
                _listed(self.manager.reload)
            left = [s for s in self.steps() if s not in tried and s not in self._bad]
            if not left:
                return
            tried.add(left[-1])
            yield left[-1]

    def _unverified(self, step: int, *, asked: bool) -> str | None:
        """Why `step` (without a digest record) is passed over for an older step that has
        one; None when it has a record, was asked for, or no older step has a record."""
        if all_processes_agree(self.has_digests(step)):
            return None
        if not asked:
            older = any(self.has_digests(s) for s in self.steps()
                        if s < step and s not in self._bad)
            if not all_processes_agree(not older):
                return ("has no digest record (its run stopped between the save and the "
                        "record, or is writing it now), and an older checkpoint has one")
        warnings.warn(f"checkpoint {os.path.join(self.directory, str(step))} has no digest "
                      f"record (saved before checkpoints recorded digests, or asked for by "
                      f"step): reading it unverified", stacklevel=3)
        return None

    def _verify(self, step: int) -> str | None:
        """What differs from `step`'s digest record (this process's share of its files, then
        agreed by all), or None; None also for a step without a record (`_unverified`)."""
        if not all_processes_agree(self.has_digests(step)):
            return None
        problem = check_digests(os.path.join(self.directory, str(step)),
                                (jax.process_index(), jax.process_count()))
        if all_processes_agree(problem is None):
            return None
        return (f"its files differ from the digests recorded when it was saved: {problem}"
                if problem else "its files differ from their digests on another process")

    def _restored(self, step: int, model, optimizer, out: dict[str, Any],
                  config: dict[str, Any]) -> Restored:
        # copies: the abstract originals may be in use elsewhere (e.g. compiling)
        model = nnx.clone(model)
        optimizer = None if optimizer is None else nnx.clone(optimizer)
        for module, key in ((model, "model"), (optimizer, "optimizer")):
            if module is None:
                continue
            state = nnx.state(module)
            nnx.replace_by_pure_dict(state, out["state"][key])  # in place
            nnx.update(module, state)
        return Restored(step, model, optimizer, out["data"], config)

    def _read(self, step: int, target: dict[str, Any], *, partial: bool) -> dict[str, Any]:
        """The state (onto `target`'s shardings) and data items of `step`; ``partial``
        reads only the entries `target` holds (the model without its optimizer)."""
        if not partial:
            return self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=DataStateRestore()))
        data = self.manager.restore(step, args=ocp.args.Composite(data=DataStateRestore()))
        args = ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)
        with ocp.PyTreeCheckpointer() as reader:
            state = reader.restore(os.path.join(self.directory, str(step), "state"), args=args)
        return {"state": state, "data": data["data"]}

    def protect(self, step: int) -> None:
        """Never rotate `step` out (for the life of this manager)."""
        self._protected.steps.add(int(step))

    def move_aside(self, step: int, prefix: str) -> str:
        """Rename checkpoint `step` to ``<prefix>-<step>`` (replacing an older one of that
        name) after pending saves finish; all processes call it. Returns the new path."""
        if self.read_only:
            raise RuntimeError(f"{self.directory} is open read-only; a reader moves nothing")
        self.wait()
        self._move_aside(step, prefix)
        return os.path.join(self.directory, f"{prefix}-{step}")

    def _move_aside(self, step: int, prefix: str = "corrupt") -> None:
        if jax.process_index() == 0:
            src = os.path.join(self.directory, str(step))
            dst = os.path.join(self.directory, f"{prefix}-{step}")
            if os.path.exists(dst):
                shutil.rmtree(dst)
            os.replace(src, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"zoo_checkpoint_{prefix}_{step}")
        _listed(self.manager.reload)

    def wait(self) -> None:
        """Block until the save in flight is on disk (at most ``save_timeout_s``); raises
        `CheckpointSaveFailed` if it failed or timed out."""
        self.check(self.save_timeout_s)

    def close(self) -> None:
        """Wait for the save in flight (bounded), then close the manager; after a failed save
        the manager is closed without raising again (the error was raised already)."""
        if self.failed is None:
            self.wait()
        thread, out = _watch(self.manager.close, "zoo-ckpt-close")
        thread.join(self.save_timeout_s if self.failed is None else 10.0)
        if "error" in out and self.failed is None:
            raise out["error"]
