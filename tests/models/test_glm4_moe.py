"""GLM-4.5 beyond the conformance suite: config.json spellings, config errors, partial rotary."""

import jax.numpy as jnp
import numpy as np
import pytest

from zoo.layers.rope import RoPE
from zoo.models.glm4_moe import Glm4MoeConfig


def test_partial_rotary_factor_read_from_either_spelling_and_written_to_both():
    base = Glm4MoeConfig.mini().to_hf_config()
    assert base["rope_parameters"]["partial_rotary_factor"] == 0.5
    top = {k: v for k, v in base.items() if k not in ("rope_parameters", "partial_rotary_factor")}
    published = {**top, "rope_theta": 1e6, "partial_rotary_factor": 0.25}  # the Hub spelling
    assert Glm4MoeConfig.from_hf_config(published).partial_rotary_factor == 0.25
    nested = {**top, "partial_rotary_factor": 0.5, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.75}}
    assert Glm4MoeConfig.from_hf_config(nested).partial_rotary_factor == 0.75
    assert Glm4MoeConfig.from_hf_config(base) == Glm4MoeConfig.mini()


def test_partial_rope_rotates_only_the_leading_dims():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 2, 8)), jnp.float32)
    pos = jnp.arange(5)[None]
    half = RoPE(theta=100.0, partial_rotary_factor=0.5).apply(x, pos)
    np.testing.assert_array_equal(np.asarray(half[..., 4:]), np.asarray(x[..., 4:]))
    np.testing.assert_allclose(np.asarray(half[..., :4]),
                               np.asarray(RoPE(theta=100.0).apply(x[..., :4], pos)), rtol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (dict(partial_rotary_factor=0.0), r"partial_rotary_factor=0.0 must be in \(0, 1\]"),
    (dict(partial_rotary_factor=0.1), "gives 1 rotary dims, which must be even"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace=9 must be between 0 and"),
    (dict(num_experts_per_tok=32), "num_experts_per_tok=32 exceeds n_routed_experts=16"),
    (dict(attention_bias="yes"), "attention_bias='yes' must be True or False"),
    (dict(n_shared_experts=-1), "n_shared_experts=-1 must be >= 0"),
])
def test_config_errors_name_the_value_and_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        Glm4MoeConfig.mini(**bad)
