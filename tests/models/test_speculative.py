"""`zoo.speculative`: MTP drafts verified by the model give plain greedy decoding's tokens.

* a random mini DeepSeek-V3 with one MTP module (drafts almost always rejected);
* the same model with its feed-forward outputs and the MTP layer's attention zeroed and
  ``eh_proj`` passing the embedding through: the MTP module then predicts exactly what the
  trunk will at the next position when the trunk's attention is off (every draft accepted),
  and some of the time when the trunk's attention is scaled down (both branches);
* under ep_as_cp on 8 virtual devices;
* the statistics add up, one verify program is compiled, and models without MTP (Mixtral,
  Qwen3-MoE, DeepSeek-V3 with ``num_nextn_predict_layers=0``) and ``temperature > 0`` are
  refused.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo.inference as G
import zoo.inference.speculative as S
from zoo.inference.engine import compiled_steps
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
from zoo.models.mixtral import Mixtral, MixtralConfig
from zoo.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from zoo.partitioning import Partitioner, make_mesh

NEW = 16
PROMPTS = [[5, 17, 33, 2, 40, 9, 11], [21, 8], [3, 60, 14, 27, 50]]
CONFIG = DeepSeek3Config.mini(num_hidden_layers=2, hidden_size=64, num_nextn_predict_layers=1,
                              vocab_size=256)


def _model(attention_scale: float | None = None, partitioner=None):
    """The random model; with `attention_scale`, the drafting-friendly one (see above)."""
    model = DeepSeek3(CONFIG, partitioner=partitioner, rngs=nnx.Rngs(0))
    if attention_scale is None:
        return model
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, mtp = path[-2:] if path[-1] == "kernel" else path[-1:], path[0] == "mtp"
        if "down" in name or "wo" in name or (mtp and "o_proj" in name):
            v[...] = jnp.zeros_like(v[...])
        elif "o_proj" in name:
            v[...] = v[...] * attention_scale
        elif "eh_proj" in path:  # [enorm(e); hnorm(h)] -> enorm(e)
            D = CONFIG.hidden_size
            v[...] = jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))]).astype(v[...].dtype)
    return model


def _check(model, prompts=PROMPTS, **kw):
    plain = G.generate(model, prompts, max_new_tokens=NEW, **kw)
    tokens, stats = S.generate_speculative(model, prompts, max_new_tokens=NEW, **kw)
    assert tokens == plain
    assert stats.rows == len(prompts) and stats.tokens == sum(map(len, tokens))
    assert stats.tokens == stats.rows + stats.drafted + stats.accepted - stats.discarded
    assert stats.forward_passes == 1 + stats.steps
    assert stats.plain_forward_passes == max(map(len, tokens))
    assert stats.drafted <= stats.rows * stats.steps
    return stats


@pytest.fixture(scope="module")
def random_model():
    return _model()


def test_random_model_equals_plain_greedy(random_model):
    before = compiled_steps(S.verify_jit)  # other families' tests in this process compile theirs
    stats = _check(random_model)
    assert stats.steps == NEW - 1 and stats.speedup == 1.0  # random drafts: rejected
    assert compiled_steps(S.verify_jit) == before + 1, "one compiled verify step"


def test_accepted_drafts_save_forward_passes():
    stats = _check(_model(attention_scale=0.0))
    assert stats.acceptance_rate == 1.0
    assert stats.steps == (NEW - 1 + 1) // 2 and stats.speedup > 1.7, str(stats)


def test_accept_and_reject_branches_and_stop():
    model = _model(attention_scale=0.5)
    stats = _check(model)
    assert 0 < stats.acceptance_rate < 1, str(stats)
    assert 1 < stats.speedup < 2
    plain = G.generate(model, PROMPTS, max_new_tokens=NEW)
    stop = plain[0][5]
    _check(model, stop=[stop])
    one, one_stats = S.generate_speculative(model, PROMPTS[:1], max_new_tokens=NEW)
    assert one == plain[:1] and one_stats.rows == 1


@pytest.mark.slow
def test_ep_as_cp_equals_unsharded(devices):
    p = Partitioner(make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    model, ref = _model(0.5, partitioner=p), _model(0.5)
    tokens, stats = S.generate_speculative(model, PROMPTS, max_new_tokens=NEW)
    assert tokens == G.generate(ref, PROMPTS, max_new_tokens=NEW)
    assert 0 < stats.acceptance_rate < 1


def test_refusals(random_model):
    tiny = dict(num_hidden_layers=1, hidden_size=32, vocab_size=64)
    for model in (Mixtral(MixtralConfig.mini(**tiny), rngs=nnx.Rngs(0)),
                  Qwen3Moe(Qwen3MoeConfig.mini(**tiny), rngs=nnx.Rngs(0)),
                  DeepSeek3(DeepSeek3Config.mini(**tiny, first_k_dense_replace=0),
                            rngs=nnx.Rngs(0))):
        name = type(model).__name__
        with pytest.raises(ValueError, match=f"{name} has none.*num_nextn_predict_layers=1"):
            G.generate(model, [[1, 2]], max_new_tokens=2, speculative="mtp")
    with pytest.raises(ValueError, match=r"greedy only.*temperature=0"):
        G.generate(random_model, [[1, 2]], max_new_tokens=2, temperature=0.7,
                   speculative="mtp")
    with pytest.raises(ValueError, match="speculative='mtp' or None"):
        G.generate(random_model, [[1, 2]], max_new_tokens=2, speculative="ngram")
    assert np.array_equal(S.generate_speculative(random_model, [[1]], max_new_tokens=0)[0],
                          [[]])


def test_command_line(random_model, monkeypatch, capsys):
    from zoo.data import ByteTokenizer
    from zoo.inference import cli
    monkeypatch.setattr(cli, "load_model", lambda args: (random_model, ByteTokenizer()))
    assert cli.main(["--run", "x", "--prompt", "def", "--max-new-tokens", "4",
                     "--speculative", "mtp"]) == 0
    text, stats = capsys.readouterr().out.strip().splitlines()[-2:]
    assert text.startswith("def") and "drafts accepted" in stats and "forward passes" in stats
    mixtral = Mixtral(MixtralConfig.mini(num_hidden_layers=1), rngs=nnx.Rngs(0))
    monkeypatch.setattr(cli, "load_model", lambda args: (mixtral, ByteTokenizer()))
    with pytest.raises(SystemExit) as e:
        cli.main(["--run", "x", "--prompt", "def", "--speculative", "mtp"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Mixtral has none" in err and "--speculative mtp" in err
    assert "speculative=" not in err  # the flag, not the Python argument
