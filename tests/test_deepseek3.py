"""DeepSeek-V3 against Hugging Face transformers: a tiny random model saved with
`save_pretrained` (MLA with a query LoRA and YaRN, one dense layer, group-limited sigmoid
routing with a random `e_score_correction_bias`, a shared expert).

Logits (unsharded and under two partitioner strategies), gradients, each component (MLA,
dense MLP, MoE block and its routing counts, decoder layer), `to_hf` reloaded by transformers,
the legacy ``rope_theta``/``rope_scaling`` spelling and a block-FP8 checkpoint. Float32,
relative error < 1e-4 (observed ~1e-7).
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import saved_reference
from flax import nnx

from zoo.models import deepseek3
from zoo.partitioning import Partitioner, make_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

B, L, V, D = 4, 16, 64, 32
TOL = 1e-4
FORWARD = jax.jit(lambda model, tokens: model(tokens))
CALL = jax.jit(lambda module, x, **kw: module(x, **kw))
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
            mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def causal_mask(batch: int, length: int) -> "torch.Tensor":
    ok = np.tril(np.ones((length, length), bool))
    m = np.where(ok, 0.0, np.finfo(np.float32).min)[None, None]
    return torch.tensor(np.broadcast_to(m, (batch, 1, length, length)).copy(),
                        dtype=torch.float32)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=D, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=1, max_position_embeddings=32, rope_parameters=dict(YARN))
    return saved_reference(cfg, tmp_path_factory, "deepseek3_hf", batch=B, length=L,
                           bias_scale=0.05)


@pytest.fixture(scope="module")
def zoo_model(ref):
    return deepseek3.from_hf(ref.path)


def test_config_and_layout(ref, zoo_model):
    c = zoo_model.config
    assert (c.q_lora_rank, c.first_k_dense_replace, c.n_group, c.topk_group) == (16, 1, 4, 2)
    assert c.rope_scaling.factor == 4.0 and c.rope_scaling.mscale_all_dim == 1.0
    assert [zoo_model.layer(i).is_moe for i in range(3)] == [False, True, True]
    assert [(la.stack_size, la.is_moe) for la in zoo_model.layers] == [(1, False), (2, True)]
    bias = np.asarray(zoo_model.layer(2).mlp.e_score_correction_bias[...])
    np.testing.assert_array_equal(
        bias, ref.model.model.layers[2].mlp.gate.e_score_correction_bias.numpy())
    assert np.abs(bias).max() > 0


def test_logits_unsharded(ref, zoo_model):
    logits, aux = FORWARD(zoo_model, jnp.asarray(ref.tokens))
    assert rel_err(logits, ref.logits) < TOL
    counts = np.asarray(aux["expert_counts"])
    assert counts.shape == (2, 8) and (counts.sum(1) == B * L * 3).all()


@pytest.mark.parametrize("mesh,strategy,inputs_shape", [
    (dict(fsdp=2, expert=2, context=2), "ep_as_cp", None),
    (dict(data=2, context=4), "cp", (B, L)),
], ids=["ep_as_cp", "cp"])
def test_logits_sharded(ref, devices, mesh, strategy, inputs_shape):
    p = Partitioner(make_mesh(**mesh), strategy)
    model = deepseek3.from_hf(ref.path, partitioner=p, inputs_shape=inputs_shape)
    wo = model.layers[1].mlp.wo[...]  # the MoE stack: [layers, E, F, D], layers unsharded
    assert wo.sharding.is_equivalent_to(
        p.sharding(("layers", "experts", "mlp", "embed"), "moe"), 4)
    assert wo.addressable_shards[0].data.shape != wo.shape
    logits, _ = FORWARD(model, jnp.asarray(ref.tokens))
    assert rel_err(logits, ref.logits) < TOL


def test_mla_parity(ref, zoo_model):
    x = np.random.RandomState(1).randn(B, L, D).astype(np.float32)
    pos = np.broadcast_to(np.arange(L), (B, L))
    with torch.no_grad():
        pe = ref.model.model.rotary_emb(torch.tensor(x), torch.tensor(pos))
        want = ref.model.model.layers[0].self_attn(
            hidden_states=torch.tensor(x), position_embeddings=pe,
            attention_mask=causal_mask(B, L))[0].numpy()
    got = CALL(zoo_model.layer(0).self_attn, jnp.asarray(x), positions=jnp.asarray(pos))
    assert rel_err(got, want) < TOL


def test_dense_mlp_parity(ref, zoo_model):
    x = np.random.RandomState(2).randn(B, L, D).astype(np.float32)
    with torch.no_grad():
        want = ref.model.model.layers[0].mlp(torch.tensor(x)).numpy()
    assert rel_err(CALL(zoo_model.layer(0).mlp, jnp.asarray(x)), want) < TOL


def test_moe_block_parity_and_routing(ref, zoo_model):
    x = np.random.RandomState(3).randn(B, L, D).astype(np.float32)
    hf_moe = ref.model.model.layers[2].mlp
    with torch.no_grad():
        want = hf_moe(torch.tensor(x)).numpy()
        _, _, idx = hf_moe.gate(torch.tensor(x))
    got, aux = CALL(zoo_model.layer(2).mlp, jnp.asarray(x))
    assert rel_err(got, want) < TOL
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]),
                                  np.bincount(idx.numpy().ravel(), minlength=8))


def test_decoder_layer_parity(ref, zoo_model):
    x = np.random.RandomState(4).randn(B, L, D).astype(np.float32)
    pos = np.broadcast_to(np.arange(L), (B, L))
    with torch.no_grad():
        pe = ref.model.model.rotary_emb(torch.tensor(x), torch.tensor(pos))
        want = ref.model.model.layers[1](torch.tensor(x), attention_mask=causal_mask(B, L),
                                         position_ids=torch.tensor(pos), position_embeddings=pe)
        want = (want[0] if isinstance(want, tuple) else want).numpy()
    got, _ = CALL(zoo_model.layer(1), jnp.asarray(x), positions=jnp.asarray(pos))
    assert rel_err(got - x, want - x) < TOL  # the residual branch, not the skip


def test_gradients_match_torch(ref, zoo_model):
    """d sum(logits * R) / d params, zoo (jax.grad) vs transformers (autograd)."""
    r = np.random.RandomState(5).randn(B, L, V).astype(np.float32)
    graphdef, params, rest = nnx.split(zoo_model, nnx.Param, ...)

    def loss(params):
        logits, _ = nnx.merge(graphdef, params, rest)(jnp.asarray(ref.tokens))
        return jnp.sum(logits * r)

    g = nnx.merge(graphdef, jax.jit(jax.grad(loss))(params), rest)
    ref.model.zero_grad()
    (ref.model(torch.tensor(ref.tokens)).logits * torch.tensor(r)).sum().backward()
    tg = {n: p.grad.numpy() for n, p in ref.model.named_parameters()}
    at = g.layer(1).self_attn
    pairs = [
        (g.embed_tokens.embedding[...], tg["model.embed_tokens.weight"]),
        (at.q_b_proj.kernel[...].reshape(16, -1), tg["model.layers.1.self_attn.q_b_proj.weight"].T),
        (at.kv_b_proj.kernel[...].reshape(16, -1),
         tg["model.layers.1.self_attn.kv_b_proj.weight"].T),
        (at.kv_a_proj_with_mqa.kernel[...],
         tg["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].T),
        (at.kv_a_layernorm.scale[...], tg["model.layers.1.self_attn.kv_a_layernorm.weight"]),
        (g.layer(0).mlp.down.kernel[...], tg["model.layers.0.mlp.down_proj.weight"].T),
        (g.layer(2).mlp.router[...], tg["model.layers.2.mlp.gate.weight"].T),
        (g.layer(2).mlp.wo[...], tg["model.layers.2.mlp.experts.down_proj"].transpose(0, 2, 1)),
        (g.layer(2).mlp.shared_experts.up.kernel[...],
         tg["model.layers.2.mlp.shared_experts.up_proj.weight"].T),
    ]
    for got, want in pairs:
        assert rel_err(got, want) < TOL


def test_to_hf_round_trip(ref, tmp_path):
    """A zoo-initialised model (random bias and norms), written by to_hf, reloads in
    transformers with equal logits; from_hf reads back every variable exactly."""
    cfg = deepseek3.DeepSeek3Config.from_hf_config(ref.config.to_dict())
    model = deepseek3.DeepSeek3(cfg, rngs=nnx.Rngs(7))
    for layer in model.layers:
        key = jax.random.key(layer.layer_idx)
        layer.input_layernorm.scale[...] = 1 + 0.3 * jax.random.normal(key, (D,))
        if layer.is_moe:
            layer.mlp.e_score_correction_bias[...] = 0.05 * jax.random.normal(key, (8,))
    tokens = np.random.RandomState(6).randint(0, V, (B, L))
    logits, _ = FORWARD(model, jnp.asarray(tokens))
    deepseek3.to_hf(model, tmp_path / "out", max_shard_bytes=60_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    assert rel_err(logits, want) < TOL
    back = deepseek3.from_hf(tmp_path / "out")
    for x, y in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_legacy_rope_spelling(ref, zoo_model, tmp_path):
    """Published DeepSeek-V3 config.json: rope_theta + rope_scaling {"type": "yarn", ...}."""
    legacy = tmp_path / "legacy"
    shutil.copytree(ref.path, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type")
    cfg["rope_scaling"] = {"type": "yarn", **rope}
    cfg.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    (legacy / "config.json").write_text(json.dumps(cfg))
    model = deepseek3.from_hf(legacy)
    assert model.config == zoo_model.config
    logits, _ = FORWARD(model, jnp.asarray(ref.tokens))
    assert rel_err(logits, ref.logits) < TOL


def test_fp8_block_quantised_checkpoint(ref, zoo_model, tmp_path):
    """DeepSeek's FP8 release: e4m3 weights with a per-block ``weight_scale_inv``."""
    from safetensors.torch import load_file, save_file
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    block = 8
    tensors = load_file(str(ref.path / "model.safetensors"))
    expected = {}
    for key in list(tensors):
        w = tensors[key]
        if not ("self_attn" in key or "experts" in key) or "norm" in key:
            continue
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        scale = torch.rand(rows, cols) * 0.01 + 0.005
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0],
                                                                             :w.shape[1]]
        q = (w / full).to(torch.float8_e4m3fn)
        tensors[key], tensors[key + "_scale_inv"] = q, scale
        expected[key] = q.float() * full  # the independent dequantisation
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ref.path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "weight_block_size": [block, block]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    model = deepseek3.from_hf(fp8)
    got = np.asarray(model.layer(1).self_attn.kv_b_proj.kernel[...]).reshape(16, -1)
    np.testing.assert_allclose(got, expected["model.layers.1.self_attn.kv_b_proj.weight"].T,
                               rtol=1e-6)
    got = np.asarray(model.layer(2).mlp.wi_up[...])[5]
    np.testing.assert_allclose(got, expected["model.layers.2.mlp.experts.5.up_proj.weight"].T,
                               rtol=1e-6)
    # quantisation error only: the model still tracks the float32 reference
    logits, _ = FORWARD(model, jnp.asarray(ref.tokens))
    assert rel_err(logits, ref.logits) < 0.1
