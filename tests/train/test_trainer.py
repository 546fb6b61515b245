"""The programmatic training path: `zoo.train.build`, the `Trainer` and its hooks, `load`.

A tiny Mixtral trained from code with a custom optax optimizer and its schedule: the schedule's
rate is what metrics.jsonl logs; train(steps=3) then a new Trainer resumes to the planned 6 and
equals a straight run; a hook stops a run with a checkpoint; `load` gives the trained weights
back on another mesh; TensorBoard events hold the same losses as metrics.jsonl.
"""

import dataclasses
import json
import statistics
import struct

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from zoo.train import Hook, TrainConfig, Trainer, build, load, read_metrics

TINY = ("num_hidden_layers=1", "hidden_size=32", "intermediate_size=32",
        "num_attention_heads=4", "head_dim=8")
BASE = dict(family="mixtral", preset="mini", overrides=TINY, steps=6, batch_size=4, seq_len=32,
            checkpoint_every=50, progress=False)
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 6)


def _trainer(run_dir, **kwargs):
    return Trainer(TrainConfig(**BASE, run_dir=str(run_dir)), tx=optax.adamw(SCHEDULE),
                   schedule=SCHEDULE, **kwargs)


def _params(model):
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, devices):
    run_dir = tmp_path_factory.mktemp("straight")
    with _trainer(run_dir) as t:
        summary = t.train()
        params = _params(t.model)
    assert summary.step == 6 and summary.stopped_by is None
    return run_dir, params


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, devices):
    run_dir = tmp_path_factory.mktemp("resumed")
    with _trainer(run_dir) as t:
        first = t.train(steps=3)
    with _trainer(run_dir) as t:
        second = t.train()
    return run_dir, first, second


def test_a_custom_optimizer_logs_its_schedule(straight):
    rows = read_metrics(straight[0])
    assert [r["step"] for r in rows] == list(range(1, 7))
    # update t (0-based) applies SCHEDULE(t): the rate logged is the one applied
    np.testing.assert_allclose([r["lr"] for r in rows], [float(SCHEDULE(t)) for t in range(6)],
                               rtol=1e-6)
    info = json.loads((straight[0] / "run.json").read_text())["config"]
    assert info["optimizer"] == "custom" and info["family"] == "mixtral"
    assert TrainConfig(**info["train"]).overrides == TINY


def test_train_in_two_calls_equals_a_straight_run(straight, resumed):
    run_dir, first, second = resumed
    assert (first.start_step, first.step, second.start_step, second.step) == (0, 3, 3, 6)
    got = [r["loss"] for r in read_metrics(run_dir)]
    want = [r["loss"] for r in read_metrics(straight[0])]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_summary_throughput_leaves_out_each_calls_first_step(resumed):
    """The summary's tokens/s: the median of a `train` call's per-step figures past its first
    (which carries first-call costs: the resumed call's first step too)."""
    run_dir, first, second = resumed
    speeds = [r["tokens_per_s"] for r in read_metrics(run_dir)]
    assert first.tokens_per_s == pytest.approx(statistics.median(speeds[1:3]), rel=1e-9)
    assert second.tokens_per_s == pytest.approx(statistics.median(speeds[4:6]), rel=1e-9)
    assert f"{second.tokens_per_s:,.0f} tokens/s" in second.line()


def test_load_gives_the_trained_model_on_another_mesh(straight, resumed):
    run_dir, want = straight
    loaded = load(run_dir, mesh="fsdp=8", strategy="fsdp", batch_size=8,
                  tx=optax.adamw(SCHEDULE))
    assert loaded.step == 6 and loaded.config.mesh == "fsdp=8"
    assert loaded.optimizer is not None
    got = _params(loaded.model)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    # a custom optimizer not handed back: the model alone
    assert load(run_dir).optimizer is None
    # the loaded model runs: its logits equal those of the resumed run's model
    tokens = np.arange(8 * 32, dtype=np.int32).reshape(8, 32) % 200
    logits, _ = loaded.model(tokens)
    other = load(resumed[0]).model(tokens)[0]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(other), rtol=1e-4, atol=1e-5)


def test_load_of_an_empty_run_dir_names_the_fix(tmp_path, devices):
    with pytest.raises(ValueError, match="holds no checkpoint; train first"):
        load(tmp_path)


class StopAt(Hook):
    def __init__(self, at):
        self.at, self.seen = at, []

    def on_step(self, trainer, step, row):
        self.seen.append(step)

    def should_stop(self, trainer, step):
        return step >= self.at


def test_a_hook_stops_the_run_with_a_checkpoint(tmp_path, straight, capsys):
    hook = StopAt(2)
    with _trainer(tmp_path, hooks=[hook]) as t:
        summary = t.train()
    assert summary.line() not in capsys.readouterr().out  # the library returns it, unprinted
    # one step past the first: too few for a throughput figure
    assert summary.tokens_per_s is None and "tokens/s n/a" in summary.line()
    # the run ends after the step whose metrics made should_stop true, and saves it
    assert summary.stopped_by == "StopAt" and summary.step == 2
    assert hook.seen == list(range(1, summary.step + 1))
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                  if p.name.isdigit()) == [summary.step]


def _events(logdir):
    """(tag, step, value) of every scalar in the TFRecord event files (read here, not with
    the writer's library: length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2
    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_events_hold_the_metrics(straight):
    events = _events(straight[0] / "tensorboard")
    losses = {step: value for tag, step, value in events if tag == "loss"}
    rows = read_metrics(straight[0])
    assert sorted(losses) == [r["step"] for r in rows]
    np.testing.assert_allclose([losses[r["step"]] for r in rows], [r["loss"] for r in rows],
                               rtol=1e-6)
    assert {"lr", "grad_norm", "tokens_per_s"} <= {tag for tag, _, _ in events}


def test_build_refuses_bad_settings_before_compiling(devices):
    with pytest.raises(ValueError, match=r"TrainConfig\.family is not set"):
        build(TrainConfig(), with_data=False)
    with pytest.raises(ValueError, match="unknown model family 'gpt9'"):
        build(TrainConfig(family="gpt9"), with_data=False)
    with pytest.raises(ValueError, match="has no preset 'huge'; its presets are"):
        build(TrainConfig(family="mixtral", preset="huge"), with_data=False)
    with pytest.raises(ValueError, match="not divisible"):
        build(TrainConfig(**{**BASE, "seq_len": 36}), with_data=False)
    built = build(TrainConfig(**BASE), with_data=False)
    assert built.config.strategy == "ep_as_cp" and built.config.mesh == "fsdp=2,expert=2,context=2"
    assert built.config.aux_loss_weight == built.model_config.router_aux_loss_coef
    assert dataclasses.asdict(built.config)["model"]["overrides"] == TINY


# -- the data feed -----------------------------------------------------------------------------

class Blocking:
    """A batch iterator that stops yielding (blocks) after `after` batches."""

    def __init__(self, data, after):
        import threading
        self.data, self.after, self.served = data, after, 0
        self.release, self.blocked = threading.Event(), threading.Event()

    def __next__(self):
        if self.served >= self.after:
            self.blocked.set()
            self.release.wait()
        self.served += 1
        return next(self.data)

    def get_state(self):
        return self.data.get_state()

    def set_state(self, state):  # a rewind (the trainer's first-batch probe) rewinds the count
        self.data.set_state(state)
        self.served = 0

    def close(self):
        self.release.set()
        self.data.close()


def _blocking_trainer(run_dir, after, **settings):
    built = build(TrainConfig(**{**BASE, **settings, "run_dir": str(run_dir)}))
    data = Blocking(built.data, after)
    return Trainer(dataclasses.replace(built, data=data)), data


def test_a_stalled_stream_stops_with_the_state_reached(tmp_path, devices):
    from zoo.train.feed import DataStreamError
    trainer, _ = _blocking_trainer(tmp_path, after=3, data_timeout=3.0)
    with trainer, pytest.raises(DataStreamError, match="yielded no batch for 3 s") as e:
        trainer.train()
    assert "Training stopped at step 3; the last good checkpoint is step 3" in str(e.value)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert load(tmp_path).step == 3


def test_sigterm_is_honoured_while_waiting_for_data(tmp_path, devices):
    import os
    import signal
    import threading
    import time
    trainer, data = _blocking_trainer(tmp_path, after=2)

    def signal_when_blocked():
        # not a wall-clock timer: the compile may take any time on a loaded box; signal once the
        # feed is blocked and the trainer has finished both steps it had data for
        while not (data.blocked.is_set() and trainer.step == 2):
            if data.release.is_set():
                return
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=signal_when_blocked, daemon=True)
    watcher.start()
    with trainer:
        summary = trainer.train()
    assert summary.stopped_by == "SIGTERM" and summary.step == 2
    assert load(tmp_path).step == 2


class NoTargets:
    """The pipeline's batches with every loss weight 0: nothing to learn from."""

    def __init__(self, data):
        self.data = data

    def __next__(self):
        batch = next(self.data)
        return {**batch, "loss_weights": np.zeros_like(batch["loss_weights"])}

    def get_state(self):
        return self.data.get_state()

    def set_state(self, state):
        self.data.set_state(state)


def test_the_first_batch_is_proved_before_compiling_and_rewound(tmp_path, devices):
    from zoo.train.feed import Feed, NoTrainingData
    built = build(TrainConfig(**{**BASE, "run_dir": str(tmp_path)}))
    fresh = build(TrainConfig(**{**BASE, "run_dir": str(tmp_path)})).data
    feed = Feed(built.data, timeout_s=30)
    feed.probe()
    first = feed.get()
    feed.close()
    expected = next(fresh)
    for key in expected:  # the probe rewound the stream: step 1 trains on the first batch
        np.testing.assert_array_equal(first[key], expected[key])
    compiled = []
    for data, settings, match in [(NoTargets(fresh), {}, "no token to learn from"),
                                  (Blocking(fresh, after=0), {"data_timeout": 2.0},
                                   "no first batch within 2 s")]:
        b = build(TrainConfig(**{**BASE, **settings, "run_dir": str(tmp_path / match[:5])}))
        trainer = Trainer(dataclasses.replace(b, data=data))
        trainer._compile = lambda *a: compiled.append(a)  # must never be reached
        with trainer, pytest.raises(NoTrainingData, match=match):
            trainer.train()
    assert compiled == []
