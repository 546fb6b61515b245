"""What a run records about itself: `Summary` (its closing line), ``run.json`` values
(`normalise`, `versions`) and the settings that changed since a checkpoint (`changes`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["Summary", "normalise", "versions", "changes", "write_json"]


@dataclasses.dataclass
class Summary:
    run_dir: str
    start_step: int          # updates completed before this `train` call (0 when fresh)
    step: int                # updates completed at the end
    steps: int               # the planned total
    stopped_by: str | None   # "SIGTERM"/"SIGINT"/a hook when the run stopped early
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float | None  # median over this call's steps after its first (None: fewer
    #                             than two of them)
    compile_s: float
    wall_s: float
    name: str = "train"
    target: int | None = None  # the step this call trained to (default `steps`)

    def line(self, name: str | None = None) -> str:
        """The run's closing line (what the recipes print)."""
        name = name or self.name
        target = self.steps if self.target is None else self.target
        if self.step == self.start_step and not self.stopped_by and self.step >= target:
            return (f"{name}: the checkpoint is already at step {self.step} of the planned "
                    f"{target}: nothing to train (raise --steps to train further); run dir "
                    f"{self.run_dir}")
        if self.stopped_by:
            state = (f"stopped by {self.stopped_by} at step {self.step}/{self.steps} (rerun to "
                     f"resume)")
        else:
            state = f"finished {self.step}/{self.steps} steps"
        loss = (f"loss {self.first_loss:.3f} -> {self.last_loss:.3f}" if self.last_loss is not None
                else "no steps run")
        tps = (f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else
               ", tokens/s n/a (too few steps past the first)" if self.last_loss is not None
               else "")
        return (f"{name}: {state}; {loss}{tps}; compile {self.compile_s:.1f}s, "
                f"wall {self.wall_s:.1f}s; run dir {self.run_dir}")


def versions() -> dict[str, str]:
    import flax
    import optax

    import zoo
    return {"zoo": zoo.__version__, "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "python": sys.version.split()[0]}


def _json_default(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def normalise(x):
    """`x` as JSON would give it back (tuples as lists, numpy scalars as numbers)."""
    return json.loads(json.dumps(x, default=_json_default))


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def changes(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    a, b = _leaves(dict(saved or {})), _leaves(dict(now))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def write_json(path: str, value: Any) -> None:
    """Write `value` to `path` atomically (a temporary file, synced, then renamed over it), so
    a crash leaves the old file or the new one, never half of one. An existing file that is
    not a JSON object is set aside to ``<path>.corrupt`` with a warning, not overwritten."""
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                ok = isinstance(json.loads(f.read().decode("utf-8")), dict)
        except (OSError, UnicodeDecodeError, ValueError):
            ok = False
        if not ok:
            os.replace(path, path + ".corrupt")
            warnings.warn(f"{path} was damaged (not a JSON object); moved it to "
                          f"{path}.corrupt and wrote a new one", stacklevel=2)
    with open(path + ".tmp", "w") as f:
        json.dump(normalise(value), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
