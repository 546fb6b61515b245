"""Model-level behaviour of Mixtral and DeepSeek-V3 beyond the conformance suite.

* The mini presets are small and shaped like their families; `flops_per_token` against a hand
  count; a dense-only DeepSeek-V3 has empty expert counts.
* Config and constructor validation errors name the value and the fix; `DecoderConfig` derives
  the zoo-only fields from one place.
* (Parameter counts against transformers, subclass swaps, remat and every Hugging Face check
  live in tests/models/conformance.py.)
"""

import dataclasses
import warnings

import jax.numpy as jnp
import pytest
from flax import nnx

from zoo.layers.attention import Attention
from zoo.layers.mla import MLA
from zoo.models import DecoderConfig, count_params
from zoo.models.config import zoo_field, zoo_only_fields
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config, DeepSeek3DecoderLayer
from zoo.models.mixtral import Mixtral, MixtralConfig, MixtralDecoderLayer

TINY_MIXTRAL = MixtralConfig.mini(vocab_size=64, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8)


def test_mini_presets_are_small_and_family_shaped():
    m, d = MixtralConfig.mini(), DeepSeek3Config.mini()
    assert m.vocab_size == d.vocab_size == 264 and m.num_local_experts % 8 == 0
    assert d.n_routed_experts % 8 == 0 and d.q_lora_rank and d.rope_scaling is not None
    assert d.first_k_dense_replace == 1 and d.n_group > 1 and d.topk_group > 1
    assert d.n_shared_experts == 1 and max(m.num_params(), d.num_params()) < 5_000_000


def test_flops_per_token():
    c = MixtralConfig.mixtral_8x7b()
    active = 32 * (4096 * 128 * (64 + 16) + 4096 * 8 + 2 * 3 * 4096 * 14336) + 4096 * 32000
    assert c.active_matmul_params() == active  # ~12.9B "active parameters"
    attn = 32 * 2 * 32 * 256 * 2048.5
    assert c.flops_per_token(4096) == pytest.approx(6 * active + 3 * attn)
    d = DeepSeek3Config.deepseek_v3(num_nextn_predict_layers=0)
    assert 36e9 < d.active_matmul_params() < 38e9  # "37B activated" (the trunk)
    mtp = DeepSeek3Config.deepseek_v3()  # one MTP module: its layer's work is trained too
    assert mtp.flops_per_token(4096) > d.flops_per_token(4096)
    assert d.flops_per_token(4096, causal=False) > d.flops_per_token(4096)



def test_counting_does_not_meet_a_mesh_choice():
    """Counting builds an unsharded abstract model: a mesh's MoE buffer factor (the goal
    row's ``moe_buffer_factor=2``) neither warns there nor changes the counts."""
    from zoo.models.deepseek_v4 import DeepSeekV4Config
    plain = DeepSeekV4Config.mini()
    buffered = dataclasses.replace(plain, moe_buffer_factor=2.0, moe_overflow="drop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert buffered.num_params() == plain.num_params()
        assert buffered.flops_per_token(256) == plain.flops_per_token(256)
    assert buffered.for_counting().moe_buffer_factor is None

def test_dense_only_model_has_empty_expert_counts():
    cfg = DeepSeek3Config.mini(num_hidden_layers=1, first_k_dense_replace=1, vocab_size=64)
    model = DeepSeek3.abstract(cfg, inputs_shape=(1, 8))
    logits, aux = nnx.eval_shape(lambda m, t: m(t), model, jnp.zeros((1, 8), jnp.int32))
    assert logits.shape == (1, 8, 64) and model.num_moe_layers == 0
    assert aux["expert_counts"].shape == (0, 16) and aux["load_balance_loss"].shape == ()
    D, F = cfg.hidden_size, cfg.intermediate_size  # no expert weights at all
    assert count_params(model) == cfg.num_params() == 2 * 64 * D + D + count_params(
        model.layers[0].self_attn) + 3 * D * F + 2 * D


@pytest.mark.parametrize("make,match", [
    (lambda: MixtralConfig.mini(num_key_value_heads=3), "num_key_value_heads=3"),
    (lambda: MixtralConfig.mini(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (lambda: MixtralConfig.mini(remat_policy="sometimes"), "remat_policy='sometimes'"),
    (lambda: MixtralConfig.mini(hidden_size=0), "hidden_size=0"),
    (lambda: DeepSeek3Config.mini(num_key_value_heads=2), "num_key_value_heads=2"),
    (lambda: DeepSeek3Config.mini(first_k_dense_replace=9), "first_k_dense_replace=9"),
    (lambda: DeepSeek3Config.mini(dtype=jnp.int32), "dtype=int32"),
    (lambda: Mixtral(TINY_MIXTRAL, inputs_shape=(2,), rngs=nnx.Rngs(0)), "inputs_shape"),
    (lambda: Mixtral(TINY_MIXTRAL, decoder_layer_cls=MLA, rngs=nnx.Rngs(0)),
     "decoder_layer_cls"),
    (lambda: Mixtral({"hidden_size": 8}, rngs=nnx.Rngs(0)), "must be a zoo.models.DecoderConfig"),
    (lambda: MixtralConfig.mini(tie_word_embeddings="yes"), "tie_word_embeddings='yes'"),
    (lambda: MixtralConfig.mini(moe_buffer_factor=0), "moe_buffer_factor=0"),
])
def test_validation_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_layer_errors_surface_at_construction(devices):
    from zoo.partitioning import Partitioner, make_mesh
    p = Partitioner(make_mesh(context=8), "cp")
    with pytest.raises(ValueError, match="divisible"):  # 12 tokens cannot be cut in 16 chunks
        nnx.eval_shape(lambda: Mixtral(TINY_MIXTRAL, inputs_shape=(1, 12), partitioner=p,
                                       rngs=nnx.Rngs(0)))


class GatedLayer(MixtralDecoderLayer):
    attention_cls = type("GatedAttention", (Attention,), {})


def test_swap_through_the_class_attribute():
    class GatedMixtral(Mixtral):
        decoder_layer_cls = GatedLayer

    model = GatedMixtral.abstract(TINY_MIXTRAL, inputs_shape=(2, 16))
    assert all(type(layer.self_attn) is GatedLayer.attention_cls for layer in model.layers)


def test_zoo_only_fields_are_declared_once():
    """The zoo-only fields come from DecoderConfig (a redeclared default stays zoo-only);
    config.json carries every other field."""
    shared = {"dtype", "param_dtype", "remat_policy", "scan_layers", "attention_implementation",
              "attention_layout",
              "capacity_factor", "moe_dispatch", "moe_grouped_matmul", "moe_buffer_factor",
              "moe_overflow", "fp8"}
    assert zoo_only_fields(DecoderConfig) == shared
    own = {MixtralConfig: set(), DeepSeek3Config: {"mtp_loss_weight", "mla_kv_wire"}}
    for cls, extra in own.items():  # a family's own zoo-only fields (DeepSeek's MTP)
        assert zoo_only_fields(cls) == shared | extra
        written = set(cls.mini().to_hf_config())
        fields = {f.name for f in dataclasses.fields(cls)}
        # (config.json's "dtype" is transformers' storage dtype, written from param_dtype)
        assert fields - written == (shared | extra) - {"dtype"} | (
            {"rope_theta", "rope_scaling"} & fields)
        assert cls.from_hf_config({**cls.mini().to_hf_config(), "dtype": "bfloat16"}).dtype \
            == jnp.float32

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Redeclared(MixtralConfig):
        remat_policy: str | None = "full"  # a new default, no zoo_field(): still zoo-only
        my_kernel: str = zoo_field("fast")

    assert zoo_only_fields(Redeclared) == shared | {"my_kernel"}
    raw = Redeclared().to_hf_config()
    assert "remat_policy" not in raw and "my_kernel" not in raw
    assert Redeclared.from_hf_config({**raw, "my_kernel": "x"}).my_kernel == "fast"


def test_deepseek_layer_classes():
    model = DeepSeek3.abstract(DeepSeek3Config.mini())
    assert isinstance(model.layers[0], DeepSeek3DecoderLayer)
    assert isinstance(model.layers[0].self_attn, MLA)
    assert not model.layers[0].is_moe and model.layers[1].is_moe and model.num_moe_layers == 2
