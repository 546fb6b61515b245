"""Test setup: 8 virtual CPU devices (set before jax starts its backend) and a shared compile
cache."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from zoo.train.launch import relax_cpu_collective_timeouts

# A virtual device late to a collective by 60 s (2 cores, 8 devices, a loaded machine) makes
# XLA:CPU abort the whole session; wait longer (before the backend reads XLA_FLAGS).
relax_cpu_collective_timeouts()

# Overrides any count in XLA_FLAGS/JAX_NUM_CPU_DEVICES; importing jax started no backend yet.
jax.config.update("jax_num_cpu_devices", 8)
# Many tests (and xdist workers) compile the same small programs: share them on disk.
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 virtual CPU devices, got {len(devs)}"
    return devs
