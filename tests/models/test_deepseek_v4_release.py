"""DeepSeek-V4 checkpoints in DeepSeek's release layout (`zoo.models.deepseek_v4`):

* `zoo.models.hf_quant.dequantize_fp4` against a decode of the e2m1 bits written here (every byte,
  so all 16 codes in both nibbles, int8 and uint8 storage, ue8m0 and float scales);
* a synthetic release checkpoint written here (raw safetensors: ``embed.weight``,
  ``layers.{i}.attn.kv_norm.weight``, ``hc_head_fn``, ...; the attention, indexer, shared
  expert and MTP projections FP8 e4m3 with a ue8m0 ``X.scale`` per block, partial edge
  blocks included; the routed experts FP4 e2m1 packed two a byte with a ue8m0 scale per 32
  inputs, all quantised by the plain quantiser below) loads into exactly the model that the
  same values, dequantised here, give in transformers' names (forward equal), each weight
  within the quantiser's error of the value it was made from;
* from_hf -> to_hf (either layout) -> from_hf keeps every parameter;
* the release names are transformers' own: transformers' ``from_pretrained`` reads the
  release layout zoo writes into the same module state as the transformers layout;
* a quantised weight without its scale, a scale of the wrong shape, a NaN scale: errors that
  name the tensors.
"""

from __future__ import annotations

import json
import re
import struct
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import zoo
from zoo.models import deepseek_v4 as v4
from zoo.models import hf, hf_quant

BLOCK = (16, 24)  # FP8 blocks: several per tensor at mini sizes, partial ones at the edges
FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|\.shared_experts\.w[123]|"
                 r"\.[eh]_proj)\.weight$")
FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def e2m1(code: int) -> float:
    """The value of a 4-bit e2m1 code from its bits: sign, 2 exponent bits (bias 1), 1
    mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def ue8m0(byte: int) -> float:
    return 2.0 ** (int(byte) - 127)


def decode_fp4(packed, scale_bytes):
    """A table lookup: byte j of a row holds inputs 2j (low nibble) and 2j+1 (high nibble),
    each the `e2m1` value of its code times the ue8m0 scale of its run of inputs."""
    table = np.array([e2m1(c) for c in range(16)], np.float32)
    codes = np.asarray(packed).view(np.uint8)
    values = np.stack([table[codes & 15], table[codes >> 4]], -1).reshape(len(codes), -1)
    scales = 2.0 ** (scale_bytes.astype(np.float64) - 127)
    return (values * np.repeat(scales, values.shape[1] // scale_bytes.shape[1], 1)).astype(
        np.float32)


def test_fp4_decode_against_bit_decoding():
    rng = np.random.RandomState(0)
    packed = np.arange(256, dtype=np.uint8).reshape(4, 64)  # every byte: both nibbles, 16 codes
    scale = rng.randint(110, 140, (4, 4)).astype(np.uint8)  # 32 inputs a scale
    want = decode_fp4(packed, scale)
    assert sorted(set(np.abs(want / np.repeat([[ue8m0(s) for s in r] for r in scale], 32, 1))
                      .ravel())) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    np.testing.assert_array_equal(
        hf_quant.dequantize_fp4(packed, scale.view(ml_dtypes.float8_e8m0fnu)), want)
    np.testing.assert_array_equal(  # int8 storage (the release's I8), float32 scales
        hf_quant.dequantize_fp4(packed.view(np.int8),
                                np.vectorize(ue8m0)(scale).astype(np.float32)), want)
    stacked = np.stack([packed, packed[::-1]])  # leading axes pass through
    got = hf_quant.dequantize_fp4(stacked, np.stack([scale, scale[::-1]]).view(
        ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(got[1], decode_fp4(packed[::-1], scale[::-1]))
    with pytest.raises(ValueError, match="int8 or uint8"):
        hf_quant.dequantize_fp4(packed.astype(np.int32), scale)


# -- a plain quantiser and the synthetic release checkpoint -------------------------------------

def quantise_fp8(w, block):
    """e4m3 codes and ue8m0 exponent bytes, one per block (2^ceil(log2(amax / 448)))."""
    rows, cols = (-(-n // b) for n, b in zip(w.shape, block))
    codes = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    scale = np.zeros((rows, cols), np.uint8)
    for i in range(rows):
        for j in range(cols):
            tile = (slice(i * block[0], (i + 1) * block[0]),
                    slice(j * block[1], (j + 1) * block[1]))
            exp = int(np.ceil(np.log2(np.abs(w[tile]).max() / E4M3_MAX)))
            codes[tile] = (w[tile] / 2.0 ** exp).astype(ml_dtypes.float8_e4m3fn)
            scale[i, j] = exp + 127
    return codes, scale


def dequantise_fp8(codes, scale, block):
    out = codes.astype(np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= \
                ue8m0(scale[i, j])
    return out


def quantise_fp4(w):
    """e2m1 codes (the nearest value) packed two a byte, low nibble first, and a ue8m0
    exponent byte per 32 inputs of a row (2^ceil(log2(amax / 6)))."""
    rows, cols = w.shape
    runs = w.reshape(rows, cols // 32, 32)
    exp = np.ceil(np.log2(np.abs(runs).max(-1) / E2M1_MAX)).astype(np.int32)
    scaled = np.abs(runs) / 2.0 ** exp[..., None]
    values = np.array([e2m1(c) for c in range(8)])
    codes = np.argmin(np.abs(scaled[..., None] - values), -1).astype(np.uint8)
    codes = (codes | np.where(runs < 0, 8, 0)).reshape(rows, cols).astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8), (exp + 127).astype(np.uint8)


def write_safetensors(path, tensors):
    """The safetensors format by hand (numpy's writer has no FP8 / e8m0)."""
    names = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.int32): "I32", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
             np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0"}
    header, blobs, offset = {}, [], 0
    for key, arr in tensors.items():
        blob = np.ascontiguousarray(arr).tobytes()
        header[key] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                       "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text
                                             + b"".join(blobs))


def config():
    return v4.DeepSeekV4Config.mini(num_hidden_layers=2, layer_types=(v4.CSA, v4.HCA),
                                    num_nextn_predict_layers=1)


def original_values(model, rng):
    """Random values for every tensor of the release layout (norms near 1, distinct experts
    per token in the hash table)."""
    out = {}
    for key, (shape, _) in hf.expected_shapes(model, model.hf_layout_map("release")).items():
        if key.endswith("tid2eid"):
            e = model.config.n_routed_experts
            out[key] = np.stack([rng.permutation(e)[:shape[1]]
                                 for _ in range(shape[0])]).astype(np.int32)
        elif "norm" in key:
            out[key] = (1 + 0.1 * rng.randn(*shape)).astype(np.float32)
        else:
            out[key] = (0.1 * rng.randn(*shape)).astype(np.float32)
    out["embed.weight"] = out["embed.weight"].astype(ml_dtypes.bfloat16)  # as released
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The release checkpoint (quantised), the same values dequantised in transformers'
    names, the unquantised values in both layouts, and the keys the release holds."""
    cfg = config()
    model = v4.DeepSeekV4.abstract(cfg)
    original = original_values(model, np.random.RandomState(0))
    quantised, dequantised, kinds = {}, {}, {}
    for key, w in original.items():
        if FP8.search(key):
            codes, scale = quantise_fp8(w, BLOCK)
            quantised[key] = codes
            quantised[key[:-len("weight")] + "scale"] = scale.view(ml_dtypes.float8_e8m0fnu)
            dequantised[key], kinds[key] = dequantise_fp8(codes, scale, BLOCK), "fp8"
        elif FP4.search(key):
            packed, scale = quantise_fp4(w)
            quantised[key] = packed
            quantised[key[:-len("weight")] + "scale"] = scale.view(ml_dtypes.float8_e8m0fnu)
            dequantised[key], kinds[key] = decode_fp4(packed, scale), "fp4"
        else:
            quantised[key] = dequantised[key] = w
    assert set(kinds.values()) == {"fp8", "fp4"}
    assert any(k.startswith("mtp.0.") and v == "fp4" for k, v in kinds.items())
    # transformers' names for the same rows
    rename = {r: t for rel, tr in zip(model.hf_layout_map("release"),
                                      model.hf_layout_map("transformers"))
              for r, t in zip(rel.keys, tr.keys)}
    raw = {**cfg.to_hf_config(), "expert_dtype": "fp4",
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                   "activation_scheme": "dynamic",
                                   "weight_block_size": list(BLOCK)}}
    plain = cfg.to_hf_config()
    root = tmp_path_factory.mktemp("v4_release")
    folders = {"release": root / "release", "dequantised": root / "dequantised",
               "original": root / "original", "original_release": root / "original_release"}
    for name, tensors, names, cfg_json in (
            ("release", quantised, None, raw),
            ("dequantised", dequantised, rename, plain),
            ("original", original, rename, plain),
            ("original_release", original, None, plain)):
        write_safetensors(folders[name], {names[k] if names else k: v
                                          for k, v in tensors.items()})
        (folders[name] / "config.json").write_text(json.dumps(cfg_json))
    return dict(folders=folders, kinds=kinds, keys=set(quantised), rename=rename,
                original=original)


def flat(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def assert_same_params(a, b):
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for p in fa:
        np.testing.assert_array_equal(fa[p], fb[p], err_msg=".".join(map(str, p)))


def test_release_checkpoint_loads_dequantised(release):
    folders = release["folders"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor taken: no scale left over, no MTP fresh
        hf.check_checkpoint(folders["release"], lambda: v4.DeepSeekV4(config(),
                                                                     rngs=nnx.Rngs(0)))
        model = zoo.models.from_hf(folders["release"])  # dispatches on model_type
    assert isinstance(model, v4.DeepSeekV4)
    assert v4.checkpoint_layout(hf.CheckpointReader(folders["release"]).keys()) == "release"
    reference = v4.from_hf(folders["dequantised"])  # transformers' names, float32
    assert_same_params(model, reference)
    # the quantisation error is what the plain quantiser allows: FP8 half a step (1/16 of the
    # block's power-of-two scale at most), FP4 a step of 2 at the top
    got = hf.CheckpointReader(folders["release"], block_size=BLOCK)
    for key, kind in release["kinds"].items():
        w = release["original"][key]
        err = np.abs(got.get(key) - w).max() / np.abs(w).max()
        assert err <= (2.0 ** -4 if kind == "fp8" else 1 / 3), (key, err)
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 264, (1, 32)))
    forward = nnx.jit(lambda m, t: m(t)[0])
    logits, want = forward(model, tokens), forward(reference, tokens)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))


def test_round_trip_in_either_layout(release, tmp_path):
    model = v4.from_hf(release["folders"]["release"])
    v4.to_hf(model, tmp_path / "release", layout="release")
    written = hf.CheckpointReader(tmp_path / "release")
    assert set(written.keys()) == {k for k in release["keys"] if not k.endswith(".scale")}
    assert "quantization_config" not in json.loads((tmp_path / "release" / "config.json")
                                                   .read_text())
    assert_same_params(v4.from_hf(tmp_path / "release"), model)
    v4.to_hf(model, tmp_path / "transformers")
    assert set(hf.CheckpointReader(tmp_path / "transformers").keys()) == \
        {release["rename"][k] for k in written.keys()}
    assert_same_params(v4.from_hf(tmp_path / "transformers"), model)
    with pytest.raises(ValueError, match=r"layout='deepseek' is not one of \('transformers', "
                                         r"'release'\)"):
        v4.to_hf(model, tmp_path / "x", layout="deepseek")


def test_release_names_are_what_transformers_reads(release):
    """transformers' own conversion (``conversion_mapping``: DeepSeek's names -> its modules)
    reads the release layout into the state it reads the transformers layout into."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folders = release["folders"]
    states = []
    for name in ("original_release", "original"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folders[name], output_loading_info=True, dtype=torch.float32)
        assert not info["missing_keys"] and not info["mismatched_keys"], (name, info)
        states.append(model.state_dict())
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0, msg=key)
    # the release's names do not all coincide with transformers' layout (else this is void)
    assert release["keys"] & set(release["rename"].values()) <= {
        k for k in release["rename"] if k.startswith(("mtp.", "head."))}


def test_release_key_names():
    """The names of DeepSeek's inference/model.py module tree (``Transformer``: ``embed``,
    ``layers[i]`` blocks with ``attn`` / ``ffn`` / ``attn_norm`` / ``hc_attn_fn``, ``norm``,
    ``head``, ``hc_head_fn``); transformers' conversion reads the attention's ``kv_norm``
    under either spelling, so it is pinned here."""
    model = v4.DeepSeekV4.abstract(config())
    keys = {k for row in model.hf_layout_map("release") for k in row.keys}
    assert {"embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base",
            "hc_head_scale", "layers.0.attn.kv_norm.weight", "layers.0.attn.q_norm.weight",
            "layers.0.attn.wo_a.weight", "layers.0.attn.attn_sink",
            "layers.0.attn.compressor.norm.weight", "layers.0.attn.compressor.ape",
            "layers.0.attn.indexer.compressor.wgate.weight", "layers.0.attn.indexer.wq_b.weight",
            "layers.0.attn.indexer.weights_proj.weight", "layers.0.ffn.gate.tid2eid",
            "layers.1.ffn.gate.bias", "layers.1.ffn.experts.7.w2.weight",
            "layers.1.ffn.shared_experts.w3.weight", "layers.1.attn_norm.weight",
            "layers.1.hc_ffn_scale", "mtp.0.attn.kv_norm.weight", "mtp.0.hc_head_fn",
            "mtp.0.e_proj.weight"} <= keys
    assert not [k for k in keys if k.startswith("model.") or ".attn.norm." in k]
    assert v4.release_key("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"


# -- errors ------------------------------------------------------------------------------------

def _one(tmp_path, tensors):
    write_safetensors(tmp_path, tensors)
    return hf.CheckpointReader(tmp_path, block_size=(16, 16))


def test_bad_or_missing_scales_name_the_tensors(tmp_path):
    rng = np.random.RandomState(0)
    codes, scale = quantise_fp8(rng.randn(32, 32).astype(np.float32), (16, 16))
    e8m0 = scale.view(ml_dtypes.float8_e8m0fnu)
    reader = _one(tmp_path / "a", {"w.weight": codes})
    with pytest.raises(ValueError, match=r"'w.weight' is stored as F8_E4M3 \(FP8\) but has no "
                                         r"block scale beside it \('w.weight_scale_inv' or "
                                         r"'w.scale'\)"):
        reader.get("w.weight")
    reader = _one(tmp_path / "b", {"w.weight": codes, "w.scale": e8m0[:1]})
    with pytest.raises(ValueError, match=r"scale 'w.scale' of weight 'w.weight' has shape "
                                         r"\(1, 2\), expected \(2, 2\)"):
        reader.get("w.weight")
    nan = scale.copy()
    nan[1, 0] = 255  # ue8m0's NaN
    reader = _one(tmp_path / "c", {"w.weight": codes, "w.scale": nan.view(e8m0.dtype)})
    with pytest.raises(hf.BadCheckpoint, match=r"scale 'w.scale' of weight 'w.weight' holds 1 "
                                               r"value\(s\) that are not finite and positive"):
        reader.get("w.weight")
    packed, fp4_scale = quantise_fp4(rng.randn(4, 64).astype(np.float32))
    reader = _one(tmp_path / "d", {"e.weight": packed})
    with pytest.raises(ValueError, match=r"'e.weight' is stored as I8 \(packed FP4 e2m1\) but "
                                         r"has no block scale"):
        reader.shape("e.weight")
    reader = _one(tmp_path / "e", {"e.weight": packed, "e.scale": fp4_scale[:, :1].view(
        ml_dtypes.float8_e8m0fnu)})
    assert reader.shape("e.weight") == (4, 64)  # unpacked
    with pytest.raises(ValueError, match=r"scale 'e.scale' of weight 'e.weight' has shape "
                                         r"\(4, 1\), expected \(4, 2\) \(one per 32 inputs\)"):
        reader.get("e.weight")
    reader = _one(tmp_path / "f", {"e.weight": packed, "e.scale": fp4_scale.view(
        ml_dtypes.float8_e8m0fnu)})
    np.testing.assert_array_equal(reader.get("e.weight"), decode_fp4(packed, fp4_scale))
    norm = rng.randn(8).astype(np.float32)  # a float weight beside a parameter named scale
    reader = _one(tmp_path / "g", {"n.weight": norm, "n.scale": norm[:3]})
    np.testing.assert_array_equal(reader.get("n.weight"), norm)
