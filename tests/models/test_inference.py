"""`zoo.inference`: generation is dropless whatever the training MoE settings; its arguments
and command-line flags are checked before anything compiles.

* A tiny DeepSeek-V3 mini with a skewed router (every token prefers the same 4 of 16 experts,
  on one expert shard) under ep_as_cp: each training MoE setting (all_to_all with a buffer
  factor of 1 and overflow drop or exact, all_gather with a capacity factor, the defaults)
  generates the logits of the same parameters without a mesh. The skewed training forward
  under ``buffer_factor=1, overflow=drop`` is checked to drop tokens, so the setting bites.
* `CausalLM.for_inference` is a configured copy: the model it came from keeps its settings.
* ``python -m zoo.generate``'s flag errors: exit 2, one line naming the flag, no traceback.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo.inference as inference
from zoo.data import ByteTokenizer
from zoo.inference import cli
from zoo.inference.prompts import pad_prompts
from zoo.layers.moe import moe_modules
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
from zoo.partitioning import Partitioner, make_mesh

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 33, 2, 40, 9, 11], [21, 8, 3]]
NEW = 2  # the prefill's logits and one decode step's
CONFIG = DeepSeek3Config.mini(num_hidden_layers=2, hidden_size=64, max_position_embeddings=64)
# the training MoE settings: each a different way to lose tokens in training, or none
SETTINGS = {
    "a2a_factor1_drop": dict(moe_dispatch="all_to_all", moe_buffer_factor=1.0,
                             moe_overflow="drop"),
    "a2a_factor1_exact": dict(moe_dispatch="all_to_all", moe_buffer_factor=1.0,
                              moe_overflow="exact"),
    "all_gather_capacity1": dict(moe_dispatch="all_gather", capacity_factor=1.0),
    "defaults": dict(),
}


def _skewed(model):
    """Every MoE layer's selection bias favours experts 0-3 of the 16 (the first group, on
    the first of two expert shards), the router's own scores kept small: each token's top 4
    are those, with token-dependent weights."""
    for m in moe_modules(model):
        kernel = m.router[...]
        m.router[...] = kernel * 0.05
        bias = jnp.zeros(m.e_score_correction_bias[...].shape).at[..., :4].set(1.0)
        m.e_score_correction_bias[...] = bias.astype(m.e_score_correction_bias[...].dtype)
    return model


def _model(partitioner=None, **settings):
    config = dataclasses.replace(CONFIG, **settings)
    return _skewed(DeepSeek3(config, inputs_shape=(8, 16) if partitioner else None,
                             partitioner=partitioner, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def reference():
    """The unsharded model's greedy tokens and logits for PROMPTS."""
    return inference.generate_with_logits(_model(), PROMPTS, max_new_tokens=NEW)


@pytest.fixture(scope="module")
def ep_as_cp(devices):
    return Partitioner(make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_generation_logits_equal_unsharded_under_every_training_moe_setting(
        setting, reference, ep_as_cp):
    model = _model(ep_as_cp, **SETTINGS[setting])
    tokens, logits = inference.generate_with_logits(model, PROMPTS, max_new_tokens=NEW)
    want_tokens, want_logits = reference
    assert tokens == want_tokens, setting
    for got, want in zip(logits, want_logits, strict=True):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, (setting, err)


@pytest.mark.slow
def test_skewed_router_drops_tokens_in_the_training_forward(reference, ep_as_cp):
    """The setting the generation test relies on does drop: the training forward over the
    padded prompts under ``buffer_factor=1, overflow=drop`` differs from the unsharded one
    (so the equality above cannot hold by accident)."""
    tokens, _ = pad_prompts(_model(), PROMPTS)
    tokens = np.pad(tokens, ((0, 8 - len(tokens)), (0, 16 - tokens.shape[1])))
    forward = jax.jit(lambda m, t: m(t)[0])
    want = np.asarray(forward(_model(), jnp.asarray(tokens)))
    got = np.asarray(forward(_model(ep_as_cp, **SETTINGS["a2a_factor1_drop"]),
                             jnp.asarray(tokens)))
    assert np.abs(got - want).max() / np.abs(want).max() > 1e-2


def test_for_inference_is_a_dropless_copy_sharing_parameters():
    model = _model(None, capacity_factor=1.0)
    view = model.for_inference()
    assert model.config.capacity_factor == 1.0 and view.config.capacity_factor is None
    assert type(view) is type(model) and view.partitioner is model.partitioner
    assert view.config.moe_overflow == "auto" and view.config.moe_buffer_factor is None
    assert view.embed_tokens.embedding[...] is model.embed_tokens.embedding[...]
    unsharded = model.for_inference(unsharded=True)
    assert unsharded.config.attention_implementation == "reference"


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=float("nan")), r"temperature=nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), r"temperature=inf must be a finite number"),
    (dict(temperature=-1.0), r"temperature=-1.0 must be"),
    (dict(temperature=1.0, top_p=float("nan")), r"top_p=nan must be a number in \(0, 1\]"),
    (dict(temperature=1.0, top_k=0), r"top_k=0 must be an int in \[1, vocab=264\]"),
    (dict(max_new_tokens=-1), r"max_new_tokens=-1 must be an int >= 0"),
    (dict(max_new_tokens=2.0), r"max_new_tokens=2.0 must be an int"),
    (dict(seed=1.5), r"seed=1.5 must be an int"),
])
def test_generate_refuses_numbers_that_are_not_finite_or_in_range(kw, match):
    model = _model()
    kw = {"max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=match):
        inference.generate(model, [[1, 2]], **kw)


# -- command line -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--temperature", "nan"], ["--temperature nan", "finite"]),
    (["--temperature", "inf"], ["--temperature inf", "finite"]),
    (["--top-p", "1.5"], ["--top-p 1.5", "(0, 1]"]),
    (["--top-p", "nan"], ["--top-p nan"]),
    (["--top-k", "0"], ["--top-k 0", ">= 1"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens 0", "nothing to generate"]),
    (["--speculative", "mtp", "--temperature", "0.7"],
     ["--speculative mtp", "--temperature 0.7", "drop --temperature or --speculative"]),
    (["--speculative", "mtp", "--top-p", "0.9", "--top-k", "5"],
     ["--speculative", "--top-k 5", "--top-p 0.9"]),
])
def test_command_line_refuses_bad_flags_naming_them(argv, words, monkeypatch, capsys):
    def no_load(args):
        raise AssertionError("loaded a model despite a bad flag")

    monkeypatch.setattr(cli, "load_model", no_load)
    with pytest.raises(SystemExit) as e:
        cli.main(["--run", "x", "--prompt", "def", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)
    assert "temperature=" not in err and "speculative=" not in err  # flags, not arguments


def test_command_line_checks_top_k_against_the_vocabulary(monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_model", lambda args: (_model(), ByteTokenizer()))
    with pytest.raises(SystemExit) as e:
        cli.main(["--run", "x", "--prompt", "def", "--temperature", "1", "--top-k", "999"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--top-k 999" in err and "264 tokens" in err, err


@pytest.mark.e2e  # a fresh process: what a user sees, traceback or not
def test_command_line_flag_error_has_no_traceback():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "zoo.generate", "--run", "nowhere", "--prompt", "x",
         "--temperature", "nan"], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "--temperature nan" in proc.stderr
