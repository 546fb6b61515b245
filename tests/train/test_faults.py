"""First contact and faults, through the recipe's command line: a locked run dir, inputs refused
before anything runs (exit 2, one line naming the flag, the value and the fix, no traceback;
the run dir's checkpoints and metrics untouched), and divergence as a fault (exit 3, the good
checkpoint kept across a second diverging resume).

One tiny 6-step Mixtral run is the existing run every refusal is tried against, and the start
of the divergence scenario.
"""

import contextlib
import hashlib
import io
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from test_recipes import COMMON, ROOT, TINY, losses, recipe, run_main, sub_env
from zoo.train import cli, guard, validate
from zoo.train.checkpoint import Checkpointer
from zoo.train.lock import LOCK_NAME, RunDirLocked, RunLock

BASE = ["--steps", "6", *COMMON, *TINY["mini_mixtral"], "--checkpoint-every", "3"]


def snapshot(run_dir):
    """Every file's bytes (hashed) under the run dir."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pathlib.Path(run_dir).rglob("*")) if p.is_file()}


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def base(tmp_path_factory, devices):
    """A finished 6-step run (checkpoints 3 and 6), started over a stale lock of a dead pid."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    run_dir.mkdir()
    stale = dict(host=socket.gethostname(), pid=dead_pid(), started="2026-01-01T00:00:00",
                 token="old")
    (run_dir / LOCK_NAME).write_text(json.dumps(stale))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # one line of news, not a warning
        code, steps = run_main("mini_mixtral", [*BASE, "--run-dir", str(run_dir)])
    assert "taking over a stale lock from pid" in err.getvalue()
    assert code == 0 and steps == list(range(1, 7))
    assert not (run_dir / LOCK_NAME).exists()  # released at the end
    return run_dir


def recipe_main(name, argv, **kwargs):
    return recipe(name).main(list(argv), **kwargs)


def refuse(argv, capsys, code=2):
    """Run the recipe expecting a refusal; returns stderr."""
    capsys.readouterr()
    t = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        run_main("mini_mixtral", argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    assert "Traceback" not in err
    assert time.perf_counter() - t < 30  # refused before compiling
    return err


# -- the table of the issue: every bad input against an existing run ---------------------------

@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    rng = __import__("random").Random(0)
    (d / "weights.bin").write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    # no NUL byte, but mostly invalid UTF-8 (latin-1 high bytes)
    (d / "latin.txt").write_bytes(bytes(rng.randrange(0x80, 0x100) for _ in range(4096)))
    (d / "good.txt").write_text("plain text " * 100)
    (d / "notext.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n')
    (d / "notes.txt").write_text("this is not a tokenizer\n")
    (d / "blank.jsonl").write_text('{"text": ""}\n' * 50)
    # a first KiB of text, then 98% invalid UTF-8
    (d / "mostly_bad.txt").write_bytes(b"plain text " * 100 + bytes(
        rng.randrange(0x80, 0x100) if i % 50 else 0x41 for i in range(20000)))
    (d / "empty").mkdir()
    return d


@pytest.mark.parametrize("flags,words", [
    (["--lr", "-1"], ["--lr -1.0", "> 0", "3e-3"]),
    (["--lr", "inf"], ["--lr inf", "finite"]),
    (["--steps", "12", "--warmup", "50"], ["--warmup 50", "--steps 12", "lower --warmup"]),
    (["--data", "{d}/weights.bin", "{d}/latin.txt", "{d}/good.txt"],
     ["--data", "2 of 3 files are not text", "weights.bin (NUL byte", "latin.txt (",
      "not UTF-8", "leave --data out"]),
    (["--data", "{d}/notext.jsonl"], ["--data", "notext.jsonl", 'no string "text" field']),
    (["--data", "{d}/missing.txt"], ["--data", "missing.txt (does not exist)", "leave --data"]),
    (["--data", "{d}/blank.jsonl"], ["--data: no document in the 1 file(s)", "blank.jsonl",
                                     'every "text" is ""']),
    (["--data", "{d}/mostly_bad.txt"], ["--data: 1 of 1 files are not text", "mostly_bad.txt (",
                                        "are not UTF-8, more than the 10% allowed"]),
    (["--data", "{d}/empty"], ["--data", "empty (a folder with no", "leave --data out"]),
    (["--tokenizer", "{d}/notes.txt"], ["--tokenizer", "notes.txt", "cannot be loaded",
                                        "tokenizer.json"]),
    (["--tokenizer", "{d}/weights.bin"], ["--tokenizer", "weights.bin", "cannot be loaded"]),
    (["--divergence-factor", "1"], ["--divergence-factor 1.0", "> 1"]),
])
def test_bad_inputs_are_refused_and_the_run_is_untouched(base, inputs, capsys, flags, words):
    before = snapshot(base)
    flags = [f.replace("{d}", str(inputs)) for f in flags]
    err = refuse([*BASE, "--run-dir", str(base), *flags], capsys)
    for w in words:
        assert w in err, (w, err)
    assert "paths=None" not in err  # the fix names the flag, not the API
    assert snapshot(base) == before


def test_wandb_asked_for_but_not_installed(base, capsys, monkeypatch):
    from zoo.train import hooks
    monkeypatch.setattr(hooks, "wandb_available", lambda: False)  # runs with wandb installed too
    before = snapshot(base)
    err = refuse([*BASE, "--run-dir", str(base), "--wandb", "myproject"], capsys)
    assert "--wandb myproject: the wandb package is not installed" in err
    assert "pip install wandb" in err and snapshot(base) == before


def test_debug_shows_the_traceback(base, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit):
        run_main("mini_mixtral", [*BASE, "--run-dir", str(base), "--lr", "-1", "--debug"])
    err = capsys.readouterr().err
    assert "Traceback" in err and "--lr -1.0: must be a finite number > 0" in err


def test_run_dir_that_is_a_file_or_not_writable(tmp_path, capsys, devices):
    (tmp_path / "file").write_text("x")
    err = refuse([*BASE, "--run-dir", str(tmp_path / "file")], capsys)
    assert "--run-dir" in err and "is a file" in err
    err = refuse([*BASE, "--run-dir", str(tmp_path / "file" / "run")], capsys)
    assert "--run-dir" in err and "cannot be created" in err
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root writes anyway: use a read-only system folder
        locked = pathlib.Path("/sys/kernel")
        if not locked.is_dir() or (os.access(locked, os.W_OK) and _writable(locked)):
            pytest.skip("no unwritable folder available to this user")
    err = refuse([*BASE, "--run-dir", str(locked)], capsys)
    assert f"--run-dir {locked}: is not writable" in err


def _writable(folder):
    try:
        (folder / ".zoo-probe").write_text("x")
    except OSError:
        return False
    (folder / ".zoo-probe").unlink()
    return True


@pytest.mark.e2e
def test_the_script_prints_no_traceback(tmp_path, inputs):
    """The real entry point (a subprocess): one line on stderr, exit 2."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "mini_mixtral.py"), *BASE,
         "--data", str(inputs / "weights.bin"), "--run-dir", str(tmp_path / "run")],
        env=sub_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--data" in proc.stderr and "weights.bin" in proc.stderr


def test_other_data_on_a_run_dir_is_refused_before_compiling(base, inputs, capsys):
    """Rerunning on another --data in the same run dir: exit 2 within seconds, the differing
    pipeline arguments named, nothing compiled and nothing written."""
    before = snapshot(base)
    capsys.readouterr()
    t = time.perf_counter()
    code, steps = run_main("mini_mixtral", [*BASE, "--steps", "8", "--run-dir", str(base),
                                            "--data", str(inputs / "good.txt")])
    took = time.perf_counter() - t
    err = capsys.readouterr().err
    assert code == 2 and steps == [], err
    assert took < 10, took
    assert "data-pipeline state saved with other arguments" in err and "paths:" in err
    assert "compiling the train step" not in err and "Traceback" not in err
    assert snapshot(base) == before


def test_data_that_vanishes_mid_run_stops_cleanly(tmp_path, devices, capsys):
    """The --data folder deleted during the run: exit 4 (not a traceback, not a hang), the
    state reached saved, and a rerun on restored files resumes from it."""
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 80)
    run_dir = tmp_path / "run"

    def vanish(step, row):
        if step == 2:
            shutil.rmtree(text)

    capsys.readouterr()
    with contextlib.redirect_stdout(io.StringIO()):
        code = recipe_main("mini_mixtral", [*BASE, "--steps", "20", "--data", str(text),
                                            "--run-dir", str(run_dir)], on_step=vanish)
    err = capsys.readouterr().err
    assert code == cli.EXIT_DATA, err[-3000:]
    assert f"the data file {text / 'a.txt'} vanished during the run" in err
    assert "Traceback" not in err
    saved = Checkpointer(run_dir / "checkpoints").steps()
    assert saved and saved[-1] >= 2
    assert f"the last good checkpoint is step {saved[-1]}" in err


@pytest.mark.slow
def test_a_failed_save_exits_5_and_the_rerun_resumes(base, tmp_path, capsys, monkeypatch):
    """The disk fills at the save of step 4 (a fault injected at Orbax's write): exit 5 with
    one paragraph naming the error, checkpoint 2 and how to resume, no traceback; the rerun
    resumes from 2 and gives the losses of the straight run (`base`)."""
    from test_crash_safety import fail_saves
    run_dir = tmp_path / "run"
    argv = [*BASE, "--checkpoint-every", "2", "--run-dir", str(run_dir)]
    with monkeypatch.context() as m:
        fail_saves(m, {4}, delay_s=2.0)  # the other items written: no writer outlives it
        capsys.readouterr()
        code, steps = run_main("mini_mixtral", argv)
    err = capsys.readouterr().err
    assert code == cli.EXIT_SAVE, err[-3000:]
    assert "saving the checkpoint of step 4 failed: no space left on the device" in err
    assert f"the last good checkpoint is step 2 in {run_dir / 'checkpoints'}" in err
    assert "rerun the same command to resume" in err and "Traceback" not in err
    assert steps[-1] < 6 or steps == list(range(1, 7))
    assert not (run_dir / LOCK_NAME).exists()
    code, steps = run_main("mini_mixtral", argv)
    assert code == 0 and steps == [3, 4, 5, 6]
    np.testing.assert_allclose(losses(run_dir)[1], losses(base)[1], rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
def test_a_signal_during_the_compile_exits_promptly(tmp_path):
    """SIGTERM while the train step compiles: a line saying nothing was trained, exit 0 within
    seconds, the lock released, no checkpoint written."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "recipes" / "mini_mixtral.py"), *BASE, "--run-dir",
         str(run_dir)], env=sub_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=ROOT)
    try:
        seen = ""
        while "compiling the train step" not in seen:
            line = proc.stdout.readline()
            assert line, seen[-3000:]
            seen += line
        proc.send_signal(signal.SIGTERM)
        t = time.perf_counter()
        out = seen + proc.communicate(timeout=60)[0]
        took = time.perf_counter() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert took < 15, took
    assert "SIGTERM during the compile: nothing was trained or saved" in out
    assert "Traceback" not in out
    assert not (run_dir / LOCK_NAME).exists()
    assert not list((run_dir / "checkpoints").glob("[0-9]*"))


# -- the lock ----------------------------------------------------------------------------------

@pytest.mark.e2e
def test_second_run_on_a_run_dir_is_refused_at_once(tmp_path, capsys, base):
    """A run in a subprocess holds the dir; a second one (here, in-process) is refused within
    5 s naming the holder; the first finishes with each metric row once."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "recipes" / "mini_mixtral.py"), *BASE, "--steps", "40",
         "--checkpoint-every", "100", "--run-dir", str(run_dir)],
        env=sub_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        deadline = time.time() + 120
        while not (run_dir / LOCK_NAME).exists() and first.poll() is None:
            assert time.time() < deadline
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[0][-3000:]
        t = time.perf_counter()
        err = refuse([*BASE, "--run-dir", str(run_dir)], capsys)
        assert time.perf_counter() - t < 5
        assert f"--run-dir {run_dir} is in use by another run: pid {first.pid}" in err
        assert socket.gethostname() in err and "pass another --run-dir" in err
        out = first.communicate(timeout=300)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-3000:]
    steps, _ = losses(run_dir)
    assert steps == list(range(1, 41))
    assert not (run_dir / LOCK_NAME).exists()


def test_lock_from_another_host_is_never_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps(dict(host="elsewhere", pid=dead_pid(),
                                                      started="then")))
    with pytest.raises(RunDirLocked, match=r"in use by another run: pid \d+ on host elsewhere"):
        RunLock(tmp_path).acquire()
    (tmp_path / "free").mkdir()
    with RunLock(tmp_path / "free") as lock:  # a free dir: taken, then released
        assert json.loads(pathlib.Path(lock.path).read_text())["pid"] == os.getpid()
    assert not os.path.exists(lock.path)


# -- divergence --------------------------------------------------------------------------------

def test_divergence_stops_and_keeps_the_good_checkpoint(tmp_path, base, capsys):
    """A huge lr after the good run: exit 3, and checkpoint 6 (the last good) survives two
    diverging resumes byte for byte; the suspect checkpoint is set aside, not resumed."""
    run_dir = tmp_path / "run"
    shutil.copytree(base, run_dir)
    good = {k: v for k, v in snapshot(run_dir).items() if k.startswith("checkpoints/6/")}
    argv = [*BASE, "--steps", "40", "--lr", "10", "--checkpoint-every", "1",
            "--run-dir", str(run_dir)]
    for attempt in range(2):
        capsys.readouterr()
        code, steps = run_main("mini_mixtral", argv)
        err = capsys.readouterr().err
        assert code == cli.EXIT_DIVERGED, err[-2000:]
        assert "training diverged" in err and "the last good checkpoint is step 6" in err
        assert "Traceback" not in err
        assert steps[0] == 7 and len(steps) <= 7 + guard.PATIENCE
        assert Checkpointer(run_dir / "checkpoints").steps() == [3, 6], attempt
        now = snapshot(run_dir)
        assert {k: v for k, v in now.items() if k.startswith("checkpoints/6/")} == good
        assert any(k.startswith("checkpoints/diverged-7/") for k in now)


def test_divergence_monitor_rule():
    m = guard.DivergenceMonitor(5.0, window=4, patience=3, history=[3.0, 2.0])
    for step, loss in enumerate([2.5, 11.0, 12.0, 9.0, 2.0], 1):  # rises, recovers
        m.update(step, loss)
        assert m.rising == (step in (2, 3)) and not m.diverged
    for step in (6, 7, 8):
        m.update(step, 100.0)
    assert m.diverged and m.first_rise == 6 and m.bound == pytest.approx(10.0)
    assert "above 5 x the best of the last 4 steps (10)" in m.message(8)
    never = guard.DivergenceMonitor(float("inf"), history=[1.0])
    never.update(1, 1e30)
    assert not never.rising


def test_text_sniffing(tmp_path, inputs):
    assert validate.sniff_text(str(inputs / "good.txt")) is None
    assert "NUL" in validate.sniff_text(str(inputs / "weights.bin"))
    # a multi-byte character cut by the 1 KiB window is not an error; scattered bad bytes are
    (tmp_path / "cut.txt").write_bytes(b"a" * 1023 + "é".encode() + b"b" * 10)
    assert validate.sniff_text(str(tmp_path / "cut.txt")) is None
    (tmp_path / "bad.txt").write_bytes(b"a" * 900 + b"\xff" * 20)
    assert "20 of the first 920 bytes" in validate.sniff_text(str(tmp_path / "bad.txt"))


def test_large_files_are_sampled_past_their_head(tmp_path):
    """A file whose head is text but whose body is not: refused from samples of the body;
    a few stray bytes in a large text file are not."""
    big = tmp_path / "big.txt"
    body = bytearray(b"text " * 400_000)  # 2 MB: sampled in windows
    big.write_bytes(bytes(body))
    assert validate.sniff_text(str(big)) is None
    for i in range(2000, len(body), 7):
        body[i] = 0xFF
    big.write_bytes(bytes(body))
    assert "more than the 10% allowed" in validate.sniff_text(str(big))
    body = bytearray(b"text " * 400_000)
    body[500_000:500_010] = b"\xff" * 10
    big.write_bytes(bytes(body))
    assert validate.sniff_text(str(big)) is None


def test_a_corpus_smaller_than_one_batch_is_warned_about(tmp_path):
    (tmp_path / "tiny.txt").write_text("hello")
    with pytest.warns(UserWarning, match=r"holds 5 bytes, fewer than one batch's 4 x 32 = 128"):
        validate.warn_small_corpus([str(tmp_path / "tiny.txt")], 4, 32)
    (tmp_path / "ok.txt").write_text("x" * 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate.warn_small_corpus([str(tmp_path / "ok.txt")], 4, 32)
        validate.warn_small_corpus(None, 4, 32)  # the built-in corpus


def test_stop_agreement_reduces_on_the_devices(devices):
    """The stop flag's reduction over every device of the mesh (one process here: its flag)."""
    import jax

    import zoo
    agree = guard.StopAgreement(zoo.make_mesh(fsdp=2, expert=2, context=2))
    assert agree.shape == (8,) and len(agree.sharding.addressable_devices) == 8
    assert int(jax.device_get(agree(True))) == 1 and int(jax.device_get(agree(False))) == 0


# -- --from-hf ---------------------------------------------------------------------------------

def test_from_hf_with_a_transposed_tensor_exits_2_before_compiling(tmp_path, capsys, devices):
    """A checkpoint whose embedding is transposed (same size): refused in seconds, one line
    naming the key, the checkpoint's shape and the expected one; nothing compiled."""
    from flax import nnx
    from safetensors.numpy import load_file, save_file

    from zoo.models.mixtral import Mixtral, MixtralConfig, to_hf
    overrides = TINY["mini_mixtral"][1::2]
    config = cli.apply_overrides(MixtralConfig.mini(), overrides)
    to_hf(Mixtral(config, inputs_shape=(4, 32), rngs=nnx.Rngs(0)), tmp_path / "hf")
    name = str(tmp_path / "hf" / "model.safetensors")
    tensors = load_file(name)
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = np.ascontiguousarray(embed.T)
    save_file(tensors, name)
    err = refuse([*BASE, "--from-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run")],
                 capsys)
    want = f"model.embed_tokens.weight: checkpoint {embed.shape[::-1]}, expected {embed.shape}"
    assert want in err and f"--from-hf {tmp_path / 'hf'}" in err
    assert "compiling the train step" not in err
