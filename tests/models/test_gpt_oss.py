"""gpt-oss beyond the conformance suite: MXFP4 checkpoints in the published layout, config
errors, the scanned runs of alternating layers."""

import functools
import json

import numpy as np
import pytest
from flax import nnx

from zoo.models import gpt_oss, hf


def fp4_value(code: int) -> float:
    """One e2m1 code from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, mant = (code >> 1) & 0b11, code & 1
    magnitude = mant * 0.5 if exp == 0 else (1 + mant * 0.5) * 2.0 ** (exp - 1)
    return sign * magnitude


def reference_dequant(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Element by element: value ``j`` of group ``g`` is nibble ``j % 2`` (low first) of byte
    ``j // 2``, times ``2 ** (scale - 127)``; the result transposed to ``[..., in, out]``."""
    *lead, rows, groups, _ = blocks.shape
    out = np.zeros((*lead, rows, groups * 32), np.float64)
    for index in np.ndindex(*lead, rows, groups):
        scale = 2.0 ** (int(scales[index]) - 127)
        for j in range(32):
            byte = int(blocks[index][j // 2])
            code = (byte >> 4) if j % 2 else (byte & 0x0F)
            out[(*index[:-1], index[-1] * 32 + j)] = fp4_value(code) * scale
    return np.swapaxes(out, -1, -2)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny gpt-oss written by zoo, its experts replaced by random MXFP4 tensors in the
    published layout (``*_blocks [E, out, in/32, 16]``, ``*_scales [E, out, in/32]``)."""
    from safetensors.numpy import save_file
    cfg = gpt_oss.GptOssConfig.mini(hidden_size=64, intermediate_size=32, num_local_experts=4,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2)
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    gpt_oss.to_hf(gpt_oss.GptOss(cfg, rngs=nnx.Rngs(0)), path)
    reader = hf.CheckpointReader(path)
    tensors = {k: reader.get(k) for k in reader.keys()}
    rng = np.random.RandomState(0)
    want = {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        E, n_in, n_out = tensors.pop(key).shape
        blocks = rng.randint(0, 256, (E, n_out, n_in // 32, 16)).astype(np.uint8)
        scales = rng.randint(120, 131, (E, n_out, n_in // 32)).astype(np.uint8)
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        want[key] = reference_dequant(blocks, scales)
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))
    return path, want


@pytest.mark.parametrize("scan", [True, False])
def test_mxfp4_experts_dequantize_element_for_element(mxfp4_checkpoint, scan):
    path, want = mxfp4_checkpoint
    model = gpt_oss.from_hf(path, config_overrides={"scan_layers": scan})
    for i in range(model.config.num_hidden_layers):
        moe = model.layer(i).mlp
        prefix = f"model.layers.{i}.mlp.experts"
        np.testing.assert_array_equal(np.asarray(moe.wi_gate_up.get_value()),
                                      want[f"{prefix}.gate_up_proj"].astype(np.float32))
        np.testing.assert_array_equal(np.asarray(moe.wo.get_value()),
                                      want[f"{prefix}.down_proj"].astype(np.float32))


def test_mxfp4_reader_lists_the_dequantized_tensor(mxfp4_checkpoint):
    path, want = mxfp4_checkpoint
    reader = hf.CheckpointReader(path)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert key in reader and key in reader.keys()
    assert not any(k.endswith(("_blocks", "_scales")) for k in reader.keys())
    assert reader.shape(key) == want[key].shape


def test_alternating_layers_scan_as_one_cycle():
    from zoo.models.stacks import layer_cycles
    cycles = functools.partial(layer_cycles, gpt_oss.GptOssDecoderLayer)
    cfg = gpt_oss.GptOssConfig.mini(layer_types=("sliding_attention", "sliding_attention",
                                                 "full_attention", "full_attention"))
    assert cycles(cfg, scan=True) == [(0, 2, 1), (2, 2, 1)]  # runs of one kind
    assert cycles(cfg, scan=False) == [(i, 1, 1) for i in range(4)]
    # alternating: one span of period 2 (two stacks scanned together), a trailing odd layer
    # alone; gpt-oss-120b's 36 layers are 18 cycles
    assert cycles(gpt_oss.GptOssConfig.mini(), scan=True) == [(0, 4, 2)]
    assert cycles(gpt_oss.GptOssConfig.mini(num_hidden_layers=5), scan=True) == \
        [(0, 4, 2), (4, 1, 1)]
    assert cycles(gpt_oss.GptOssConfig.gpt_oss_120b(), scan=True) == [(0, 36, 2)]
    s, f = "sliding_attention", "full_attention"
    mixed = gpt_oss.GptOssConfig.mini(num_hidden_layers=9, layer_types=(s, f, s, f, s, s, s, s, f))
    assert cycles(mixed, scan=True) == [(0, 4, 2), (4, 4, 1), (8, 1, 1)]
    model = gpt_oss.GptOss.abstract(gpt_oss.GptOssConfig.mini(num_hidden_layers=5))
    assert [(la.layer_idx, la.stack_size, la.stack_stride, la.self_attn.sliding_window)
            for la in model.layers] == [(0, 2, 2, 32), (1, 2, 2, None), (4, 1, 1, 32)]
    assert [list(model.layer_indices(la)) for la in model.layers] == [[0, 2], [1, 3], [4]]
    assert model.moe_rows() == [[0, 2], [1, 3], [4]]
    assert [cfg.window(i) for i in range(4)] == [32, 32, None, None]
    alternating = ("sliding_attention", "full_attention") * 2
    assert gpt_oss.GptOssConfig.mini().kinds == alternating
    assert gpt_oss.GptOssConfig.mini(layer_types=alternating).layer_types is None
    assert gpt_oss.GptOssConfig.mini(num_hidden_layers=3).kinds == alternating[:3]


@pytest.mark.parametrize("bad,match", [
    (dict(layer_types=("sliding_attention",)), "layer_types=.*each of the 4 layers"),
    (dict(layer_types=("local",) * 4), "layer_types=.*must name one of"),
    (dict(num_experts_per_tok=32), "num_experts_per_tok=32 exceeds num_local_experts=16"),
    (dict(swiglu_limit=0.0), "swiglu_limit=0.0 must be > 0"),
    (dict(sliding_window=0), "sliding_window=0 must be a positive int"),
])
def test_config_errors_name_the_value_and_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        gpt_oss.GptOssConfig.mini(**bad)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny gpt-oss (sliding window 3 / full, random sinks and biases) saved, packed rows
    with padding, and the unsharded logits and gradients on them."""
    from conformance import grads_by_path, perturbed, run
    cfg = gpt_oss.GptOssConfig.mini(vocab_size=64, hidden_size=32, intermediate_size=16,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=3)
    path = tmp_path_factory.mktemp("gpt_oss_windowed")
    gpt_oss.to_hf(perturbed(gpt_oss.GptOss(cfg, rngs=nnx.Rngs(0))), path)
    rng = np.random.RandomState(1)
    B, L = 4, 32
    tokens = rng.randint(0, 64, (B, L))
    positions, segments = np.zeros((B, L), int), np.zeros((B, L), int)
    for row, docs in enumerate([(5, 20, 7), (32,), (11, 9), (1, 2, 25)]):
        start = 0
        for d, n in enumerate(docs):
            positions[row, start:start + n], segments[row, start:start + n] = np.arange(n), d + 1
            start += n
    r = rng.randn(B, L, 64).astype(np.float32)
    logits, _, grads = run(gpt_oss.from_hf(path), tokens, r, positions, segments)
    return path, (tokens, positions, segments, r), np.asarray(logits), grads_by_path(grads)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("implementation", ["ring", "all_gather"])
def test_sinks_and_alternating_window_exact_under_context_parallelism(windowed, cp,
                                                                      implementation):
    """Packed, load-balanced rows (shard r holds chunks r and 2cp-1-r; the ring knows the
    layout, so the sliding layers skip the hops their window cannot see): logits and every
    gradient, sinks included, equal the unsharded model's."""
    from conformance import close, grads_by_path, run

    from zoo.data.reorder import chunk_order
    from zoo.partitioning import Partitioner, make_mesh
    path, (tokens, positions, segments, r), want, want_grads = windowed
    L = tokens.shape[1]
    order = np.concatenate([np.arange(c * L // (2 * cp), (c + 1) * L // (2 * cp))
                            for c in chunk_order(cp)])
    p = Partitioner(make_mesh(data=8 // cp, context=cp), "cp")
    model = gpt_oss.from_hf(path, partitioner=p, config_overrides=dict(
        attention_implementation=implementation, attention_layout="balanced"))
    assert {la.self_attn.implementation for la in model.layers} == {implementation}
    logits, _, grads = run(model, *(a[:, order] for a in (tokens, r, positions, segments)))
    assert close(logits, want[:, order], 1e-5)
    got = dict(grads_by_path(grads))
    for name, g in want_grads:
        assert close(got[name], g, 1e-4), name
    assert any(name.endswith("sinks") for name, _ in want_grads)
