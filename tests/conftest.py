"""Test setup: 8 virtual CPU devices (set before jax starts its backend), XLA:CPU collective
timeouts for shared cores, LLVM -O0 (compile time dominates), no persistent compile cache, and
the xdist grouping that lets the suite run on every core (``-n auto --dist loadgroup`` in
pyproject.toml): tests that share a module-scoped fixture (a compiled model, a trained run) run
on one worker, so it is built once; every other test goes to whichever worker is free."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from zoo.train.launch import add_xla_flags, relax_cpu_collective_timeouts

# A virtual device late to a collective by 60 s (2 cores, 8 devices, a loaded machine) makes
# XLA:CPU abort the whole session; wait longer (before the backend reads XLA_FLAGS). Children
# inherit it through the environment.
relax_cpu_collective_timeouts()
# The suite is compile-bound (hundreds of small programs): LLVM at -O0 compiles them ~30%
# faster and runs them no slower at these sizes. Test processes only (children inherit it);
# the recipes and benchmarks keep XLA's default.
add_xla_flags(xla_backend_optimization_level=0)

# Overrides any count in XLA_FLAGS/JAX_NUM_CPU_DEVICES; importing jax started no backend yet.
jax.config.update("jax_num_cpu_devices", 8)
# No persistent compile cache: on 8 CPU devices, executables read back from it deadlock in
# their collectives now and then (`zoo.train.launch.cache_is_safe`); subprocess runs of the
# recipes decide for themselves (the same rule).
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 virtual CPU devices, got {len(devs)}"
    return devs


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Group each test that uses a module-scoped fixture with its module (before xdist reads
    the ``xdist_group`` marks), so the fixture is built on one worker only."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        scopes = {defs[-1].scope for name in info.names_closure
                  if (defs := info.name2fixturedefs.get(name))}
        if "module" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
