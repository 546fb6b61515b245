"""One run per run dir: an exclusive lock file, ``RUN_DIR/run.lock``.

The lock file holds the holder's host, pid, start time and command line (JSON). It is written
to a temporary file first and then hard-linked into place: `os.link` fails when the name
exists, so taking the lock is atomic and the file is never seen half-written. A second run on
the same dir gets `RunDirLocked` naming the holder. A lock whose process is gone (same host,
pid no longer running: e.g. after SIGKILL or a power cut) is stale and is taken over with a
warning; a lock from another host cannot be checked and is never taken over.

In a multi-process job only process 0 takes the lock (the recipes' command line does this).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import sys

__all__ = ["RunLock", "RunDirLocked", "LOCK_NAME"]

LOCK_NAME = "run.lock"


class RunDirLocked(RuntimeError):
    """Another run holds the run dir's lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """``with RunLock(run_dir): ...`` -- or `acquire` / `release`. The run dir must exist."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = os.path.abspath(os.fspath(run_dir))
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self.info = dict(host=socket.gethostname(), pid=os.getpid(),
                         started=datetime.datetime.now(datetime.UTC).isoformat(
                             timespec="seconds"),
                         argv=sys.argv, token=secrets.token_hex(8))
        self.held = False

    # -- taking and releasing ------------------------------------------------------------------
    def acquire(self) -> RunLock:
        for _ in range(3):  # a stale lock taken over, then one more try
            if self._try_link():
                self.held = True
                return self
            holder = self._read(self.path)
            if holder is None:  # vanished between our link and our read: try again
                continue
            if not self._stale(holder):
                raise RunDirLocked(self._message(holder))
            self._take_over(holder)
        raise RunDirLocked(f"could not take the lock {self.path}: other runs keep taking it; "
                           f"start one run per --run-dir")

    def release(self) -> None:
        """Remove the lock file if it is still ours."""
        if self.held:
            self.held = False
            holder = self._read(self.path)
            if holder is not None and holder.get("token") == self.info["token"]:
                try:
                    os.unlink(self.path)
                except OSError as e:  # e.g. the file system turned read-only
                    import warnings
                    warnings.warn(f"could not remove the lock {self.path} ({e}); the next run "
                                  f"on this host takes it over, its pid being gone",
                                  stacklevel=2)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # -- helpers -------------------------------------------------------------------------------
    def _try_link(self) -> bool:
        tmp = f"{self.path}.{self.info['host']}.{os.getpid()}.{self.info['token']}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.info, f)
        try:
            os.link(tmp, self.path)  # atomic; fails if the lock exists
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    @staticmethod
    def _read(path: str) -> dict | None:
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: treat as held by an unknown run

    def _stale(self, holder: dict) -> bool:
        pid = holder.get("pid")
        return (holder.get("host") == self.info["host"] and isinstance(pid, int)
                and pid != os.getpid() and not _alive(pid))

    def _take_over(self, holder: dict) -> None:
        # Move the stale file aside under a name only we use; if what we moved is not the stale
        # lock we judged (another run took it over meanwhile), put it back.
        aside = f"{self.path}.stale.{os.getpid()}.{self.info['token']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if self._read(aside) != holder:
            os.rename(aside, self.path)
            return
        os.unlink(aside)
        # one line on stderr, not a warning with its source line: this is news, not a fault
        print(f"{self.path}: taking over a stale lock from pid {holder.get('pid')} on "
              f"{holder.get('host')} (started {holder.get('started')}; that process is gone)",
              file=sys.stderr, flush=True)

    def _message(self, holder: dict) -> str:
        if not holder:
            who = "an unknown run (the lock file is unreadable)"
        else:
            who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started "
                   f"{holder.get('started')}")
            if holder.get("argv"):
                who += f" ({' '.join(map(str, holder['argv']))[:200]})"
        return (f"--run-dir {self.run_dir} is in use by another run: {who}. Wait for it to "
                f"finish or stop it, or pass another --run-dir; if that run is gone, delete "
                f"{self.path}")
