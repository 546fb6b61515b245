"""Checkpoints prove their integrity, and readers never write.

* Each saved step holds a digest record (``zoo-digests.json``: every file's size and SHA-256);
  same-size bit rot in a data file makes the step corrupt: the trainer moves it aside and
  resumes from the previous verified step, generation and evaluation skip it, each saying so;
  the guards name only verified steps.
* A reader (`Checkpointer(read_only=True)`, `zoo.train.load`, ``python -m zoo.generate --run``,
  ``python -m zoo.evaluate --run``) creates, cleans up and moves nothing: a live trainer's
  in-flight ``*.orbax-checkpoint-tmp*`` folder is left byte for byte, and a trainer finishes
  while a generation and an evaluation read its run dir.
"""

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from etils import epath
from flax import nnx

from test_crash_safety import tiny_state
from test_faults import snapshot
from test_recipes import COMMON, ROOT, TINY, run_main, sub_env
from zoo.train import guard
from zoo.train.checkpoint import DIGESTS, Checkpointer, check_digests

TINY_RUN = ["--batch-size", "4", "--seq-len", "32", *TINY["mini_mixtral"]]


def flip_a_byte(step_dir):
    """Same-size bit rot: one bit of the largest file of the step's ``state`` item flipped."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs]
    path = max(files, key=os.path.getsize)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    assert os.path.getsize(path) == size
    return os.path.relpath(path, step_dir)


def saved_steps(directory, steps=(1, 2)):
    """Checkpoints of a tiny Linear + SGD state at `steps`, each of other weights; returns the
    kernels saved (the reference a restore is compared with)."""
    model, optimizer = tiny_state()
    ckpt = Checkpointer(directory)
    kernels = {}
    for step in steps:
        model.kernel[...] = model.kernel[...] + step
        kernels[step] = np.asarray(model.kernel[...])
        ckpt.save(step, model, optimizer, data_state={"next": step}, config={"step": step})
    ckpt.close()
    return kernels


def restore(directory, **kwargs):
    model, optimizer = tiny_state()
    ckpt = Checkpointer(directory, **kwargs)
    try:
        return ckpt.restore(model, optimizer), ckpt
    finally:
        ckpt.close()


# -- the digest record -------------------------------------------------------------------------

def test_same_size_bit_rot_is_found_and_the_previous_step_restored(tmp_path):
    kernels = saved_steps(tmp_path)
    for step in (1, 2):
        assert (tmp_path / str(step) / DIGESTS).is_file()
        assert check_digests(tmp_path / str(step)) is None
    rotten = flip_a_byte(tmp_path / "2")
    assert rotten in check_digests(tmp_path / "2") and "same size" in check_digests(tmp_path / "2")

    # a reader: falls back, says so, touches nothing
    before = snapshot(tmp_path)
    with pytest.warns(UserWarning, match=r"2 cannot be read \(its files differ from the digests "
                                         r"recorded when it was saved: .*same size"):
        got, reader = restore(tmp_path, read_only=True)
    assert got.step == 1 and got.data == {"next": 1}
    np.testing.assert_array_equal(np.asarray(got.model.kernel[...]), kernels[1])
    assert snapshot(tmp_path) == before
    assert reader.verified_steps() == [1]
    assert reader.intact(1) and not reader.intact(2)

    # the writer: moves it aside, and its messages name the verified step only
    with pytest.warns(UserWarning, match="moving it to corrupt-2"):
        got, writer = restore(tmp_path)
    assert got.step == 1
    assert sorted(os.listdir(tmp_path)) == ["1", "corrupt-2"]
    assert guard.last_checkpoint(writer) == f"the last good checkpoint is step 1 in {tmp_path}"


def test_a_step_without_its_record(tmp_path):
    """Stopped between Orbax's rename and the record: the older verified step is used (the
    unrecorded one set aside); with no record at all (an older run) the newest is read."""
    kernels = saved_steps(tmp_path / "a", steps=(1, 2, 3))
    os.remove(tmp_path / "a" / "3" / DIGESTS)
    ckpt = Checkpointer(tmp_path / "a")
    assert ckpt.verified_steps() == [1, 2]
    assert guard.last_checkpoint(ckpt) == f"the last good checkpoint is step 2 in {ckpt.directory}"
    assert guard.last_good(ckpt, first_rise=10) == 2
    assert ckpt.intact(2) and not ckpt.intact(3)
    ckpt.close()
    with pytest.warns(UserWarning, match="3 has no digest record .* moving it to unverified-3"):
        got, _ = restore(tmp_path / "a")
    assert got.step == 2
    np.testing.assert_array_equal(np.asarray(got.model.kernel[...]), kernels[2])
    assert sorted(os.listdir(tmp_path / "a")) == ["1", "2", "unverified-3"]

    saved_steps(tmp_path / "b")
    for step in (1, 2):
        os.remove(tmp_path / "b" / str(step) / DIGESTS)
    with pytest.warns(UserWarning, match="2 has no digest record .* reading it unverified"):
        got, ckpt = restore(tmp_path / "b")
    assert got.step == 2 and ckpt.intact(2)
    assert "step 2" in guard.last_checkpoint(ckpt) and "unverified" in guard.last_checkpoint(ckpt)


# -- readers never write -----------------------------------------------------------------------

def in_flight(directory, step):
    """A trainer's save in flight: Orbax's temporary folder of `step`, partly written."""
    tmp = directory / f"{step}.orbax-checkpoint-tmp-1234567"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "_METADATA").write_text("{}")
    (tmp / "state" / "d").write_bytes(os.urandom(512))
    return tmp


def test_a_reader_creates_cleans_and_moves_nothing(tmp_path):
    saved_steps(tmp_path / "ck")
    in_flight(tmp_path / "ck", 3)
    flip_a_byte(tmp_path / "ck" / "2")
    before = snapshot(tmp_path)
    dirs = sorted(p for p in tmp_path.rglob("*") if p.is_dir())
    with pytest.warns(UserWarning, match="2 cannot be read"):
        got, reader = restore(tmp_path / "ck", read_only=True)
    assert got.step == 1
    model, optimizer = tiny_state()
    with pytest.raises(RuntimeError, match="read-only; a reader never saves"):
        reader.save(4, model, optimizer, data_state={}, config={})
    assert snapshot(tmp_path) == before
    assert sorted(p for p in tmp_path.rglob("*") if p.is_dir()) == dirs
    # a run dir without checkpoints/ stays without it
    assert restore(tmp_path / "none", read_only=True)[0] is None
    assert not (tmp_path / "none").exists()



def test_a_reader_lists_while_a_trainer_rotates_a_step_out(tmp_path, monkeypatch):
    """The oldest step is being deleted by a live trainer's rotation while a reader lists the
    folder: its metadata file is already gone, so Orbax looks at the folder's time, and the
    folder is gone by then. The reader lists again and restores the newest step."""
    kernels = saved_steps(tmp_path / "ck", steps=(1, 2, 3))
    oldest = tmp_path / "ck" / "1"
    metadata = [p for p in oldest.iterdir() if p.is_file() and "METADATA" in p.name.upper()]
    assert metadata, sorted(p.name for p in oldest.iterdir())
    for p in metadata:
        p.unlink()  # the rotation's rmtree has begun
    stat, rotated = epath.gpath.PosixGPath.stat, []

    def racing_stat(path):
        if os.fspath(path) == str(oldest) and not rotated:
            rotated.append(path)
            shutil.rmtree(oldest)  # ... and ends right here
        return stat(path)

    monkeypatch.setattr(epath.gpath.PosixGPath, "stat", racing_stat)
    got, _ = restore(tmp_path / "ck", read_only=True)
    assert rotated and got.step == 3
    np.testing.assert_array_equal(np.asarray(got.model.kernel[...]), kernels[3])


# -- through the command lines -----------------------------------------------------------------

RUN = ["--steps", "2", "--checkpoint-every", "1", *COMMON, *TINY["mini_mixtral"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory, devices):
    """A finished 2-step tiny Mixtral run, a checkpoint at each step."""
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    code, steps = run_main("mini_mixtral", [*RUN, "--run-dir", str(run_dir)])
    assert code == 0 and steps == [1, 2]
    return run_dir


def evaluate(argv, capsys):
    from zoo.evaluate import main
    capsys.readouterr()
    assert main([*argv, "--batches", "1"]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return out.out.strip().splitlines()[-1]


@pytest.mark.slow
def test_readers_and_the_resume_fall_back_from_a_rotten_step(run, tmp_path, capsys):
    """Same-size bit rot in step 2: `load`, evaluation and generation read step 1 (its
    weights equal the intact run's step 1), saying so, and change nothing -- an in-flight save
    beside them included; rerun, the finished run is not taken as done: step 2 is moved aside
    and trained again from step 1."""
    from zoo.generate import main as generate
    from zoo.train import load
    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir)
    rotten = flip_a_byte(run_dir / "checkpoints" / "2")
    in_flight(run_dir / "checkpoints", 3)
    before, dirs = snapshot(run_dir), sorted(p for p in run_dir.rglob("*") if p.is_dir())
    with pytest.warns(UserWarning, match=rf"2 cannot be read \(.*{re.escape(rotten)}.*same size"):
        loaded = load(run_dir)
    want = load(run, step=1)  # the intact run's step 1
    assert loaded.step == 1
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(loaded.model)),
                 nnx.to_pure_dict(nnx.state(want.model)))
    with pytest.warns(UserWarning, match=rf"2 cannot be read \(.*{re.escape(rotten)}.*same size"):
        assert evaluate(["--run", str(run_dir)], capsys).startswith("step 1: eval_loss")
    with pytest.warns(UserWarning, match=rf"2 cannot be read \(.*{re.escape(rotten)}.*same size"), \
            contextlib.redirect_stdout(io.StringIO()) as out:
        assert generate(["--run", str(run_dir), "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    assert out.getvalue().startswith("ab")
    assert snapshot(run_dir) == before
    assert sorted(p for p in run_dir.rglob("*") if p.is_dir()) == dirs

    # nothing good left, or a step that is not there: exit 2, one line
    from zoo.evaluate import main
    shutil.copytree(run_dir, tmp_path / "bad")
    flip_a_byte(tmp_path / "bad" / "checkpoints" / "1")
    for argv, words in (([], "no checkpoint can be read in"),
                        (["--step", "7"], "holds no checkpoint of step 7; its checkpoints are "
                                          "steps [1, 2]")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e, pytest.warns(UserWarning) if not argv else \
                contextlib.nullcontext():
            main(["--run", str(tmp_path / "bad"), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and "Traceback" not in err, err

    shutil.rmtree(run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-1234567")
    capsys.readouterr()
    with pytest.warns(UserWarning, match="2 cannot be read .* moving it to corrupt-2"):
        code, steps = run_main("mini_mixtral", [*RUN, "--run-dir", str(run_dir)])  # not done
    err = capsys.readouterr().err
    assert code == 0 and steps == [2], err[-3000:]
    assert "resuming from step 1" in err and "Traceback" not in err
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2", "corrupt-2"]
    assert Checkpointer(run_dir / "checkpoints", read_only=True).verified_steps() == [1, 2]


# A recipe run that keeps saving (a checkpoint every step, paced) until the readers are done,
# then finishes: it waits at its second-to-last step for the file `done`.
DRIVER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("recipe", sys.argv[1])
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)
done, last = sys.argv[2], int(sys.argv[3])

def pace(step, row):
    deadline = time.time() + 240
    while step >= last - 1 and not os.path.exists(done) and time.time() < deadline:
        time.sleep(0.1)
    if not os.path.exists(done):
        time.sleep(0.2)

sys.exit(recipe.main(sys.argv[4:], on_step=pace))
"""


@pytest.mark.e2e
def test_a_trainer_finishes_while_generation_and_evaluation_read_it(tmp_path):
    run_dir, done, steps = tmp_path / "run", tmp_path / "readers-done", 40
    trainer = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(ROOT / "recipes" / "mini_mixtral.py"), str(done),
         str(steps), *RUN, "--steps", str(steps), "--run-dir", str(run_dir)],
        env=sub_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    readers = []
    try:
        deadline = time.time() + 300
        while not (run_dir / "checkpoints" / "1" / DIGESTS).exists():
            assert trainer.poll() is None and time.time() < deadline, trainer.communicate()[0]
            time.sleep(0.1)
        readers = [subprocess.Popen(
            [sys.executable, "-m", *argv, "--run", str(run_dir)], env=sub_env(), cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in (
                ["zoo.generate", "--prompt", "ab", "--max-new-tokens", "2"],
                ["zoo.evaluate", "--batches", "1"])]
        outs = [r.communicate(timeout=300) for r in readers]
        assert trainer.poll() is None, trainer.communicate()[0][-3000:]  # a live run read
        done.touch()
        log = trainer.communicate(timeout=300)[0]
    finally:
        for proc in (trainer, *readers):
            if proc.poll() is None:
                proc.kill()
    assert trainer.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "failed" not in log
    for reader, (_, err) in zip(readers, outs):
        assert reader.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    assert outs[0][0].startswith("ab")
    assert outs[1][0].strip().splitlines()[-1].startswith("step ")
    assert Checkpointer(run_dir / "checkpoints", read_only=True).verified_steps()[-1] == steps
