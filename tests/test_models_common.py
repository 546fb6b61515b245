"""Model-level behaviour shared by Mixtral and DeepSeek-V3 (no Hugging Face reference needed).

* Parameter counts of the full presets via `nnx.eval_shape` against the published numbers and
  an independent closed-form count; `flops_per_token` against a hand count.
* Subclassing: a decoder layer with a custom attention (a learnable per-head gate) is used by
  the model and trains one SGD step (loss falls, the new parameter gets a gradient).
* `remat_policy` changes nothing numerically (logits and gradients).
* Config and constructor validation errors name the value and the fix.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zoo.layers.attention import Attention
from zoo.layers.mla import MLA
from zoo.models import count_params
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config, DeepSeek3DecoderLayer
from zoo.models.mixtral import Mixtral, MixtralConfig, MixtralDecoderLayer

TINY_MIXTRAL = MixtralConfig.mini(vocab_size=64, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8)


def mixtral_formula(c: MixtralConfig) -> int:
    D, H = c.hidden_size, c.head_dim
    attn = D * H * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    moe = c.num_local_experts * (3 * D * c.intermediate_size + D)
    return c.num_hidden_layers * (attn + moe + 2 * D) + 2 * c.vocab_size * D + D


def deepseek_formula(c: DeepSeek3Config) -> int:
    D, N = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = D * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * N * qk
    kv = D * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + \
        c.kv_lora_rank * N * (c.qk_nope_head_dim + c.v_head_dim)
    attn = q + kv + N * c.v_head_dim * D + 2 * D
    dense = 3 * D * c.intermediate_size
    moe = (c.n_routed_experts + c.n_shared_experts) * 3 * D * c.moe_intermediate_size \
        + c.n_routed_experts * D
    k = c.first_k_dense_replace
    return c.num_hidden_layers * attn + k * dense + (c.num_hidden_layers - k) * moe \
        + 2 * c.vocab_size * D + D


@pytest.mark.parametrize("config,expected", [
    (MixtralConfig.mixtral_8x7b(), 46_702_792_704),
    (MixtralConfig.mixtral_8x22b(), 140_630_071_296),
    (DeepSeek3Config.deepseek_v3(), 671_026_404_352),
], ids=["mixtral_8x7b", "mixtral_8x22b", "deepseek_v3"])
def test_full_preset_parameter_counts(config, expected):
    formula = mixtral_formula if isinstance(config, MixtralConfig) else deepseek_formula
    assert formula(config) == expected
    assert config.num_params() == expected  # nnx.eval_shape: no memory


def test_mini_presets_are_small_and_family_shaped():
    m, d = MixtralConfig.mini(), DeepSeek3Config.mini()
    assert m.num_params() == mixtral_formula(m) and d.num_params() == deepseek_formula(d)
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
    d = DeepSeek3Config.deepseek_v3()
    assert 36e9 < d.active_matmul_params() < 38e9  # "37B activated"
    assert d.flops_per_token(4096, causal=False) > d.flops_per_token(4096)


class GatedAttention(Attention):
    """Attention with a learnable per-head output gate: overrides one step, adds one param."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head_gate = nnx.Param(jnp.zeros((self.num_heads,)))

    def out(self, o):
        return super().out(o * (1 + jnp.tanh(self.head_gate[...]))[:, None])


class GatedLayer(MixtralDecoderLayer):
    attention_cls = GatedAttention


def _sgd_step(model, tokens, lr=0.5):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(lr)

    def loss_fn(params):
        logits, aux = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return ce + 0.01 * aux["load_balance_loss"]

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    new, opt_state, loss0, grads = step(params, tx.init(params))
    _, _, loss1, _ = step(new, opt_state)
    return nnx.merge(graphdef, new, rest), float(loss0), float(loss1), grads


def test_subclassed_attention_is_used_and_trains():
    model = Mixtral(TINY_MIXTRAL, inputs_shape=(2, 16), decoder_layer_cls=GatedLayer,
                    rngs=nnx.Rngs(0))
    assert all(isinstance(layer.self_attn, GatedAttention) for layer in model.layers)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 17)))
    trained, loss0, loss1, grads = _sgd_step(model, tokens)
    assert loss1 < loss0
    g = np.asarray(grads["layers"][0]["self_attn"]["head_gate"][...])
    assert np.abs(g).max() > 0
    np.testing.assert_array_equal(
        np.asarray(trained.layers[0].self_attn.head_gate[...]), -0.5 * g)

    class GatedMixtral(Mixtral):  # the same swap through the model's class attribute
        decoder_layer_cls = GatedLayer

    m2 = GatedMixtral(TINY_MIXTRAL, inputs_shape=(2, 16), rngs=nnx.Rngs(0))
    assert isinstance(m2.layers[-1].self_attn, GatedAttention)


def test_remat_matches_no_remat():
    cfg = DeepSeek3Config.mini(num_hidden_layers=2, vocab_size=64, hidden_size=32,
                               intermediate_size=64, moe_intermediate_size=16, kv_lora_rank=16,
                               q_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
                               n_group=4, topk_group=2)
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 64, (2, 16)))
    results = []
    for policy in (None, "full"):
        model = DeepSeek3(dataclasses.replace(cfg, remat_policy=policy), inputs_shape=(2, 16),
                          rngs=nnx.Rngs(3))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, graphdef=graphdef, rest=rest):
            logits, aux = nnx.merge(graphdef, params, rest)(tokens)
            return jnp.mean(logits ** 2) + aux["load_balance_loss"], logits

        fn = jax.value_and_grad(loss, has_aux=True)
        # the remat policy really wraps the layers in a checkpoint
        # (tokamax's grouped matmul, traced for accelerators, brings its own `remat_opt`)
        jaxpr = str(jax.make_jaxpr(fn)(params)).replace("remat_opt", "")
        assert ("remat" in jaxpr) == (policy is not None)
        (_, logits), grads = jax.jit(fn)(params)
        results.append((logits, grads))
    (l0, g0), (l1, g1) = results
    np.testing.assert_allclose(l0, l1, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_dense_only_model_has_empty_expert_counts():
    cfg = DeepSeek3Config.mini(num_hidden_layers=1, first_k_dense_replace=1, vocab_size=64)
    model = DeepSeek3(cfg, inputs_shape=(1, 8), rngs=nnx.Rngs(0))
    logits, aux = jax.eval_shape(lambda m, t: m(t), model, jnp.zeros((1, 8), jnp.int32))
    assert logits.shape == (1, 8, 64) and model.num_moe_layers == 0
    assert aux["expert_counts"].shape == (0, 16) and aux["load_balance_loss"].shape == ()
    assert count_params(model) == deepseek_formula(cfg)


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


def test_deepseek_layer_classes():
    model = DeepSeek3.abstract(DeepSeek3Config.mini())
    assert isinstance(model.layers[0], DeepSeek3DecoderLayer)
    assert isinstance(model.layers[0].self_attn, MLA)
    assert not model.layers[0].is_moe and model.layers[1].is_moe and model.num_moe_layers == 2
