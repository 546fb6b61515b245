"""Qwen3.5-MoE beyond the conformance suite (tests/models/test_conformance.py runs its HF logits,
gradients, strategies, packed documents, round trip, parameter counts and recipe): the language
model of a tiny multimodal ``Qwen3_5MoeForConditionalGeneration`` loads (vision tower ignored,
with one warning) and gives its text logits; the fixed fields are refused.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest

import zoo
from conformance import TOL, forward, hf_logits, reference
from support import rel_err
from zoo.models import qwen3_5_moe
from zoo.models.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeConfig

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from test_conformance import FAMILIES, QWEN3_NEXT_CONFIG  # noqa: E402 -- needs transformers

SPEC = next(f for f in FAMILIES if f.name == "qwen3_5_moe")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(SPEC, tmp_path_factory)


def test_multimodal_checkpoint_loads_its_language_model(ref, tmp_path):
    torch.manual_seed(1)
    cfg = transformers.Qwen3_5MoeConfig(
        text_config=QWEN3_NEXT_CONFIG, vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64))
    mm = transformers.Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    mm.save_pretrained(tmp_path)
    keys = zoo.models.hf.CheckpointReader(tmp_path).keys()
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    qwen3_5_moe._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = zoo.models.from_hf(tmp_path)
    assert sum("vision tower" in str(w.message) for w in caught) == 1
    assert type(loaded) is Qwen3_5Moe
    assert loaded.config == zoo.models.from_hf(ref.path).config  # the text config's values
    logits = forward(loaded, jnp.asarray(ref.tokens))
    assert rel_err(logits, hf_logits(mm, ref.tokens)) < TOL


def test_fixed_fields_are_refused():
    with pytest.raises(ValueError, match="norm_topk_prob"):
        Qwen3_5MoeConfig.mini(norm_topk_prob=False)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        Qwen3_5MoeConfig.mini(mlp_only_layers=(1,))
