"""Workarounds for flax behaviour, each keyed to the flax versions it was checked on.

A workaround applies where the installed flax is no newer than the last version it was
checked on (`CHECKED_ON`); on a newer flax the plain code runs, so a fixed bug costs nothing,
and one that is still there shows in the test suite -- the signal to re-check it and move
`CHECKED_ON`. Only versions up to 0.12.8 exist on the package index as of 2026-12.
"""

from __future__ import annotations

import re

import flax

CHECKED_ON = (0, 12, 8)


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.12.8"`` -> ``(0, 12, 8)`` (pre-release and local suffixes ignored)."""
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


FLAX_VERSION = version_tuple(flax.__version__)

# Under `nnx.eval_shape`, a jax-array draw counter in `nnx.Rngs` makes every draw store a
# tracer whose `.sharding` flax reads through an error path that walks the whole trace:
# quadratic in the number of parameters (DeepSeek-V3: 43 s instead of 2 s). A numpy counter
# is updated in place, outside the trace.
NUMPY_RNG_COUNTER = FLAX_VERSION <= CHECKED_ON
