"""Runs load as they were trained: `zoo.train.load` (and ``python -m zoo.evaluate``) rebuild
the model with the classes run.json names (``module:QualName``), never silently with the base
class.

A method-only router subclass (temperature 2) and a stateful one (a learned router scale),
both from the importable ``research_classes``, are trained a few steps; the loaded model's
logits equal the trained model's. The base class gives other logits (so the comparison can
fail). A class recorded from ``__main__`` is refused naming it and the flag that passes it.
"""

import contextlib
import io
import json

import numpy as np
import pytest

from research_classes import ScaledRouterLayer, TemperedLayer
from zoo import evaluate
from zoo.models.mixtral import MixtralDecoderLayer
from zoo.train import TrainConfig, Trainer, load
from zoo.train.checkpoint import Checkpointer

TINY = ("num_hidden_layers=1", "hidden_size=32", "intermediate_size=32",
        "num_attention_heads=4", "head_dim=8")
BASE = dict(family="mixtral", preset="mini", overrides=TINY, steps=2, batch_size=4, seq_len=32,
            checkpoint_every=50, progress=False, lr=3e-2)
TOKENS = np.arange(4 * 32, dtype=np.int32).reshape(4, 32) % 200


def _logits(model):
    return np.asarray(model(TOKENS)[0])


def _train(run_dir, layer):
    with Trainer(TrainConfig(**BASE, run_dir=str(run_dir)), decoder_layer_cls=layer,
                 default_hooks=False) as t:
        t.train()
        return _logits(t.model)


@pytest.fixture(scope="module")
def tempered(tmp_path_factory, devices):
    run_dir = tmp_path_factory.mktemp("tempered")
    return run_dir, _train(run_dir, TemperedLayer)


@pytest.mark.parametrize("layer", ["TemperedLayer", "ScaledRouterLayer"])
def test_a_subclassed_run_loads_with_its_classes(tmp_path, tempered, layer):
    if layer == "TemperedLayer":
        run_dir, want = tempered
    else:
        run_dir, want = tmp_path, _train(tmp_path, ScaledRouterLayer)
    info = json.loads((run_dir / "run.json").read_text())["config"]
    assert info["decoder_layer_cls"] == f"research_classes:{layer}"
    assert info["model_cls"] == "zoo.models.mixtral:Mixtral"
    got = _logits(load(run_dir).model)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_base_class_would_give_another_model(tempered):
    """What loading silently as the base class gave: other logits (the test above can fail)."""
    run_dir, want = tempered
    with pytest.warns(UserWarning, match="trained with decoder_layer_cls "
                                         "research_classes:TemperedLayer; loading with"):
        base = load(run_dir, decoder_layer_cls=MixtralDecoderLayer)
    assert np.abs(_logits(base.model) - want).max() > 1e-3


@pytest.fixture
def recorded_in_main(tempered, monkeypatch):
    """The tempered run as if trained from a script: run.json names ``__main__:TemperedLayer``."""
    read = Checkpointer.read_config

    def read_config(self, step, **kwargs):
        return dict(read(self, step, **kwargs), decoder_layer_cls="__main__:TemperedLayer")

    monkeypatch.setattr(Checkpointer, "read_config", read_config)
    return tempered


def test_a_class_from_main_is_named_with_the_way_to_pass_it(recorded_in_main):
    run_dir, want = recorded_in_main
    with pytest.raises(ValueError) as e:
        load(run_dir)
    message = str(e.value)
    for words in ("__main__:TemperedLayer", "defined in the script that trained it",
                  "decoder_layer_cls=", "--decoder-layer-cls module:Class"):
        assert words in message, message
    with pytest.warns(UserWarning, match="loading with research_classes:TemperedLayer"):
        got = _logits(load(run_dir, decoder_layer_cls=TemperedLayer).model)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_evaluate_takes_the_class_as_a_flag(recorded_in_main, tmp_path, capsys):
    """``python -m zoo.evaluate``: without the class, exit 2 with one line naming it and the
    flag; with ``--decoder-layer-cls module:Class`` it evaluates."""
    run_dir, _ = recorded_in_main
    text = tmp_path / "held.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    argv = ["--run", str(run_dir), "--data", str(text), "--batches", "1"]
    with pytest.raises(SystemExit) as e:
        evaluate.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert "__main__:TemperedLayer" in err and "--decoder-layer-cls" in err
    with pytest.raises(SystemExit) as e:
        evaluate.main([*argv, "--decoder-layer-cls", "research_classes:NoSuchLayer"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--decoder-layer-cls research_classes:NoSuchLayer" in err
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.warns(UserWarning):
        assert evaluate.main([*argv, "--decoder-layer-cls",
                              "research_classes:TemperedLayer"]) == 0
    assert "eval_loss" in out.getvalue()


def test_generate_takes_the_class_flags_too():
    from zoo.inference.cli import parser
    from zoo.train.load import classes_from_flags
    args = parser().parse_args(["--run", "r", "--prompt", "p", "--decoder-layer-cls",
                                "research_classes:TemperedLayer"])
    assert classes_from_flags(args) == {"decoder_layer_cls": TemperedLayer}
    with pytest.raises(ValueError, match="--model-cls research_classes:: not a module:Class"):
        classes_from_flags(parser().parse_args(["--run", "r", "--prompt", "p", "--model-cls",
                                                "research_classes:"]))


def test_an_old_run_with_model_settings_in_parallelism_loads(tempered, monkeypatch):
    """A run.json from before the model settings left the training config: its
    ``train.parallelism`` holds attention/dtype/param_dtype/remat. It loads (they are folded
    into the model config's overrides), with the trained model's logits; a dtype it set
    stays set, the others are the recorded model config's."""
    run_dir, want = tempered
    read = Checkpointer.read_config

    def read_config(self, step, **kwargs):
        record = read(self, step, **kwargs)
        train = dict(record["train"])
        train["parallelism"] = dict(train["parallelism"], attention=None, dtype="float32",
                                    param_dtype=None, remat="none")
        return dict(record, train=train)

    monkeypatch.setattr(Checkpointer, "read_config", read_config)
    loaded = load(run_dir)
    assert loaded.config.overrides == ("dtype=float32",)
    assert loaded.model_config.dtype == np.float32 and loaded.model_config.remat_policy is None
    np.testing.assert_allclose(_logits(loaded.model), want, rtol=1e-5, atol=1e-5)
