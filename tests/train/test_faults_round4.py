"""Multi-process mistakes caught before they hang, and logging faults handled like the other
faults (issue 52, items 4 and 7), through the recipe's command line:

* two processes started with different ``--steps`` or ``--mesh``: both exit 2 within 60 s,
  naming the field and both values (`zoo.train.peers.exchange_settings`), before compiling;
* a coordinator port already in use: exit 2 naming the port, before the job starts;
* an unwritable ``metrics.jsonl`` or ``tensorboard/``: exit 7 before compiling;
* the disk full at a TensorBoard flush or a ``metrics.jsonl`` write (the error injected at the
  write, as `test_crash_safety.fail_saves` does for checkpoints): exit 7, one paragraph, the
  checkpoints on disk intact and named.

The pieces (the settings comparison, the port probe, the loggers' probes and failures) are
also tested in-process, in milliseconds.
"""

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from test_peers import FakeStore
from test_recipes import COMMON, ROOT, TINY, sub_env
from zoo.train import cli, hooks, peers
from zoo.train.checkpoint import Checkpointer
from zoo.train.lock import LOCK_NAME

RECIPE = str(ROOT / "recipes" / "mini_mixtral.py")
BASE = ["--steps", "6", *COMMON, *TINY["mini_mixtral"], "--checkpoint-every", "2"]
ONE = [*BASE, "--devices", "1"]  # the logging faults need no mesh: the smallest compile


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process(pid, port, flags, log):
    return subprocess.Popen(
        [sys.executable, RECIPE, *BASE, "--devices", "4", "--peer-timeout", "30",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid),
         *flags], env=sub_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def run_recipe(argv, prelude=None, timeout=240):
    """The recipe in a subprocess (``prelude``: a script that injects a fault, then runs it);
    returns (exit code, stdout and stderr, seconds)."""
    cmd = [sys.executable, RECIPE] if prelude is None else [sys.executable, "-c", prelude]
    t = time.monotonic()
    proc = subprocess.run([*cmd, *argv], env=sub_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t


# -- processes that disagree -------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("flags,words", [
    ((["--steps", "6"], ["--steps", "12"]), ["--steps is 6 on process 0 but 12 on process 1"]),
    ((["--mesh", "fsdp=2,expert=2,context=2"], ["--mesh", "fsdp=4,context=2"]),
     ['--mesh is "fsdp=2,expert=2,context=2" on process 0 but "fsdp=4,context=2" on process 1',
      "mesh axes"]),
], ids=["steps", "mesh"])
def test_processes_started_with_different_settings_all_exit_2(tmp_path, flags, words):
    """Both processes exit 2 within 60 s of their start with the same paragraph, naming the
    field and both values; nothing compiled, no traceback, no checkpoint."""
    port, run_dir = free_port(), tmp_path / "run"
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    t = time.monotonic()
    procs = [process(i, port, [*flags[i], "--run-dir", str(run_dir)], logs[i]) for i in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in procs]
        took = time.monotonic() - t
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    outs = [(tmp_path / f"p{i}.log").read_text() for i in range(2)]
    print(f"both exited {codes} {took:.1f} s after they started")
    for out, code in zip(outs, codes):
        assert code == cli.EXIT_USAGE, out[-3000:]
        assert "the processes of this job were started with different settings" in out
        for w in words:
            assert w in out, (w, out[-3000:])
        assert "Traceback" not in out and "compiling the train step" not in out
    assert took < 60, f"exit 2 after {took:.0f} s"
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.e2e
def test_a_coordinator_port_in_use_exits_2_naming_it(tmp_path):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with open(tmp_path / "p0.log", "w") as log:
            proc = process(0, port, ["--run-dir", str(tmp_path / "run")], log)
            code = proc.wait(timeout=120)
    out = (tmp_path / "p0.log").read_text()
    assert code == cli.EXIT_USAGE, out[-3000:]
    assert f"--coordinator 127.0.0.1:{port}: port {port} is already in use" in out
    assert "Pass a free port in --coordinator to every process" in out
    assert "Traceback" not in out and "Failed to add port" not in out


def test_settings_differences_are_named_with_both_values():
    same = {"--steps": 6, "--mesh": "fsdp=8", "data files": "3 files, sha256 ab"}
    assert peers.settings_differences([same, dict(same)]) is None
    other = dict(same, **{"--steps": 12, "data files": "3 files, sha256 cd"})
    message = peers.settings_differences([same, dict(same), other])
    assert "--steps is 6 on process 0 but 12 on process 2" in message
    assert 'data files is "3 files, sha256 ab" on process 0 but "3 files, sha256 cd"' in message
    assert "process 1" not in message and "only --process-id differs" in message
    extra = peers.settings_differences([same, dict(same, **{"--seed": 1})])
    assert "--seed is not set on process 0 but 1 on process 1" in extra
    refused = peers.settings_differences([same, {"refused": "--mesh fsdp=3: not 8 devices"}])
    assert refused == "process 1 refused its inputs: --mesh fsdp=3: not 8 devices"


def test_job_settings_leave_out_what_is_per_process(devices):
    from zoo.train import TrainConfig, build
    built = build(TrainConfig(family="mixtral", preset="mini", batch_size=4, seq_len=32,
                              process_id=0, devices=8), with_data=False)
    settings = cli.job_settings(built)
    assert settings["--steps"] == built.config.steps and "--set" in settings
    assert settings["--mesh"] == built.config.mesh == "fsdp=2,expert=2,context=2"
    assert settings["mesh axes"] == dict(built.mesh.shape)
    assert "--process-id" not in settings and "--devices" not in settings
    assert "model config hidden_size" in settings
    json.dumps(settings, default=str)


def test_port_probe(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} is already in use"):
            peers.check_port(f"127.0.0.1:{port}")
    peers.check_port(f"127.0.0.1:{port}")  # free again (TIME_WAIT does not count)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        peers.check_port("localhost")


def test_past_the_shutdown_barrier_a_leaving_coordinator_is_no_lost_peer(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(peers.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    dog = peers.Watchdog(store, 1, 2, 10, coordinator=None)
    store.fail = True
    for t in range(12):
        clock[0] = float(t)
        dog.poll()
    assert dog.lost() == [0]
    dog.exiting = True
    assert dog.lost() == []


# -- logging faults ----------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("make,words", [
    (lambda run: (run / "metrics.jsonl").mkdir(), ["metrics.jsonl: cannot write",
                                                    "it is a folder, not a file"]),
    (lambda run: (run / "tensorboard").write_text("x"), ["TensorBoard: cannot write",
                                                          "it is not a folder",
                                                          "--no-tensorboard"]),
], ids=["metrics-a-folder", "tensorboard-a-file"])
def test_an_unwritable_log_exits_7_before_compiling(tmp_path, make, words):
    """(chmod does not stop root, so the path is made something that cannot be written.)"""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make(run_dir)
    code, out, _ = run_recipe([*ONE, "--run-dir", str(run_dir)])
    assert code == cli.EXIT_LOG, out[-3000:]
    for w in words:
        assert w in out, (w, out[-3000:])
    assert "Nothing was trained (checked before compiling)" in out
    assert "compiling the train step" not in out and "Traceback" not in out
    assert not (run_dir / LOCK_NAME).exists()
    assert not list(run_dir.glob("checkpoints/[0-9]*"))


# A full disk at the n-th TensorBoard flush, or the n-th metrics.jsonl write, then the recipe.
DISK_FULL = """
import errno, os, runpy, sys
what, n = sys.argv[1], int(sys.argv[2])
calls = [0]
def full():
    calls[0] += 1
    if calls[0] >= n:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
if what == "tensorboard":
    from tensorboardX import record_writer
    flush = record_writer.RecordWriter.flush
    def failing_flush(self):
        full()
        return flush(self)
    record_writer.RecordWriter.flush = failing_flush
else:
    write = os.write
    def failing_write(fd, data):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if name.endswith("metrics.jsonl"):
            full()
        return write(fd, data)
    os.write = failing_write
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.e2e
@pytest.mark.parametrize("what,n,saved", [("tensorboard", 2, 4), ("metrics", 1, None)],
                         ids=["tensorboard-flush-at-step-4", "metrics-before-the-first-save"])
def test_a_full_disk_while_logging_exits_7_with_the_checkpoints_intact(tmp_path, what, n,
                                                                       saved):
    """The TensorBoard flush at the checkpoint of step 4 fails: the save of step 4 (started
    just before) finishes, checkpoints 2 and 4 are intact and named; a metrics.jsonl write
    that fails at step 1 stops the run before any save, saying there is no checkpoint."""
    run_dir = tmp_path / "run"
    code, out, _ = run_recipe([what, str(n), RECIPE, *ONE, "--run-dir", str(run_dir)],
                              prelude=DISK_FULL)
    assert code == cli.EXIT_LOG, out[-3000:]
    name = "TensorBoard" if what == "tensorboard" else "metrics.jsonl"
    assert f"{name}: cannot write" in out and "no space left on the device" in out, out[-3000:]
    assert "Traceback" not in out and "Exception in thread" not in out
    ckpt = Checkpointer(run_dir / "checkpoints")
    if saved is None:
        assert "there is no checkpoint" in out and ckpt.steps() == []
    else:
        assert f"the last good checkpoint is step {saved} in {run_dir / 'checkpoints'}" in out
        assert ckpt.verified_steps() == [2, saved]
    assert "rerun the same command to resume" in out
    assert not (run_dir / LOCK_NAME).exists()


class FakeTrainer:
    def __init__(self, run_dir, step=0):
        self.run_dir, self.step = str(run_dir), step


def test_logger_probes_write_nothing(tmp_path):
    hooks.probe_file(str(tmp_path / "metrics.jsonl"))
    hooks.probe_folder(str(tmp_path / "tensorboard"))
    assert list(tmp_path.iterdir()) == []  # what a probe made, it removed
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n')
    before = os.stat(tmp_path / "metrics.jsonl")
    hooks.probe_file(str(tmp_path / "metrics.jsonl"))
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n'
    assert os.stat(tmp_path / "metrics.jsonl").st_mtime_ns == before.st_mtime_ns
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(hooks.LoggingFailed, match=r"metrics.jsonl: cannot write .*it is a folder"):
        hooks.MetricsFile(tmp_path / "run").check(FakeTrainer(tmp_path / "run"))
    (tmp_path / "run" / "tensorboard").write_text("x")
    with pytest.raises(hooks.LoggingFailed, match=r"TensorBoard: cannot write .*not a folder"):
        hooks.TensorBoard(tmp_path / "run").check(FakeTrainer(tmp_path / "run"))


def test_a_full_disk_at_a_metrics_write_or_a_tensorboard_flush(tmp_path, monkeypatch):
    trainer = FakeTrainer(tmp_path)
    metrics = hooks.MetricsFile(tmp_path)
    metrics.on_start(trainer)
    metrics.on_step(trainer, 1, {"step": 1, "loss": 2.0})

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(hooks.os, "write", full)
        with pytest.raises(hooks.LoggingFailed, match=r"metrics.jsonl: cannot write .*no space "
                                                      r"left on the device"):
            metrics.on_step(trainer, 2, {"step": 2, "loss": 1.0})
    metrics.close()
    assert [r["step"] for r in hooks.read_metrics(tmp_path)] == [1]

    board = hooks.TensorBoard(tmp_path)
    board.on_start(trainer)
    board.on_step(trainer, 1, {"step": 1, "loss": 2.0})
    from tensorboardX import record_writer
    with monkeypatch.context() as m:
        m.setattr(record_writer.RecordWriter, "flush",
                  lambda self: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
        with pytest.raises(hooks.LoggingFailed, match=r"TensorBoard: cannot write .*no space"):
            board.on_checkpoint(trainer, 1)
    board.close()  # nothing more to say
