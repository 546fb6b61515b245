"""The trainer's data feed: batches fetched by a thread and watched, so a stream that fails,
stalls or loses its files ends the run cleanly instead of hanging it.

`Feed(data, files=..., timeout_s=...)` pulls ``next(data)`` in a daemon thread, one batch ahead,
each with the iterator's state *after* it (so a checkpoint records exactly the batches the
model consumed). `Feed.get(stop)` waits for the next batch while it watches:

* the trainer's stop flag (SIGTERM/SIGINT): `get` returns None at once;
* the stream itself: an exception from the pipeline (e.g. a data folder deleted mid-run)
  becomes `DataStreamError` naming it;
* a stall: no batch within ``timeout_s`` seconds (e.g. a corpus truncated to nothing, whose
  pipeline keeps looking for tokens) is `DataStreamError`;
* the files: every ``check_s`` seconds, and before each batch, the data files must still exist
  with at least the size they had when the run started; a file that vanished or shrank is
  `DataStreamError` naming it.

The trainer then saves the last good state and exits with `EXIT_DATA`.

Before anything is compiled, `Feed.probe` proves the stream works: it pulls a first batch
(within ``timeout_s``), requires at least one token with a target (a loss weight above 0) and
rewinds the stream to where it was, so the first step trains on that same batch. A stream that
fails, stalls or yields nothing to learn from is `NoTrainingData` (a usage error: exit 2).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Feed", "DataStreamError", "NoTrainingData", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0


class DataStreamError(RuntimeError):
    """The data stream failed, stalled, or its files changed under it."""


class NoTrainingData(ValueError):
    """Before training: the data stream yields no first batch with a token to learn from."""


class Feed:
    def __init__(self, data: Any, *, files: Sequence[str] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, check_s: float = 5.0,
                 poll_s: float = 0.2):
        self.data, self.timeout_s, self.check_s, self.poll_s = data, timeout_s, check_s, poll_s
        self.sizes = {f: os.path.getsize(f) for f in files or () if os.path.exists(f)}
        self.state = data.get_state() if hasattr(data, "get_state") else None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._checked = time.monotonic()

    def set_state(self, state: Any) -> None:
        """Restore the stream (before the first `get`)."""
        if self._thread is not None:
            raise RuntimeError("Feed.set_state after the feed started")
        self.data.set_state(state)
        self.state = self.data.get_state()

    def probe(self, stop: Any = None) -> Feed:
        """Pull a first batch, check it has a target, and rewind the stream (see the module
        docstring); returns the feed. Returns early, without a verdict, when `stop` is
        signalled."""
        box: dict[str, Any] = {}

        def pull():
            try:
                box["batch"] = next(self.data)
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e

        thread = threading.Thread(target=pull, name="zoo-data-probe", daemon=True)
        thread.start()
        start = time.monotonic()
        while thread.is_alive():
            thread.join(self.poll_s)
            if stop is not None and stop.signal is not None:
                return self
            if thread.is_alive() and time.monotonic() - start > self.timeout_s:
                raise NoTrainingData(
                    f"the data stream yielded no first batch within {self.timeout_s:g} s "
                    f"(--data-timeout){self._files()}; check that the data holds text")
        if "error" in box:
            e = box["error"]
            raise NoTrainingData(f"the data stream failed on its first batch{self._files()}: "
                                 f"{type(e).__name__}: {str(e)[:300]}") from e
        weights = box["batch"].get("loss_weights") if hasattr(box["batch"], "get") else None
        if weights is not None and not np.any(np.asarray(weights) > 0):
            raise NoTrainingData(f"the first batch has no token to learn from (every loss "
                                 f"weight is 0){self._files()}; give --data documents with "
                                 f"text")
        if self.state is not None:
            self.data.set_state(self.state)
        else:  # a stream without state cannot rewind: the probed batch is the first one
            self._queue.put(("batch", box["batch"], None))
        return self

    def _files(self) -> str:
        if not self.sizes:
            return ""
        names = sorted(self.sizes)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f" (data files: {shown})"

    def _pull(self) -> None:
        while not self._closed.is_set():
            try:
                item = ("batch", next(self.data), self.data.get_state())
            except BaseException as e:  # handed to the trainer's thread
                item = ("error", e, None)
            while not self._closed.is_set():
                try:
                    self._queue.put(item, timeout=self.poll_s)
                    break
                except queue.Full:
                    continue
            if item[0] == "error":
                return

    def get(self, stop: Any = None) -> Any | None:
        """The next batch (its state kept in `state`), or None when `stop` was signalled."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._pull, name="zoo-data", daemon=True)
            self._thread.start()
        self.check_files()
        start = time.monotonic()
        while True:
            try:
                kind, value, state = self._queue.get(timeout=self.poll_s)
                break
            except queue.Empty:
                pass
            if stop is not None and stop.signal is not None:
                return None
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise DataStreamError(
                    f"the data stream yielded no batch for {waited:.0f} s (the limit is "
                    f"--data-timeout {self.timeout_s:g}); check that the --data files still hold "
                    f"text")
            if time.monotonic() - self._checked > self.check_s:
                self.check_files()
        if kind == "error":
            raise DataStreamError(f"the data stream failed: {type(value).__name__}: "
                                  f"{str(value)[:300]}") from value
        self.state = state
        return value

    def check_files(self) -> None:
        self._checked = time.monotonic()
        for path, size in self.sizes.items():
            try:
                now = os.path.getsize(path)
            except OSError:
                raise DataStreamError(f"the data file {path} vanished during the run") from None
            if now < size:
                raise DataStreamError(f"the data file {path} shrank during the run ({size:,} "
                                      f"-> {now:,} bytes)")

    def close(self) -> None:
        self._closed.set()
        getattr(self.data, "close", lambda: None)()
