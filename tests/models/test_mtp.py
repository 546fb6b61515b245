"""DeepSeek-V3's multi-token prediction: successors and targets against a plain loop on packed,
reordered rows; the MTP loss against a hand-shifted computation; layout and sharding
invariance; gradients reach the MTP module."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zoo
from zoo.models.deepseek3 import DeepSeek3, DeepSeek3Config
from zoo.train.step import loss_fn, mtp_targets, successors

B, L = 2, 32


def _packed_batch(seed=0, permute=False):
    """Two rows of packed documents (padding at the end); optionally each row's tokens in a
    random order (as a load-balanced layout reorders them)."""
    rng = np.random.default_rng(seed)
    lengths = [[9, 14, 6], [20, 10]]
    inputs, targets, pos, seg, w = (np.zeros((B, L), np.int32) for _ in range(5))
    for b, docs in enumerate(lengths):
        at = 0
        for s, n in enumerate(docs, 1):
            doc = rng.integers(3, 200, size=n + 1)
            inputs[b, at:at + n], targets[b, at:at + n] = doc[:-1], doc[1:]
            pos[b, at:at + n], seg[b, at:at + n], w[b, at:at + n] = np.arange(n), s, 1
            at += n
    batch = dict(inputs=inputs, targets=targets, positions=pos, segment_ids=seg,
                 loss_weights=w.astype(np.float32))
    if permute:
        perm = np.stack([rng.permutation(L) for _ in range(B)])
        batch = {k: np.take_along_axis(v, perm, axis=1) for k, v in batch.items()}
    return batch


def _loop_targets(batch, depth):
    """For each (row, index): the tokens d ahead and d+1 ahead in the same document, by a
    search over positions (None when the document ends first or a weight is 0)."""
    out = {}
    for b in range(B):
        where = {(int(batch["segment_ids"][b, i]), int(batch["positions"][b, i])): i
                 for i in range(L) if batch["loss_weights"][b, i] > 0}
        for i in range(L):
            s, p = int(batch["segment_ids"][b, i]), int(batch["positions"][b, i])
            if batch["loss_weights"][b, i] == 0:
                continue
            for d in range(1, depth + 1):
                j = where.get((s, p + d))
                if j is None:
                    break
                # the token d ahead is the target of the token d-1 ahead
                prev = where[(s, p + d - 1)]
                out[b, i, d] = (int(batch["targets"][b, prev]), int(batch["targets"][b, j]))
    return out


@pytest.mark.parametrize("permute", [False, True])
def test_mtp_targets_match_a_plain_loop(permute):
    batch = _packed_batch(permute=permute)
    depth = 2
    tokens, targets, weights = (np.asarray(a) for a in mtp_targets(
        {k: jnp.asarray(v) for k, v in batch.items()}, depth))
    want = _loop_targets(batch, depth)
    for b in range(B):
        for i in range(L):
            for d in range(1, depth + 1):
                if (b, i, d) in want:
                    assert weights[d - 1, b, i] == 1.0
                    assert (tokens[d - 1, b, i], targets[d - 1, b, i]) == want[b, i, d]
                else:
                    assert weights[d - 1, b, i] == 0.0
    _nxt, exists = successors(jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]))
    assert int(np.asarray(exists).sum()) > 0


def _config(**kw):
    return DeepSeek3Config.mini(num_hidden_layers=2, hidden_size=64, num_nextn_predict_layers=1,
                                vocab_size=256, **kw)


@pytest.fixture(scope="module")
def unsharded():
    model = DeepSeek3(_config(), inputs_shape=(B, L), rngs=nnx.Rngs(0))
    batch = {k: jnp.asarray(v) for k, v in _packed_batch().items()}
    (obj, (ce, _aux_loss, aux)), grads = jax.jit(lambda m, b: nnx.value_and_grad(
        lambda m: loss_fn(m, b, aux_loss_weight=0.0), has_aux=True)(m))(model, batch)
    return model, batch, obj, ce, aux, grads


def test_mtp_loss_equals_a_hand_shifted_computation(unsharded):
    """aux["mtp_loss"] is the cross-entropy of the MTP logits for tokens two ahead, on the
    positions whose next two tokens are in the document; the objective adds 0.3 of it."""
    model, batch, obj, ce, aux, _ = unsharded
    np_batch = {k: np.asarray(v) for k, v in batch.items()}
    # by hand: within each document, the token one ahead is inputs[i+1]; two ahead inputs[i+2]
    seg, w = np_batch["segment_ids"], np_batch["loss_weights"]
    tok1 = np.zeros((B, L), np.int32)
    tgt2 = np.zeros((B, L), np.int32)
    ok = np.zeros((B, L), np.float32)
    for b in range(B):
        for i in range(L):
            tok1[b, i] = np_batch["targets"][b, i]
            if i + 1 < L and w[b, i] and w[b, i + 1] and seg[b, i + 1] == seg[b, i]:
                tgt2[b, i], ok[b, i] = np_batch["targets"][b, i + 1], 1.0
    _, aux2 = model(batch["inputs"], positions=batch["positions"],
                    segment_ids=batch["segment_ids"], mtp_tokens=jnp.asarray(tok1)[None])
    logp = jax.nn.log_softmax(np.asarray(aux2["mtp_logits"][0], np.float64), -1)
    picked = np.take_along_axis(np.asarray(logp), tgt2[..., None], -1)[..., 0]
    want = -(picked * ok).sum() / ok.sum()
    np.testing.assert_allclose(float(aux["mtp_loss"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(obj), float(ce) + 0.3 * want, rtol=1e-5)
    assert 4.0 < want < 7.0  # a fresh model's loss over 256 tokens, near log(256) = 5.5


def test_mtp_gradients_reach_the_module(unsharded):
    _, _, _, _, _, grads = unsharded
    g = nnx.to_flat_state(grads)
    mtp = [float(optax.tree.norm(v[...])) for path, v in g if path[0] == "mtp"]
    assert mtp and all(np.isfinite(mtp)) and max(mtp) > 0
    assert any(path[:3] == ("mtp", 0, "eh_proj") for path, _ in g)


def test_mtp_loss_is_layout_and_sharding_invariant(unsharded, devices):
    """The same documents in another order, and the model under EP-as-CP on 8 devices, give
    the same losses."""
    model, batch, _obj, ce, aux, _ = unsharded
    permuted = {k: jnp.asarray(v) for k, v in _packed_batch(permute=True).items()}
    _, (ce_p, _, aux_p) = jax.jit(lambda m, b: loss_fn(m, b))(model, permuted)
    np.testing.assert_allclose(float(aux_p["mtp_loss"]), float(aux["mtp_loss"]), rtol=2e-5)
    np.testing.assert_allclose(float(ce_p), float(ce), rtol=2e-5)

    part = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    sharded = DeepSeek3(_config(), inputs_shape=(B * 4, L), partitioner=part,
                        rngs=nnx.Rngs(0))
    nnx.update(sharded, jax.device_get(nnx.state(model)))
    big = {k: jnp.concatenate([v] * 4) for k, v in batch.items()}
    _, (ce_s, _, aux_s) = jax.jit(lambda m, b: loss_fn(m, b))(sharded, big)
    np.testing.assert_allclose(float(aux_s["mtp_loss"]), float(aux["mtp_loss"]), rtol=2e-5)
    np.testing.assert_allclose(float(ce_s), float(ce), rtol=2e-5)


def test_mtp_settings_are_checked():
    with pytest.raises(ValueError, match="num_nextn_predict_layers=-1 must be an int >= 0"):
        DeepSeek3Config.mini(num_nextn_predict_layers=-1)
    with pytest.raises(ValueError, match="mtp_loss_weight=nan must be a finite number"):
        DeepSeek3Config.mini(mtp_loss_weight=float("nan"))
    with_mtp = DeepSeek3Config.mini(num_nextn_predict_layers=1)
    assert with_mtp.num_params() > DeepSeek3Config.mini().num_params()


def test_deepseek_v3_counts_its_mtp_module():
    """The preset has the published MTP layer: its count is the trunk's (671,026,404,352, what
    transformers counts: tests/models/test_conformance.py checks the preset at 0) plus the MTP
    module's; the checkpoint's layer 61 also holds copies of the embedding and head, which zoo
    shares, and with them the published "671B + 14B" (13.46B before the FP8 block scales)."""
    from zoo.models import count_params
    from zoo.models.hf import expected_shapes
    full, trunk = DeepSeek3Config.deepseek_v3(), DeepSeek3Config.deepseek_v3(
        num_nextn_predict_layers=0)
    assert full.num_nextn_predict_layers == 1 and trunk.num_params() == 671_026_404_352
    model = DeepSeek3.abstract(full)
    module = count_params(model.mtp)
    assert full.num_params() - trunk.num_params() == module == 11_610_067_968
    shapes = expected_shapes(model, model.hf_key_map())
    layer_61 = sum(int(np.prod(s)) for k, (s, _) in shapes.items()
                   if k.startswith("model.layers.61."))
    copies = 2 * full.vocab_size * full.hidden_size  # embed_tokens, shared_head.head
    bias = full.n_routed_experts  # e_score_correction_bias: saved, but a buffer, not counted
    assert layer_61 == module + copies + bias == 13_463_426_304
    moe_layers = full.num_moe_layers + 1
    assert sum(int(np.prod(s)) for s, _ in shapes.values()) == (
        full.num_params() + copies + moe_layers * bias)


def test_train_step_updates_the_mtp_layers_bias_too(unsharded):
    """The after-step bias update takes the MTP layer's expert counts (after the trunk's
    scanned stack) and moves its selection bias as well."""
    from zoo.train.step import make_train_step, make_tx
    model, batch, *_ = unsharded
    model = nnx.clone(model)
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    before = np.asarray(model.mtp[0].layer.mlp.e_score_correction_bias[...])
    trunk_before = np.asarray(model.layers[-1].mlp.e_score_correction_bias[...])
    step = make_train_step(expert_bias_rate=1e-2)
    model, optimizer, metrics = step(model, optimizer, batch, jnp.float32(1e-3))
    assert np.isfinite(float(metrics["mtp_loss"]))
    assert np.asarray(metrics["expert_counts"]).shape[0] == 2  # trunk's MoE layer + MTP's
    assert not np.allclose(np.asarray(model.mtp[0].layer.mlp.e_score_correction_bias[...]),
                           before)
    assert not np.allclose(np.asarray(model.layers[-1].mlp.e_score_correction_bias[...]),
                           trunk_before)


def test_mtp_module_round_trips_in_deepseeks_published_layout(unsharded, tmp_path):
    """to_hf writes the MTP module under the layer index after the trunk's, in DeepSeek's
    names (with the layout's copies of the embedding and head), and config.json's
    num_nextn_predict_layers; from_hf reads it back (every MTP variable equal); a checkpoint
    that declares MTP but holds none leaves the module fresh, with a warning; loading with
    num_nextn_predict_layers=0 ignores the MTP tensors with a warning."""
    import json
    import warnings

    from safetensors import safe_open

    from zoo.models.deepseek3 import from_hf
    model = unsharded[0]
    model.to_hf(tmp_path / "ckpt")
    tensors = {}
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        with safe_open(f, "np") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    layer = "model.layers.2"  # num_hidden_layers=2: the MTP layer is the third
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.0.gate_proj.weight",
                 "mlp.shared_experts.down_proj.weight"):
        assert f"{layer}.{name}" in tensors, name
    np.testing.assert_array_equal(tensors[f"{layer}.shared_head.head.weight"],
                                  tensors["lm_head.weight"])
    np.testing.assert_array_equal(tensors[f"{layer}.embed_tokens.weight"],
                                  tensors["model.embed_tokens.weight"])
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = from_hf(tmp_path / "ckpt", inputs_shape=(B, L),
                         config_overrides={"scan_layers": False})
    want = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model.mtp))}
    got = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(loaded.mtp))}
    assert want.keys() == got.keys()
    for p in want:
        np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))
    with pytest.warns(UserWarning, match=r"ignoring \d+ tensor\(s\).*model\.layers\.2\."):
        plain = from_hf(tmp_path / "ckpt", inputs_shape=(B, L),
                        config_overrides={"num_nextn_predict_layers": 0})
    assert not len(plain.mtp)
    plain.to_hf(tmp_path / "trunk")  # as transformers saves: no MTP layer
    assert json.loads((tmp_path / "trunk" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 0
    config["num_nextn_predict_layers"] = 1  # declared, as transformers' configs do, not held
    (tmp_path / "trunk" / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"holds no MTP layer under \['model\.layers\.2\.'\]"):
        fresh = from_hf(tmp_path / "trunk", inputs_shape=(B, L))
    assert len(fresh.mtp) == 1
