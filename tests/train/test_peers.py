"""A peer of a multi-process job that dies or never joins (`zoo.train.peers`): the survivors
exit 6 within ``--peer-timeout`` + a few seconds, naming the peer and the last checkpoint on
disk, instead of JAX's C++ abort (exit 134) minutes later.

The `Watchdog` against a fake key-value store first; then, end to end, a two-process recipe run
whose process 1 is SIGKILLed after its first checkpoint, a job whose coordinator (process 0) is
SIGKILLed, and a process 0 whose peer never starts.
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from zoo.train import TrainConfig
from zoo.train import peers

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--set", "num_hidden_layers=1", "--set", "hidden_size=32", "--set",
        "intermediate_size=32", "--set", "num_attention_heads=4", "--set", "head_dim=8"]
TIMEOUT = 20  # --peer-timeout of the end-to-end runs
SLACK = 15    # seconds past it a survivor may take on two shared cores


class FakeStore:
    """The distributed client's key-value calls; `fail` makes every call raise (coordinator
    gone)."""

    def __init__(self):
        self.values, self.fail = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.fail:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        self.values[key] = value

    def key_value_try_get(self, key):
        if self.fail:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


def test_watchdog_names_the_silent_peer(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(peers.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    dog = peers.Watchdog(store, 0, 3, 10, coordinator=None, name="run",
                         directory=str(tmp_path))
    for t in range(12):  # process 1 beats every second, process 2 never
        clock[0] = 1000.0 + t
        store.values["zoo/peers/alive/1"] = str(t)
        dog.poll()
        assert dog.lost() == ([2] if t >= 10 else [])
    (tmp_path / "4").mkdir()
    (tmp_path / "6.orbax-checkpoint-tmp").mkdir()
    message = dog.message(dog.lost())
    assert "process 2 of 3 stopped answering" in message
    assert f"step 4 in {tmp_path}" in message


def test_watchdog_names_a_vanished_coordinator(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(peers.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    dog = peers.Watchdog(store, 1, 2, 10, coordinator=None)
    store.values["zoo/peers/alive/0"] = "1"
    dog.poll()
    store.fail = True
    for t in range(1, 12):
        clock[0] = float(t)
        dog.poll()
    assert dog.lost() == [0]
    assert "process 0 (the coordinator) of 2" in dog.message([0])
    assert "there is no checkpoint on disk" in dog.message([0])


def test_failures_that_may_come_from_a_lost_peer():
    gloo = RuntimeError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer")
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("the save at step 4 failed") from e
    except ValueError as e:
        assert peers.caused_by_a_peer(e)
    assert not peers.caused_by_a_peer(ValueError("no space left on device"))


def test_a_failed_collective_waits_for_the_verdict(monkeypatch):
    """The CLI's training call: with several processes, a gloo failure is held until the
    watchdog has judged (here it finds every peer alive, so the failure is raised as it is)."""
    import jax

    from zoo.train import cli
    waited = []

    class Dog:
        def await_verdict(self):
            waited.append(True)

    class Trainer:
        def train(self):
            raise jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection "
                                             "closed by peer [127.0.0.1]:8902")

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setitem(peers._current, "dog", Dog())
    with pytest.raises(jax.errors.JaxRuntimeError):
        cli._train_watched(Trainer())
    assert waited == [True]


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf")])
def test_peer_timeout_is_validated(value):
    with pytest.raises(ValueError, match=r"--peer-timeout .*must be a finite number of seconds"):
        TrainConfig(peer_timeout=value)


# -- end to end --------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_COORDINATOR_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _recipe(run_dir, port, pid, log):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "recipes" / "mini_mixtral.py"), "--steps", "500",
         "--checkpoint-every", "2", "--batch-size", "4", "--seq-len", "32", "--no-progress",
         *TINY, "--devices", "4", "--mesh", "fsdp=2,expert=2,context=2",
         "--run-dir", str(run_dir), "--peer-timeout", str(TIMEOUT),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)],
        env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _wait(proc, limit):
    """(exit code, seconds it took) or a failure after `limit` s (the process is killed)."""
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {limit} s later")
    return code, time.monotonic() - t0


@pytest.mark.e2e
def test_a_killed_peer_ends_the_survivor_with_exit_6(tmp_path):
    run_dir, port = tmp_path / "run", _free_port()
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [_recipe(run_dir, port, i, logs[i]) for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "2").is_dir():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "p0.log").read_text()[-3000:]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        code, took = _wait(procs[0], TIMEOUT + SLACK + 30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    out = (tmp_path / "p0.log").read_text()
    print(f"process 0 exited {code} {took:.1f} s after process 1 was killed")
    assert code == peers.EXIT_PEER, out[-3000:]
    assert took <= TIMEOUT + SLACK, f"exit 6 after {took:.0f} s"
    assert "process 1 of 2 stopped answering" in out
    steps = peers.complete_steps(str(run_dir / "checkpoints"))
    where = f"checkpoint on disk is step {steps[-1]} in {run_dir / 'checkpoints'}"
    assert where in out, out[-2000:]


JOIN = """
import sys, time
from zoo.train import launch
launch.set_cpu_devices(1)
launch.init_distributed(coordinator=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]),
                        distributed=False, peer_timeout=float(sys.argv[3]))
print("joined", flush=True)
time.sleep(600)
"""


def _joiner(port, pid, timeout=TIMEOUT):
    return subprocess.Popen([sys.executable, "-c", JOIN, f"127.0.0.1:{port}", str(pid),
                             str(timeout)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


@pytest.mark.e2e
def test_a_killed_coordinator_ends_process_1_with_exit_6():
    port = _free_port()
    procs = [_joiner(port, i) for i in range(2)]
    try:
        line = ""
        for _ in range(50):  # stderr is merged: a library's log lines may come first
            line = procs[1].stdout.readline().strip()
            if line in ("joined", ""):
                break
        assert line == "joined"
        time.sleep(2)
        procs[0].send_signal(signal.SIGKILL)
        code, took = _wait(procs[1], TIMEOUT + SLACK + 30)
        out = procs[1].stdout.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"process 1 exited {code} {took:.1f} s after process 0 was killed")
    assert code == peers.EXIT_PEER, out[-3000:]
    assert took <= TIMEOUT + SLACK, f"exit 6 after {took:.0f} s"
    assert "process 0 (the coordinator) of 2" in out and "no checkpoint on disk" in out


@pytest.mark.e2e
def test_a_peer_that_never_starts_ends_process_0_with_exit_6(tmp_path):
    port = _free_port()
    with open(tmp_path / "p0.log", "w") as log:
        proc = _recipe(tmp_path / "run", port, 0, log)
        code, took = _wait(proc, TIMEOUT + SLACK + 60)
    out = (tmp_path / "p0.log").read_text()
    print(f"process 0 alone exited {code} {took:.1f} s after it started")
    assert code == peers.EXIT_PEER, out[-3000:]
    # from the process start: the imports (seconds on two busy cores), then the wait to join
    assert took <= TIMEOUT + SLACK + 20, f"exit 6 after {took:.0f} s"
    assert f"process 1 of 2 did not join the job at 127.0.0.1:{port} within --peer-timeout" \
        in out, out[-2000:]
