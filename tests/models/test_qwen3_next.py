"""Qwen3-Next beyond the conformance suite (tests/models/test_conformance.py runs its HF logits,
gradients, strategies, packed documents, round trip, attention swap, parameter counts and
recipe): under ``ep_as_cp`` (fsdp 2, expert 2, context 2) on packed rows reordered by
`zoo.data.load_balance` (``document`` and ``row``), logits equal the unsharded ones; the 3:1
pattern scans as one cycle; config.json spellings; construction errors; the zero-centred and
gated norms; the linear layers' checkpoint keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from conformance import B, L, TOL, reference
from support import rel_err
from zoo.models import qwen3_next
from zoo.models.qwen3_next import Qwen3Next, Qwen3NextConfig
from zoo.models.stacks import layer_cycles

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")
from test_conformance import FAMILIES  # noqa: E402 -- needs transformers

SPEC = next(f for f in FAMILIES if f.name == "qwen3_next")



@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(SPEC, tmp_path_factory)


@pytest.fixture(scope="module")
def model(ref):
    return zoo.models.from_hf(ref.path)  # dispatches on model_type


def test_loads_as_qwen3_next(ref, model):
    assert isinstance(model, Qwen3Next)
    assert model.config.partial_rotary_factor == 0.5
    assert model.config.kinds == ("linear_attention",) * 3 + ("full_attention",)
    assert [type(la.self_attn).__name__ for la in model.layers] == \
        ["GatedDeltaNet", "GatedAttention"]  # scanned: 3 linear layers, then the full one


def packed_rows(ref):
    tokens, positions, segments = [], [], []
    for row, (n, m) in enumerate([(9, 5), (3, 13), (16, 0), (7, 7)]):
        a, b = ref.tokens[row, :n], ref.tokens[(row + 1) % B, :m]
        pad = L - n - m
        tokens.append(np.concatenate([a, b, np.zeros(pad, int)]))
        positions.append(np.concatenate([np.arange(n), np.arange(m), np.zeros(pad, int)]))
        segments.append(np.array([1] * n + [2] * m + [0] * pad))
    return dict(tokens=np.stack(tokens), positions=np.stack(positions),
                segment_ids=np.stack(segments))


@jax.jit
def forward(model, tokens, positions, segment_ids):
    return model(tokens, positions=positions, segment_ids=segment_ids)[0]


@pytest.mark.parametrize("strategy", ["document", "row"])
def test_ep_as_cp_load_balanced_equals_unsharded(ref, model, strategy, devices):
    batch = packed_rows(ref)
    want = np.asarray(forward(model, *map(jnp.asarray, batch.values())))
    p = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    cp = p.context_size("attention")
    assert cp == 4
    sharded = zoo.models.from_hf(ref.path, partitioner=p)
    bal = zoo.data.load_balance(dict(batch, index=np.broadcast_to(np.arange(L), (B, L))), cp,
                                strategy=strategy)
    assert not np.array_equal(bal["index"], batch["positions"] * 0 + np.arange(L))
    got = np.asarray(forward(sharded, *(jnp.asarray(bal[k]) for k in batch)))
    back = np.take_along_axis(got, np.argsort(bal["index"], axis=1)[..., None], axis=1)
    real = batch["segment_ids"] > 0
    assert rel_err(back[real], want[real]) < TOL


def test_three_to_one_pattern_scans_as_one_cycle():
    cfg = Qwen3NextConfig.mini(num_hidden_layers=8)
    assert layer_cycles(qwen3_next.Qwen3NextDecoderLayer, cfg, True) == [(0, 8, 4)]
    model = Qwen3Next.abstract(cfg)
    assert [la.stack_size for la in model.layers] == [2, 2, 2, 2]
    assert [la.stack_stride for la in model.layers] == [4] * 4
    assert [type(la.self_attn).__name__ for la in model.layers] == \
        ["GatedDeltaNet"] * 3 + ["GatedAttention"]
    keys = {k for row in model.hf_key_map() for k in row.keys}
    assert "model.layers.7.self_attn.q_proj.weight" in keys
    assert "model.layers.6.linear_attn.in_proj_qkvz.weight" in keys
    assert "model.layers.6.mlp.shared_expert_gate.weight" in keys


def test_from_hf_config_reads_hub_spelling():
    raw = dict(transformers.Qwen3NextConfig(num_hidden_layers=8).to_dict())
    raw.pop("layer_types")
    raw["full_attention_interval"] = 2
    cfg = Qwen3NextConfig.from_hf_config(raw)
    assert cfg.kinds == ("linear_attention", "full_attention") * 4
    assert cfg.to_hf_config()["layer_types"] == list(cfg.kinds)


def test_construction_errors():
    with pytest.raises(ValueError, match="linear_num_value_heads=6 is not a multiple of "
                                         "linear_num_key_heads=4"):
        Qwen3NextConfig.mini(linear_num_value_heads=6)
    with pytest.raises(ValueError, match="layer_types"):
        Qwen3NextConfig.mini(layer_types=("linear_attention", "sliding_attention") * 2)
    kw = dict(num_key_heads=2, num_value_heads=3, key_head_dim=8, value_head_dim=8,
              inputs_shape=(2, 16, 32), partitioner=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="linear_num_value_heads=3 is not a multiple"):
        zoo.layers.GatedDeltaNet(**kw)
    with pytest.raises(ValueError, match="implementation='fast'"):
        zoo.layers.GatedDeltaNet(**{**kw, "num_value_heads": 4, "implementation": "fast"})
    p = zoo.Partitioner(zoo.make_mesh(data=2, context=4), "cp")
    with pytest.raises(ValueError, match="length"):
        zoo.layers.GatedDeltaNet(**{**kw, "num_value_heads": 4, "inputs_shape": (2, 12, 32),
                                    "partitioner": p})


def test_zero_centred_and_gated_norms():
    x = jax.random.normal(jax.random.key(0), (3, 8))
    gate = jax.random.normal(jax.random.key(1), (3, 8))
    zc = zoo.layers.ZeroCentredRMSNorm(8, eps=1e-6, rngs=nnx.Rngs(0))
    assert np.all(np.asarray(zc.scale[...]) == 0)
    w = np.linspace(-0.5, 0.5, 8).astype(np.float32)
    zc.scale.set_value(jnp.asarray(w))
    xn = np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(zc(x), xn * (1 + w), rtol=1e-5)
    gn = zoo.layers.GatedRMSNorm(8, eps=1e-6, rngs=nnx.Rngs(0))
    g = np.asarray(gate)
    np.testing.assert_allclose(gn(x, gate), xn * g / (1 + np.exp(-g)), rtol=1e-5, atol=1e-6)


def test_layers_subclass_and_keys():
    """A research subclass of the layers keeps their keys (the conformance swap idea)."""
    cfg = dataclasses.replace(Qwen3NextConfig.mini(), scan_layers=False)
    model = Qwen3Next.abstract(cfg)
    rows = model.layer(0).hf_keys("model.layers.0")
    names = sorted(k for r in rows for k in r.keys if "linear_attn" in k)
    assert names == sorted(f"model.layers.0.linear_attn.{n}" for n in (
        "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
        "norm.weight", "out_proj.weight"))


def test_hub_mtp_tensors_are_named_not_loaded(tmp_path):
    """A Hub checkpoint's multi-token-prediction tensors (``mtp.*``) are not loaded, and
    `from_hf` says so once, by name; the model loads whole and equal without them."""
    import warnings

    from safetensors.numpy import save_file
    model = Qwen3Next(Qwen3NextConfig.mini(num_experts=4, num_experts_per_tok=2,
                                           num_hidden_layers=2,
                                           layer_types=("linear_attention", "full_attention")),
                      rngs=nnx.Rngs(0))
    path = tmp_path / "ckpt"
    model.to_hf(path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        zoo.models.from_hf(path)
    assert not [w for w in seen if "multi-token" in str(w.message)]
    mtp = {"mtp.fc.weight": np.ones((128, 256), np.float32),
           "mtp.layers.0.input_layernorm.weight": np.ones(128, np.float32)}
    save_file(mtp, str(path / "mtp.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        import json
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "mtp.safetensors" for k in mtp})
        index.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=r"Qwen3Next.from_hf: .* holds 2 multi-token-prediction "
                                         r"tensor\(s\) \(mtp.fc.weight, mtp.layers.0.input_"):
        loaded = zoo.models.from_hf(path)
    want, got = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (model, loaded))
    assert len(want) == len(got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
