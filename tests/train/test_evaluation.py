"""Held-out evaluation: the document split, the eval loss, the `Evaluate` hook, the command.

* `zoo.data.split`: the training stream and the validation stream of a small ``.jsonl`` corpus
  (every document shorter than a row, so each packed segment is a whole document) share no
  document digest, together hold every document once, and the split is the same for another
  seed and file order; a split that would be empty (or leave nothing to train on) is refused.
* `Evaluator` against a plain forward and a float64 cross-entropy in numpy on the same
  held-out batches; evaluation leaves the parameters as they were.
* A recipe subprocess with ``--eval-every`` writes ``eval_loss``/``eval_ppl`` at the steps it
  should (metrics.jsonl, TensorBoard, loss.png); ``python -m zoo.evaluate --run`` gives the
  loss of the final step again; a resume from an earlier checkpoint keeps one eval row per
  step; bad input exits 2.
"""

import itertools
import json
import math
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from test_recipes import COMMON, ROOT, TINY, run_main, sub_env
from test_trainer import TINY as TINY_FIELDS
from test_trainer import _events

from zoo.data import ByteTokenizer, text_dataset
from zoo.data.split import document_digest, held_out
from zoo.train import TrainConfig, build, read_metrics
from zoo.train.evaluation import Evaluator
from zoo.train.step import make_global_batch

FRACTION = 0.2
DOCS = [f"document {i}: " + "word " * (i % 7 + 1) for i in range(300)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for name, docs in (("a.jsonl", DOCS[:150]), ("b.jsonl", DOCS[150:])):
        (folder / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return folder


def documents(it) -> list[str]:
    """The text of every packed segment of every batch (no context-parallel reorder here)."""
    tok, out = ByteTokenizer(), []
    for batch in it:
        for inputs, segments in zip(batch["inputs"], batch["segment_ids"]):
            out += [tok.decode(inputs[segments == s]) for s in np.unique(segments) if s]
    it.close()
    return out


def stream(paths, split, **kwargs):
    return documents(text_dataset(paths, seq_len=64, batch_size=4, num_epochs=1,
                                  validation_fraction=FRACTION, split=split, **kwargs))


def test_split_never_overlaps_the_training_stream_and_is_deterministic(corpus):
    train, held = stream([str(corpus)], "train"), stream([str(corpus)], "validation")
    assert not {document_digest(t) for t in train} & {document_digest(t) for t in held}
    assert sorted(train + held) == sorted(DOCS)  # every document once, on one side
    assert 0.1 < len(held) / len(DOCS) < 0.3, len(held)
    assert set(held) == {t for t in DOCS if held_out(t, FRACTION)}
    # the text alone decides: another seed and another file order hold out the same ones
    again = stream([str(corpus / "b.jsonl"), str(corpus / "a.jsonl")], "validation", seed=7,
                   shuffle=False)
    assert sorted(again) == sorted(held)


def test_an_empty_split_is_refused(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single document")
    assert held_out("a single document", 0.999)  # (the digest decides; checked here)
    kw = dict(seq_len=64, batch_size=4)
    with pytest.raises(ValueError, match="validation split would be empty; raise "
                                         "--validation-fraction"):
        text_dataset(str(one), validation_fraction=1e-9, split="validation", **kw)
    with pytest.raises(ValueError, match="leaving nothing to train on; lower"):
        text_dataset(str(one), validation_fraction=0.999, **kw)
    with pytest.raises(ValueError, match="split='validation' needs validation_fraction > 0"):
        text_dataset(str(one), split="validation", **kw)


@pytest.mark.parametrize("settings, message", [
    (dict(eval_every=5, validation_fraction=0.0),
     "--eval-every 5: evaluates held-out documents, but --validation-fraction is 0"),
    (dict(validation_fraction=1.0), "--validation-fraction 1.0: must be in [0, 1)"),
    (dict(eval_every=-1), "--eval-every -1: must be an integer >= 0"),
    (dict(eval_batches=0), "--eval-batches 0: must be an integer >= 1"),
])
def test_eval_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**settings)


def test_a_recipe_refuses_an_empty_split_before_compiling(tmp_path, devices, capsys):
    one = tmp_path / "one.txt"
    one.write_text("a single document")
    with pytest.raises(SystemExit) as e:
        run_main("mini_mixtral", [*COMMON, *TINY["mini_mixtral"], "--data", str(one),
                                  "--eval-every", "2", "--validation-fraction", "1e-9",
                                  "--run-dir", str(tmp_path / "run")])
    assert e.value.code == 2
    assert "the validation split would be empty" in capsys.readouterr().err


# -- the eval loss -----------------------------------------------------------------------------

def test_eval_loss_equals_a_plain_forward_and_cross_entropy(corpus, devices):
    built = build(TrainConfig(family="mixtral", preset="mini", overrides=TINY_FIELDS,
                              batch_size=4, seq_len=32, data=(str(corpus),),
                              validation_fraction=FRACTION, eval_every=1), with_data=False)
    model, _ = built.create_sharded()
    batches = list(itertools.islice(built.eval_data(), 3))
    evaluator = Evaluator(built)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    got = evaluator.evaluate(model, batches, max_batches=2)

    forward = jax.jit(lambda m, b: m(b["inputs"], positions=b["positions"],
                                     segment_ids=b["segment_ids"])[0])
    ce = weight = 0.0
    for local in batches[:2]:
        logits = np.asarray(forward(model, make_global_batch(local, built.batch_sharding)),
                            np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, local["targets"][..., None], -1)[..., 0]
        ce += float((nll * local["loss_weights"]).sum())
        weight += float(local["loss_weights"].sum())
    assert (got.batches, got.tokens) == (2, int(weight))
    assert got.loss == pytest.approx(ce / weight, rel=1e-5)
    assert got.ppl == pytest.approx(math.exp(ce / weight), rel=1e-5)
    assert got.row()["eval_ppl"] == got.ppl
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
    # the split is read once through: fewer batches when it is smaller than asked
    everything = evaluator.evaluate(model, built.eval_data(), max_batches=1000)
    assert everything.batches < 1000 and everything.tokens > got.tokens


# -- recipes and the command line --------------------------------------------------------------

EVAL_ARGV = ["--steps", "4", "--eval-every", "3", "--eval-batches", "2",
             "--checkpoint-every", "2", *COMMON, *TINY["mini_mixtral"]]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, devices):
    """A recipe run in a subprocess: 4 steps, evaluated at step 3 and at the last step."""
    run_dir = tmp_path_factory.mktemp("evaluated") / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "mini_mixtral.py"),
                           *EVAL_ARGV, "--run-dir", str(run_dir)], env=sub_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.e2e
def test_a_recipe_run_writes_eval_rows(evaluated):
    rows = read_metrics(evaluated)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 4]
    for r in evals:
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
        assert 0 < r["eval_tokens"] <= 2 * 4 * 32 and math.isfinite(r["eval_loss"])
    board = {(tag, step) for tag, step, _ in _events(evaluated / "tensorboard")}
    assert {("eval_loss", 3), ("eval_loss", 4), ("eval_ppl", 4)} <= board
    assert (evaluated / "loss.png").stat().st_size > 0


@pytest.mark.e2e
def test_the_command_evaluates_the_latest_checkpoint(evaluated):
    proc = subprocess.run([sys.executable, "-m", "zoo.evaluate", "--run", str(evaluated)],
                          env=sub_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    match = re.match(r"step 4: eval_loss ([\d.]+), perplexity ([\d.]+) \(", line)
    assert match, line
    logged = read_metrics(evaluated)[-1]
    assert float(match[1]) == pytest.approx(logged["eval_loss"], abs=2e-4)  # another mesh
    assert f"{logged['eval_tokens']:,} tokens in 2 batches of the held-out 0.02" in line


def test_the_command_refuses_bad_input(tmp_path, capsys):
    from zoo.evaluate import main
    (tmp_path / "empty").mkdir()
    for argv, message in (
            (["--run", str(tmp_path / "empty")], "holds no checkpoint; train first"),
            (["--run", str(tmp_path / "nowhere")], "is not a directory"),
            (["--run", str(tmp_path / "empty"), "--data", str(tmp_path / "missing.txt")],
             "missing.txt (does not exist)"),
            (["--run", str(tmp_path / "empty"), "--batches", "0"], "--batches 0: must be >= 1")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1], err


@pytest.mark.e2e  # a second compile of the train step (~40 s)
def test_a_resume_keeps_one_eval_row_per_step(evaluated, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(evaluated, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "4")  # resume from step 2
    code, steps = run_main("mini_mixtral", [*EVAL_ARGV, "--run-dir", str(run_dir)])
    assert code == 0 and steps == [3, 4]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 4]
    np.testing.assert_allclose([r["eval_loss"] for r in rows if "eval_loss" in r],
                               [r["eval_loss"] for r in read_metrics(evaluated)
                                if "eval_loss" in r], rtol=1e-5)

