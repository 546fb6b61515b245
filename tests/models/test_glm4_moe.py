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


def test_from_hf_skips_the_mtp_layer_with_a_warning(tmp_path):
    """A checkpoint in the published layout with its MTP layer (``num_nextn_predict_layers=1``:
    ``model.layers.{L}.*``, written here): `from_hf` loads the decoder and warns that the MTP
    tensors are skipped, naming them; the weights it loads are the checkpoint's."""
    import json
    import warnings

    from flax import nnx
    from safetensors.numpy import save_file

    from zoo.models import glm4_moe

    config = Glm4MoeConfig.mini(vocab_size=64, hidden_size=32, intermediate_size=64,
                                moe_intermediate_size=16, num_hidden_layers=2, head_dim=8,
                                num_attention_heads=4, num_key_value_heads=2,
                                n_routed_experts=4, num_experts_per_tok=2)
    model = glm4_moe.Glm4Moe(config, rngs=nnx.Rngs(0))
    glm4_moe.to_hf(model, tmp_path)
    L, D = config.num_hidden_layers, config.hidden_size
    mtp = {f"model.layers.{L}.{name}": np.ones(shape, np.float32) for name, shape in [
        ("eh_proj.weight", (D, 2 * D)), ("enorm.weight", (D,)), ("hnorm.weight", (D,)),
        ("self_attn.q_proj.weight", (32, D)), ("shared_head.norm.weight", (D,))]}
    save_file(mtp, str(tmp_path / "mtp.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = glm4_moe.from_hf(tmp_path)
    texts = [str(w.message) for w in caught]
    assert any("skipping 5 tensor(s)" in t and f"model.layers.{L}.*" in t
               and "num_nextn_predict_layers" in t and "no MTP module" in t
               for t in texts), texts
    np.testing.assert_array_equal(np.asarray(loaded.embed_tokens.embedding[...]),
                                  np.asarray(model.embed_tokens.embedding[...]))
    glm4_moe.to_hf(loaded, tmp_path / "plain")  # nothing of the MTP layer comes back out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        glm4_moe.from_hf(tmp_path / "plain")
