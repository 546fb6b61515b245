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
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["Feed", "DataStreamError", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0


class DataStreamError(RuntimeError):
    """The data stream failed, stalled, or its files changed under it."""


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
