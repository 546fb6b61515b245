"""`zoo.models.hf`: config.json handling, rope spellings, the safetensors reader/writer (FP8
blocks included), errors.

The rotary conversion is checked against transformers' own YaRN implementation
(`ROPE_INIT_FUNCTIONS["yarn"]`) for both spellings and the defaults it fills in.
"""

import dataclasses
import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from zoo.models import deepseek3, hf, mixtral

TINY = mixtral.MixtralConfig.mini(vocab_size=64, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A zoo-written Mixtral checkpoint (no torch needed)."""
    model = mixtral.Mixtral(TINY, rngs=nnx.Rngs(0))
    path = tmp_path_factory.mktemp("tiny_mixtral")
    mixtral.to_hf(model, path)
    return model, path


# -- config.json ---------------------------------------------------------------------------

def test_folder_without_config_json(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json"):
        mixtral.from_hf(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        deepseek3.from_hf(tmp_path / "nowhere")


def test_unsupported_and_wrong_model_type(tmp_path, tiny_ckpt):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        mixtral.from_hf(tmp_path)
    with pytest.raises(ValueError, match=r"model_type='mixtral'.*deepseek3\.from_hf"):
        deepseek3.from_hf(tiny_ckpt[1])


def test_unsupported_features_are_refused():
    base = mixtral.MixtralConfig.mini().to_hf_config()
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        mixtral.MixtralConfig.from_hf_config({**base, "hidden_act": "gelu"})
    assert mixtral.MixtralConfig.from_hf_config(
        {**base, "tie_word_embeddings": True}).tie_word_embeddings  # supported now
    ds = deepseek3.DeepSeek3Config.mini().to_hf_config()
    with pytest.raises(ValueError, match="attention_bias=True"):
        deepseek3.DeepSeek3Config.from_hf_config({**ds, "attention_bias": True})
    with pytest.raises(ValueError, match="rope type 'linear'"):
        deepseek3.DeepSeek3Config.from_hf_config(
            {**ds, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})


@pytest.mark.parametrize("config", [
    mixtral.MixtralConfig.mixtral_8x7b(), mixtral.MixtralConfig.mixtral_8x22b(),
    mixtral.MixtralConfig.mini(sliding_window=128), deepseek3.DeepSeek3Config.deepseek_v3(),
    deepseek3.DeepSeek3Config.mini(q_lora_rank=None, rope_scaling=None),
], ids=["8x7b", "8x22b", "mixtral_mini", "deepseek_v3", "deepseek_mini_plain"])
def test_config_round_trip_through_transformers(config):
    """to_hf_config -> transformers config object -> its dict -> from_hf_config: same config."""
    transformers = pytest.importorskip("transformers")
    raw = config.to_hf_config()
    hf_config = transformers.AutoConfig.for_model(**raw)
    back = type(config).from_hf_config(hf_config.to_dict())
    assert back == without_remat(config)


def without_remat(config):
    """config.json does not carry zoo-only fields (the full presets set some: remat "full",
    DeepSeek-V3's exact MoE buffers): each back at the class default."""
    from zoo.models.config import ZOO_ONLY
    return dataclasses.replace(config, **{
        f.name: f.default for f in dataclasses.fields(config) if f.metadata.get(ZOO_ONLY)})


def test_published_mixtral_8x7b_config_json():
    raw = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
           "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
           "initializer_range": 0.02, "intermediate_size": 14336,
           "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
           "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
           "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
           "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
           "vocab_size": 32000}
    assert mixtral.MixtralConfig.from_hf_config(raw) == without_remat(
        mixtral.MixtralConfig.mixtral_8x7b())


def test_published_deepseek_v3_config_json():
    """The published config.json (legacy spelling, FP8 quantisation, MTP layer count)."""
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
           "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
           "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
           "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
           "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
           "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
           "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
           "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                   "quant_method": "fp8", "weight_block_size": [128, 128]},
           "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                            "type": "yarn"},
           "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
           "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
           "v_head_dim": 128, "vocab_size": 129280}
    cfg = deepseek3.DeepSeek3Config.from_hf_config(raw)
    # the published model trains with one MTP layer, as the preset does
    assert cfg.num_nextn_predict_layers == 1
    # the published config.json, read: the preset less its zoo-only choices (remat, MoE buffers)
    assert cfg == deepseek3.DeepSeek3Config.deepseek_v3(
        aux_loss_alpha=0.001, remat_policy=None, moe_buffer_factor=None, moe_overflow="auto")


# -- rope settings against transformers' YaRN ---------------------------------------------------

@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
    {"rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 8.0,
                                             "original_max_position_embeddings": 512}},
    # mscale_all_dim without mscale: transformers ignores mscale_all_dim for cos/sin
    {"rope_scaling": {"rope_type": "yarn", "factor": 16.0, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 2048, "beta_fast": 16}},
], ids=["v5_deepseek", "legacy", "no_mscale"])
def test_yarn_matches_transformers(rope):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    raw = {**deepseek3.DeepSeek3Config.mini().to_hf_config(), "max_position_embeddings": 8192}
    raw.pop("rope_parameters")
    raw.update(rope)
    theta, yarn = hf.rope_from_hf(raw, default_theta=10000.0, what="test")
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in raw.items()
                                              if k not in ("architectures", "model_type")})
    with torch.no_grad():
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    dim = raw["qk_rope_head_dim"]
    np.testing.assert_allclose(yarn.inv_freq(dim, theta), inv_freq.numpy(), rtol=1e-6)
    assert yarn.cos_sin_factor() == pytest.approx(attention_factor, rel=1e-7)
    # and it survives the trip through our config.json spelling
    assert hf.rope_from_hf({"rope_parameters": hf.rope_to_hf(theta, yarn)},
                           default_theta=0.0, what="test") == (theta, yarn)


def test_rope_default_spellings():
    assert hf.rope_from_hf({"rope_theta": 5e5}, default_theta=1.0, what="t") == (5e5, None)
    assert hf.rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}},
                           default_theta=1.0, what="t") == (7.0, None)
    assert hf.rope_from_hf({}, default_theta=1e6, what="t") == (1e6, None)
    # YaRN without a factor (older configs): max_position_embeddings / original
    _, yarn = hf.rope_from_hf({"max_position_embeddings": 8192, "rope_scaling": {
        "type": "yarn", "original_max_position_embeddings": 1024}}, default_theta=1.0, what="t")
    assert yarn.factor == 8.0 and yarn.original_max_position_embeddings == 1024


# -- safetensors reader / writer ----------------------------------------------------------------

def test_save_and_read_shards(tmp_path):
    rng = np.random.RandomState(0)
    tensors = {f"t{i}": rng.randn(16, 8 + i).astype(np.float32) for i in range(5)}
    tensors["bf16"] = rng.randn(4, 4).astype(ml_dtypes.bfloat16)
    hf.save_checkpoint(tmp_path, tensors.items(), {"model_type": "x"}, max_shard_bytes=1200)
    index = json.loads((tmp_path / hf.INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 2
    reader = hf.CheckpointReader(tmp_path)
    assert sorted(reader.keys()) == sorted(tensors)
    for key, value in tensors.items():
        got = reader.get(key)
        assert got.dtype == value.dtype
        np.testing.assert_array_equal(got, value)
    # rewriting as one file removes the stale index
    hf.save_checkpoint(tmp_path, list(tensors.items())[:1], {"model_type": "x"})
    assert not (tmp_path / hf.INDEX_NAME).exists()


def test_fp8_dequantisation_by_blocks(tmp_path):
    """Reader dequantises e4m3 weights with per-(128x128)-block scales; edge blocks partial."""
    rng = np.random.RandomState(1)
    w = rng.randn(200, 300).astype(ml_dtypes.float8_e4m3fn)
    s = rng.rand(2, 3).astype(np.float32) + 0.5
    # safetensors.numpy cannot write float8: write the (simple) file format by hand
    header, blobs, offset = {}, [], 0
    for key, dtype, arr in (("w", "F8_E4M3", w), ("w_scale_inv", "F32", s)):
        blob = arr.tobytes()
        header[key] = {"dtype": dtype, "shape": list(arr.shape),
                       "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(text)) + text + b"".join(blobs))
    got = hf.CheckpointReader(tmp_path).get("w")
    rows, cols = np.arange(200)[:, None] // 128, np.arange(300)[None, :] // 128
    want = w.astype(np.float32) * s[rows, cols]  # element (i, j) uses block (i//128, j//128)
    np.testing.assert_array_equal(got, want)


def test_missing_tensor_and_shape_mismatch(tmp_path, tiny_ckpt):
    from safetensors.numpy import load_file, save_file
    _, path = tiny_ckpt
    tensors = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    broken = tmp_path / "missing"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in tensors.items() if "experts.3.w2" not in k},
              str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 2 tensor"):
        mixtral.from_hf(broken)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    save_file(tensors, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts.0.w1.weight: checkpoint \(48, 32\), "
                                         r"expected \(64, 32\) \(zoo .*mlp.wi_gate"):
        mixtral.from_hf(wrong)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        hf.CheckpointReader(tmp_path)


def test_from_hf_exact_and_bfloat16(tiny_ckpt):
    model, path = tiny_ckpt
    back = mixtral.from_hf(path)
    for x, y in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    mixed = mixtral.from_hf(path, dtype=jnp.bfloat16)  # bf16 compute, fp32 parameters
    assert mixed.config.dtype == jnp.bfloat16 and mixed.config.param_dtype == jnp.float32
    assert mixed.layers[0].mlp.wi_gate[...].dtype == jnp.float32
    low = mixtral.from_hf(path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                          config_overrides={"remat_policy": "full"})
    assert low.config.param_dtype == jnp.bfloat16 and low.config.remat_policy == "full"
    assert low.layers[0].mlp.wi_gate[...].dtype == jnp.bfloat16
    assert low.layers[0].mlp.router[...].dtype == jnp.float32  # the router stays float32
    np.testing.assert_array_equal(
        np.asarray(low.lm_head.kernel[...]),
        np.asarray(model.lm_head.kernel[...]).astype(jnp.bfloat16))
    assert os.path.exists(path / "config.json")


def test_fp8_block_quantised_checkpoint(tmp_path):
    """DeepSeek's FP8 release: e4m3 weights with a per-block ``weight_scale_inv``; from_hf
    dequantises each block (checked against an independent torch dequantisation)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file
    cfg = deepseek3.DeepSeek3Config.mini(num_hidden_layers=2, vocab_size=64, hidden_size=32,
                                         intermediate_size=64, moe_intermediate_size=16,
                                         kv_lora_rank=16, q_lora_rank=16, n_routed_experts=8,
                                         num_experts_per_tok=2, n_group=4, topk_group=2)
    deepseek3.to_hf(nnx.jit(lambda: deepseek3.DeepSeek3(cfg, rngs=nnx.Rngs(0)))(),
                    tmp_path / "f32")
    fp8, block = tmp_path / "fp8", 8
    fp8.mkdir()
    tensors = load_file(str(tmp_path / "f32" / "model.safetensors"))
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
        expected[key] = (q.float() * full).numpy()
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((tmp_path / "f32" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "weight_block_size": [block, block]}
    (fp8 / "config.json").write_text(json.dumps(raw))
    model = deepseek3.from_hf(fp8)
    got = np.asarray(model.layer(1).self_attn.kv_b_proj.kernel[...]).reshape(16, -1)
    np.testing.assert_allclose(got, expected["model.layers.1.self_attn.kv_b_proj.weight"].T,
                               rtol=1e-6)
    got = np.asarray(model.layer(1).mlp.wi_up[...])[5]
    np.testing.assert_allclose(got, expected["model.layers.1.mlp.experts.5.up_proj.weight"].T,
                               rtol=1e-6)
    np.testing.assert_array_equal(  # tensors without a scale are read as they are
        np.asarray(model.embed_tokens.embedding[...]),
        tensors["model.embed_tokens.weight"].numpy())


# -- faults: wrong shapes, unused tensors, damaged files -----------------------------------------

def _copy_ckpt(src, dst, edit=None, **save):
    """`src`'s tensors (edited by ``edit(dict)``) and config.json written to `dst`."""
    from safetensors.numpy import load_file
    tensors = {}
    for name in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(name)))
    if edit is not None:
        edit(tensors)
    hf.save_checkpoint(dst, tensors.items(), json.loads((src / "config.json").read_text()),
                       **save)
    return dst


def test_a_transposed_tensor_of_the_same_size_is_refused(tmp_path, tiny_ckpt):
    """The embedding [64, 32] saved as [32, 64]: refused, naming the key and both shapes."""
    def transpose(t):
        t["model.embed_tokens.weight"] = np.ascontiguousarray(t["model.embed_tokens.weight"].T)
    path = _copy_ckpt(tiny_ckpt[1], tmp_path / "t", transpose)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: checkpoint \(32, 64\), "
                                         r"expected \(64, 32\) \(zoo embed_tokens.embedding\)"):
        mixtral.from_hf(path)


def test_check_checkpoint_reads_headers_only(tmp_path, tiny_ckpt, monkeypatch):
    def make():
        return mixtral.Mixtral(TINY, rngs=nnx.Rngs(0))
    monkeypatch.setattr(hf.CheckpointReader, "get", lambda self, key: pytest.fail("read"))
    hf.check_checkpoint(tiny_ckpt[1], make)  # a good checkpoint passes
    def transpose(t):
        w = t["model.layers.1.self_attn.o_proj.weight"]  # [32, 32]: a reshape of it
        t["model.layers.1.self_attn.o_proj.weight"] = np.ascontiguousarray(w.reshape(16, 64))
    path = _copy_ckpt(tiny_ckpt[1], tmp_path / "r", transpose)
    with pytest.raises(ValueError, match=r"--from-hf x: 1 tensor\(s\) .*layers.1.self_attn."
                                         r"o_proj.weight: checkpoint \(16, 64\), expected "
                                         r"\(32, 32\)"):
        hf.check_checkpoint(path, make, what="--from-hf x")


def test_unused_tensors_are_named_in_a_warning(tmp_path, tiny_ckpt):
    def add(t):
        t["model.extra.weight"] = np.zeros((3,), np.float32)
    path = _copy_ckpt(tiny_ckpt[1], tmp_path / "x", add)
    with pytest.warns(UserWarning, match=r"ignoring 1 tensor\(s\) .*'model.extra.weight'"):
        model = mixtral.from_hf(path)
    np.testing.assert_array_equal(np.asarray(model.embed_tokens.embedding[...]),
                                  np.asarray(tiny_ckpt[0].embed_tokens.embedding[...]))


@pytest.mark.parametrize("fault,words", [
    ("shard", ["1 shard(s) that", "model.safetensors.index.json", "are missing",
               "model-00002-of-", "download the missing files"]),
    ("truncated", ["model-00002-of-", "is truncated", "download it again"]),
    ("header", ["model-00001-of-", "is not a readable safetensors file"]),
    ("config", ["config.json cannot be read as JSON", "download the checkpoint folder"]),
    ("config_list", ["config.json holds list, not a JSON object"]),
    ("index", ["model.safetensors.index.json cannot be read as JSON"]),
])
def test_damaged_files_are_named(tmp_path, tiny_ckpt, fault, words):
    path = _copy_ckpt(tiny_ckpt[1], tmp_path / "d", max_shard_bytes=20_000)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 2
    if fault == "shard":
        shards[1].unlink()
    elif fault == "truncated":
        shards[1].write_bytes(shards[1].read_bytes()[:-100])
    elif fault == "header":
        shards[0].write_bytes(b"\xff" * 8 + shards[0].read_bytes()[8:])
    elif fault == "config":
        (path / "config.json").write_text('{"model_type": "mixtral", ')
    elif fault == "config_list":
        (path / "config.json").write_text("[1]")
    else:
        (path / hf.INDEX_NAME).write_bytes(b"\x00garbage")
    with pytest.raises(ValueError) as e:
        mixtral.from_hf(path)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
