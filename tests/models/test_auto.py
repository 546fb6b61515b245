"""`zoo.models.from_hf` reads any registered family's checkpoint by its model_type, and an
unknown model_type is refused with the supported ones listed."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from zoo.models import registry
from zoo.models.mixtral import Mixtral, MixtralConfig


def test_from_hf_dispatches_on_model_type(tmp_path):
    model = Mixtral(MixtralConfig.mini(), rngs=nnx.Rngs(0))
    zoo.models.to_hf(model, tmp_path / "ckpt")
    loaded = zoo.models.from_hf(tmp_path / "ckpt")
    assert type(loaded) is Mixtral
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(1, 16) % 200
    positions = jnp.arange(16)[None]
    np.testing.assert_allclose(loaded(tokens, positions=positions)[0],
                               model(tokens, positions=positions)[0], rtol=1e-6, atol=1e-6)


def test_every_family_registers_its_model_types():
    types = registry.model_types()
    assert {"mixtral", "deepseek_v3", "qwen3_moe", "glm4_moe", "gpt_oss"} <= set(types)
    for model_type, family in types.items():
        assert model_type in family.model_cls.hf_model_types


def test_an_unknown_model_type_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"model_type='llama'.*'deepseek_v3'.*'mixtral'"):
        zoo.models.from_hf(tmp_path)
