"""What a crash or a fault leaves behind is never a reason to refuse a resume, and what was
written is never lost: a damaged ``metrics.jsonl`` or ``run.json`` is repaired with the
damaged lines set aside; an updated state that turns NaN (DeepSeek-V3's expert bias) stops
the run before it is saved; a checkpoint save that fails stops the run at that save.

In-process `Trainer` runs of a tiny Mixtral/DeepSeek-V3 (CPU, 8 devices).
"""

import errno
import json
import os
import time
import warnings

import numpy as np
import optax
import pytest

from zoo.train import TrainConfig, Trainer, read_metrics
from zoo.train.hooks import OnStep
from zoo.train.hooks import repair_metrics
from zoo.train.records import write_json

TINY = ("num_hidden_layers=1", "hidden_size=32", "intermediate_size=32",
        "num_attention_heads=4", "head_dim=8")
BASE = dict(family="mixtral", preset="mini", overrides=TINY, batch_size=4, seq_len=32,
            progress=False)


def train(run_dir, steps, **kwargs):
    settings = {**BASE, **kwargs, "steps": steps, "run_dir": str(run_dir)}
    with Trainer(TrainConfig(**settings)) as t:
        return t.train()


# -- metrics.jsonl and run.json ----------------------------------------------------------------

def test_repair_metrics_keeps_good_rows_and_sets_damaged_lines_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps(dict(step=s, loss=1.0 / s)).encode() for s in range(1, 6)]
    path.write_bytes(b"\n".join([good[0], b"garbage{{", good[1], b"\xff\xfe{}", good[2],
                                 b"[1, 2]", good[3], good[4], b'{"step": 6, "lo']))
    with pytest.warns(UserWarning, match=r"4 damaged line\(s\) \(line 2, 4, 6, 9\) moved to "
                                         r".*metrics.jsonl.corrupt"):
        assert repair_metrics(str(path), 4) == [2, 4, 6, 9]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]  # step 5 is redone
    assert path.read_bytes().endswith(b"\n")
    corrupt = (tmp_path / "metrics.jsonl.corrupt").read_bytes().split(b"\n")
    assert corrupt == [b"garbage{{", b"\xff\xfe{}", b"[1, 2]", b'{"step": 6, "lo', b""]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean file: nothing to say, nothing rewritten
        assert repair_metrics(str(path), 4) == []


def test_a_damaged_run_json_is_set_aside(tmp_path):
    path = tmp_path / "run.json"
    path.write_bytes(b'{"config": {"st')
    with pytest.warns(UserWarning, match="run.json was damaged.*moved it to .*run.json.corrupt"):
        write_json(str(path), {"a": (1, 2)})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert (tmp_path / "run.json.corrupt").read_bytes() == b'{"config": {"st'
    assert not (tmp_path / "run.json.tmp").exists()


@pytest.mark.slow
def test_a_garbage_metrics_line_does_not_block_the_resume(tmp_path, devices):
    """The issue's repro: 20 steps (checkpoints at 10 and 20), a garbage line appended, then
    the run resumed to 30: it finishes with 30 rows, the garbage kept aside."""
    train(tmp_path, 20, checkpoint_every=10)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("garbage{{\n")
    with pytest.warns(UserWarning, match="1 damaged line"):
        summary = train(tmp_path, 30, checkpoint_every=10)
    assert (summary.start_step, summary.step) == (20, 30)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 31))
    assert (tmp_path / "metrics.jsonl.corrupt").read_text() == "garbage{{\n"
    assert np.all(np.isfinite([r["loss"] for r in read_metrics(tmp_path)]))


# -- the NaN guard and the expert bias ---------------------------------------------------------

DEEPSEEK = dict(family="deepseek3", preset="mini", batch_size=4, seq_len=32, progress=False,
                overrides=("num_hidden_layers=2", "hidden_size=32", "intermediate_size=64",
                           "moe_intermediate_size=16", "kv_lora_rank=16", "q_lora_rank=16",
                           "qk_rope_head_dim=8", "qk_nope_head_dim=8", "v_head_dim=8"))


def nan_bias_rate(config):
    """`build(config)` with its train step updating the expert bias at rate NaN (what
    ``--expert-bias-rate nan`` did before the flags refused it)."""
    from zoo.train import build
    from zoo.train import step as step_lib
    built = build(config)
    built.train_step = step_lib.make_train_step(aux_loss_weight=built.config.aux_loss_weight,
                                                expert_bias_rate=float("nan"))
    return built


@pytest.mark.slow
def test_a_nan_expert_bias_stops_the_run_before_it_is_saved(tmp_path, devices):
    """DeepSeek-V3's bias updated at a NaN rate (flag validation bypassed): the loss stays
    finite, but the guard sees the bias, stops at the first step, saves nothing from it and
    names the checkpoint on disk."""
    from zoo.train.checkpoint import Checkpointer
    from zoo.train.trainer import TrainingDiverged
    train(tmp_path, 2, **DEEPSEEK, checkpoint_every=1)
    config = TrainConfig(**DEEPSEEK, steps=6, checkpoint_every=1, run_dir=str(tmp_path))
    with pytest.raises(TrainingDiverged) as e, Trainer(nan_bias_rate(config)) as t:
        t.train()
    message = str(e.value)
    assert "step 3: the updated state" in message and "e_score_correction_bias" in message
    assert "NaN/Inf value(s)" in message
    assert f"the last good checkpoint is step 2 in {tmp_path / 'checkpoints'}" in message
    assert Checkpointer(tmp_path / "checkpoints").steps() == [1, 2]


@pytest.mark.slow
def test_the_divergence_message_says_when_there_is_no_checkpoint(tmp_path, devices):
    from zoo.train.trainer import TrainingDiverged
    config = TrainConfig(**DEEPSEEK, steps=3, checkpoint_every=1, run_dir=str(tmp_path))
    with pytest.raises(TrainingDiverged, match="there is no checkpoint to resume from in"), \
            Trainer(nan_bias_rate(config)) as t:
        t.train()
    assert not list((tmp_path / "checkpoints").glob("[0-9]*"))


# -- failed saves ------------------------------------------------------------------------------

def fail_saves(monkeypatch, steps, error=errno.ENOSPC, delay_s=0.0):
    """Orbax's write of the ``config`` item of checkpoints `steps` raises OSError(`error`)
    (a full disk, a read-only file system) after `delay_s` seconds. Orbax reports the first
    item that fails while the others may still be writing; in a process that goes on (a test
    resuming in-process) a delay lets them finish, as a real process exit would stop them."""
    import orbax.checkpoint as ocp
    real = ocp.JsonCheckpointHandler._save_fn

    async def write(self, x, directory):
        step = int(os.path.basename(os.path.dirname(str(directory))).split(".")[0])
        if step in steps:
            time.sleep(delay_s)
            raise OSError(error, os.strerror(error), str(directory))
        return await real(self, x, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", write)


def tiny_state():
    from flax import nnx
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.mark.parametrize("error,words", [(errno.ENOSPC, "no space left on the device"),
                                         (errno.EROFS, "the file system is read-only"),
                                         (errno.EACCES, "permission denied")])
def test_a_failed_save_is_named_with_the_last_good_checkpoint(tmp_path, monkeypatch, caplog,
                                                              error, words):
    from zoo.train.checkpoint import Checkpointer, CheckpointSaveFailed
    fail_saves(monkeypatch, {2}, error)
    ckpt = Checkpointer(tmp_path)
    model, optimizer = tiny_state()
    ckpt.save(1, model, optimizer, data_state={}, config={})
    ckpt.save(2, model, optimizer, data_state={}, config={})
    with pytest.raises(CheckpointSaveFailed) as e:
        ckpt.wait()
    message = str(e.value)
    assert f"saving the checkpoint of step 2 failed: {words}" in message
    assert f"the last good checkpoint is step 1 in {tmp_path}" in message
    assert "rerun the same command to resume" in message
    logged = [r for r in caplog.records if "orbax" in r.pathname and r.levelname == "ERROR"]
    assert logged and not any(r.exc_info for r in logged)  # Orbax's tracebacks left out
    with pytest.raises(CheckpointSaveFailed):  # no later save starts after a failed one
        ckpt.save(3, model, optimizer, data_state={}, config={})
    t = time.perf_counter()
    ckpt.close()  # does not raise again, does not hang
    assert time.perf_counter() - t < 15
    assert Checkpointer(tmp_path).steps_on_disk() == [1]


def test_a_save_that_hangs_is_bounded(tmp_path, monkeypatch):
    from zoo.train.checkpoint import Checkpointer, CheckpointSaveFailed
    fail_saves(monkeypatch, {1}, delay_s=3.0)
    ckpt = Checkpointer(tmp_path, save_timeout_s=0.5)
    model, optimizer = tiny_state()
    ckpt.save(1, model, optimizer, data_state={}, config={})
    ckpt.check()  # still going: no verdict yet
    with pytest.raises(CheckpointSaveFailed, match=r"step 1 failed: it did not finish within "
                                                   r"0.5 s.*there is no checkpoint in"):
        ckpt.wait()
    ckpt.close()


@pytest.mark.slow
def test_a_failed_save_stops_the_run_at_that_save(tmp_path, monkeypatch, devices):
    """The save of step 10 fails (a full disk): the run stops at a step after it, and before
    the next save (step 15) starts, with CheckpointSaveFailed naming checkpoint 5; rerun with
    space again, it resumes from 5 and its losses equal a straight run's."""
    from zoo.train.trainer import CheckpointSaveFailed
    straight = train(tmp_path / "straight", 20, checkpoint_every=5)
    assert straight.step == 20
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        fail_saves(m, {10}, delay_s=2.0)  # the other items written: no writer outlives it
        seen = []
        config = TrainConfig(**BASE, steps=20, checkpoint_every=5, run_dir=str(run_dir))
        with pytest.raises(CheckpointSaveFailed) as e, \
                Trainer(config, hooks=[OnStep(lambda s, row: seen.append(s))]) as t:
            t.train()
    assert "saving the checkpoint of step 10 failed: no space left on the device" in str(e.value)
    assert f"the last good checkpoint is step 5 in {run_dir / 'checkpoints'}" in str(e.value)
    assert 10 <= seen[-1] <= 15, seen  # found at a step after it, at the latest at save 15
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == ["5"]
    summary = train(run_dir, 20, checkpoint_every=5)
    assert (summary.start_step, summary.step) == (5, 20)
    got = [r["loss"] for r in read_metrics(run_dir)]
    want = [r["loss"] for r in read_metrics(tmp_path / "straight")]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- resuming on changed data ------------------------------------------------------------------

@pytest.mark.slow
def test_a_changed_corpus_is_refused_unless_restarted(tmp_path, devices):
    """Resuming on other --data: refused naming --data-changed restart; with it, the weights
    and optimizer come back (the step count goes on), the stream restarts on the new files,
    and run.json records the restart."""
    from zoo.data import PipelineStateMismatch
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    (tmp_path / "b.txt").write_text("pack my box with five dozen liquor jugs. " * 60)
    run_dir = tmp_path / "run"
    train(run_dir, 4, checkpoint_every=2, data=(str(tmp_path / "a.txt"),))
    with pytest.raises(PipelineStateMismatch, match="pass --data-changed restart"):
        train(run_dir, 8, checkpoint_every=2, data=(str(tmp_path / "b.txt"),))
    config = TrainConfig(**BASE, steps=8, checkpoint_every=2, run_dir=str(run_dir),
                         data=(str(tmp_path / "b.txt"),), data_changed="restart")
    with Trainer(config) as t:
        summary = t.train()
        assert int(t.optimizer.step[...]) == 8  # Adam's count went on from the checkpoint
    assert (summary.start_step, summary.step) == (4, 8)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 9))
    restarts = json.loads((run_dir / "run.json").read_text())["data_restarts"]
    assert len(restarts) == 1 and restarts[0]["step"] == 4
    assert any("b.txt" in c for c in restarts[0]["changes"])
    # the checkpoints now hold the new data's stream: a plain resume on it needs no flag
    summary = train(run_dir, 10, checkpoint_every=2, data=(str(tmp_path / "b.txt"),))
    assert (summary.start_step, summary.step) == (8, 10)
    assert len(json.loads((run_dir / "run.json").read_text())["data_restarts"]) == 1
