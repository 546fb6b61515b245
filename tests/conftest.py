"""Test setup: 8 virtual CPU devices (set before jax starts its backend), XLA:CPU collective
timeouts for shared cores, LLVM -O0 (compile time dominates), no persistent compile cache, and
the xdist grouping that lets the suite run on every core (``-n auto --dist loadgroup`` in
pyproject.toml): tests that share a module-scoped fixture (a compiled model, a trained run) run
on one worker, so it is built once; every other test goes to whichever worker is free."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import zoo  # noqa: F401  (first: it imports jax without the CUDA plugin's driver notices)

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


def _mapping_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


# Linux caps a process at vm.max_map_count mappings (65530 by default); every executable XLA:CPU
# compiles holds several, and jax keeps them all in its caches for the life of the process.
MAPPINGS_BEFORE_CLEARING = 24_000


def pytest_runtest_teardown(item, nextitem):
    """Free what the tests compiled: when the worker leaves a test file, or sooner when its
    mappings near Linux's cap. Without this a worker that had run a few hundred tests failed to
    map new code ("LLVM compilation error: Cannot allocate memory", then a segfault) and xdist,
    replacing it under --dist loadgroup, hung to the CI's time limit."""
    leaving = nextitem is None or nextitem.path != item.path
    if leaving or (os.path.exists("/proc/self/maps")
                   and _mapping_count() > MAPPINGS_BEFORE_CLEARING):
        import gc
        jax.clear_caches()
        gc.collect()


_RESOURCE_LOG = os.environ.get("ZOO_TEST_RESOURCE_LOG")
if _RESOURCE_LOG:
    import json
    import resource
    import time

    def _status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) // 1024  # MiB
        return -1

    def _cpu_seconds():
        """(this worker's, its waited-for children's) user + system CPU seconds so far."""
        own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """One line per test (``ZOO_TEST_RESOURCE_LOG=path``): wall time, the worker's
        resident memory before/peak/after (MiB), its mapping count, children's peak, and the
        CPU seconds the worker and its children spent (cpu / wall below 1: the test waited)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident size
        except OSError:
            pass
        rss0, t0 = _status("VmRSS"), time.time()
        cpu0 = _cpu_seconds()
        yield
        maps = _mapping_count()
        cpu = _cpu_seconds()
        row = dict(test=item.nodeid, worker=os.environ.get("PYTEST_XDIST_WORKER", "-"),
                   start=round(t0, 1), wall=round(time.time() - t0, 1), rss0=rss0,
                   hwm=_status("VmHWM"), rss=_status("VmRSS"), maps=maps,
                   children=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024,
                   cpu=round(cpu[0] - cpu0[0], 1), children_cpu=round(cpu[1] - cpu0[1], 1))
        with open(_RESOURCE_LOG, "a") as f:
            f.write(json.dumps(row) + "\n")
