"""Process-level setup shared by the recipes, benchmarks and the rehearsal: the virtual CPU
device count, joining a multi-process job, the default mesh and the compile cache.

The device count goes through ``jax.config.update("jax_num_cpu_devices", n)``, which jax
accepts until its backend starts (importing jax starts none). Once it has started, the same
call raises `RuntimeError` for any value other than the one set before; that refusal is the
public sign that the backend is up, and the count it started with is then
``jax.local_device_count("cpu")`` -- so `set_cpu_devices` needs no private jax module.
Child processes inherit a count through the environment variable ``JAX_NUM_CPU_DEVICES``
(jax reads it at import) or ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.

Virtual devices share the host's cores, so one device can reach a collective long after its
peers (8 devices on 2 cores, with other work on the machine). XLA:CPU aborts the whole process
when a peer is 20 + 40 s late ("Termination timeout for `all reduce ...` exceeded"), which
kills a test session or a run without a checkpoint. `relax_cpu_collective_timeouts` raises
those limits through ``XLA_FLAGS`` (they have no jax option); `set_cpu_devices` calls it.
"""

from __future__ import annotations

import os
import re

__all__ = ["DEFAULT_CPU_DEVICES", "set_cpu_devices", "env_names_cpu_devices",
           "add_xla_flags", "relax_cpu_collective_timeouts", "cache_is_safe",
           "init_distributed", "default_mesh", "enable_compile_cache"]

DEFAULT_CPU_DEVICES = 8
_XLA_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def env_names_cpu_devices() -> bool:
    """Whether the environment already chose a CPU device count (read only, never edited)."""
    return bool(os.environ.get("JAX_NUM_CPU_DEVICES")
                or _XLA_COUNT.search(os.environ.get("XLA_FLAGS", "")))


# XLA:CPU's defaults are 20 s (warning) and 40 s more (abort); a late peer on shared cores is
# not a hang, so wait minutes. A real deadlock still ends the process, only later.
CPU_COLLECTIVE_WARN_S = 60
CPU_COLLECTIVE_TERMINATE_S = 240


def add_xla_flags(**flags) -> None:
    """Append ``--name=value`` to ``XLA_FLAGS`` for each flag it does not set yet (the
    environment's choice wins). XLA reads ``XLA_FLAGS`` once, when jax starts its backend, so
    this must run before that (importing jax is fine); child processes inherit it."""
    current = os.environ.get("XLA_FLAGS", "")
    extra = [f"--{name}={value}" for name, value in flags.items() if f"--{name}=" not in current]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()


def relax_cpu_collective_timeouts(warn_s: int = CPU_COLLECTIVE_WARN_S,
                                  terminate_s: int = CPU_COLLECTIVE_TERMINATE_S) -> None:
    """XLA:CPU's collective rendezvous timeouts in ``XLA_FLAGS`` (`add_xla_flags`)."""
    add_xla_flags(xla_cpu_collective_call_warn_stuck_timeout_seconds=warn_s,
                  xla_cpu_collective_call_terminate_timeout_seconds=terminate_s)


def set_cpu_devices(n: int | None, *, what: str = "--devices {}", fix: str | None = None
                    ) -> None:
    """Give the CPU backend `n` devices; ``None``: `DEFAULT_CPU_DEVICES` unless the environment
    names a count (`env_names_cpu_devices`). Must run before jax's backend starts; after that
    only the count it started with is accepted (a `ValueError` naming `what`, ``{}`` the
    count, and `fix` otherwise)."""
    import jax
    relax_cpu_collective_timeouts()
    if n is None and env_names_cpu_devices():
        return
    count = DEFAULT_CPU_DEVICES if n is None else n
    if count < 1:
        raise ValueError(f"{what.format(count)}: must be >= 1")
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend has started: fine if it has this count
        if n is None:
            return  # no explicit request: keep what is running
        try:
            have = jax.local_device_count("cpu")
        except RuntimeError:  # no CPU backend (JAX_PLATFORMS names only accelerators)
            have = None
        if have != n:
            raise ValueError(
                f"{what.format(n)}: jax already started with {have} CPU devices (something "
                f"touched a device first); {fix or 'run the recipe as a script'}, or set "
                f"JAX_NUM_CPU_DEVICES={n} before starting Python") from None


def init_distributed(*, coordinator: str | None, num_processes: int | None,
                     process_id: int | None, distributed: bool,
                     peer_timeout: float = 100.0) -> None:
    """Join a multi-process job when the arguments or ``JAX_*`` environment variables ask,
    and watch the peers (`zoo.train.peers`): one that does not join or stops answering within
    `peer_timeout` s raises `zoo.train.peers.PeerLost` (joining) or ends this process with a
    message and exit 6 (later)."""
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    num = num_processes if num_processes is not None else (
        int(env["JAX_NUM_PROCESSES"]) if env.get("JAX_NUM_PROCESSES") else None)
    pid = process_id if process_id is not None else (
        int(env["JAX_PROCESS_ID"]) if env.get("JAX_PROCESS_ID") else None)
    if coordinator is None and num is None and pid is None and not distributed:
        return
    import jax
    if not distributed and (coordinator is None or num is None or pid is None):
        raise ValueError(
            f"multi-process needs all of --coordinator HOST:PORT, --num-processes N and "
            f"--process-id I (got {coordinator!r}, {num!r}, {pid!r}), or --distributed to "
            f"detect them (SLURM, Open MPI, Cloud TPU)")
    if num is not None and pid is not None and not 0 <= pid < num:
        raise ValueError(f"--process-id {pid} must be in [0, --num-processes {num})")
    # CPU collectives across processes need gloo (harmless where the backend is GPU/TPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from zoo.train import peers
    peers.join(coordinator, num, pid, peer_timeout)
    from zoo import _jax_compat
    peers.watch(peer_timeout, coordinator=_jax_compat.distributed_state().coordinator_address)


def default_mesh(n: int, backend: str) -> str:
    """CPU: the EP-as-CP showcase (expert=2, context=2, the rest fsdp) as far as `n` allows;
    accelerators: plain FSDP over every device."""
    if backend != "cpu":
        return f"fsdp={n}"
    expert = 2 if n % 2 == 0 else 1
    context = 2 if n % (2 * expert) == 0 else 1
    return f"fsdp={n // (expert * context)},expert={expert},context={context}"


def cache_is_safe() -> bool:
    """Whether programs loaded from jax's persistent compile cache run safely here: not on a
    CPU backend with several devices. There, executables read back from the cache deadlock in
    their collectives now and then (a ring's collective-permute on some devices, an all-gather
    on another, every XLA:CPU worker thread waiting; jax 0.10.2, 3 of 7 runs of the sharded
    DeepSeek-V3 test step, none in 6 freshly compiled runs), so they are compiled every time."""
    import jax
    return not (jax.default_backend() == "cpu" and jax.device_count() > 1)


def enable_compile_cache() -> None:
    """Cache compiled programs on disk (``JAX_COMPILATION_CACHE_DIR``, else
    ``ZOO_COMPILATION_CACHE``, else ``~/.cache/zoo/jax``): a rerun or resume skips most of the
    first compile. Not where `cache_is_safe` says no (several CPU devices): there every run
    compiles, even when ``JAX_COMPILATION_CACHE_DIR`` names a cache."""
    import jax
    if not cache_is_safe():
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if not jax.config.jax_compilation_cache_dir:
        path = os.environ.get("ZOO_COMPILATION_CACHE",
                              os.path.join(os.path.expanduser("~"), ".cache", "zoo", "jax"))
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
