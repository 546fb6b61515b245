"""Mixtral against Hugging Face transformers: a tiny random model saved with `save_pretrained`.

Logits (unsharded and under two partitioner strategies), gradients, and each component
(attention with a sliding window, MoE block and its routing counts, decoder layer); packed
documents against separate runs; `to_hf` reloaded by transformers; the legacy rope spelling.
All in float32 with relative error < 1e-4 (observed ~1e-7).
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import saved_reference
from flax import nnx

from zoo.models import mixtral
from zoo.partitioning import Partitioner, make_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

B, L, V = 4, 16, 64
TOL = 1e-4
# one compiled program per (model structure, mesh), shared by the tests below
FORWARD = jax.jit(lambda model, tokens, positions, segment_ids: model(
    tokens, positions=positions, segment_ids=segment_ids))
CALL = jax.jit(lambda module, x, **kw: module(x, **kw))  # components, compiled once each


def forward(model, tokens, positions=None, segment_ids=None):
    """Logits and aux of an unpacked batch (positions arange, one segment) unless given."""
    if positions is None:
        positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
        segment_ids = np.ones(tokens.shape, np.int32)
    return FORWARD(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def hf_mask(positions: np.ndarray, window: int | None) -> "torch.Tensor":
    """Additive [B, 1, L, L] causal (+ sliding window) mask for transformers' eager attention."""
    q, k = positions[:, :, None], positions[:, None, :]
    ok = k <= q
    if window is not None:
        ok &= q - k < window
    return torch.tensor(np.where(ok, 0.0, np.finfo(np.float32).min)[:, None], dtype=torch.float32)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=6, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return saved_reference(cfg, tmp_path_factory, "mixtral_hf", batch=B, length=L)


@pytest.fixture(scope="module")
def zoo_model(ref):
    return mixtral.from_hf(ref.path)


def test_checkpoint_is_the_published_layout(ref):
    from safetensors import safe_open
    with safe_open(str(ref.path / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in keys
    assert json.loads((ref.path / "config.json").read_text())["rope_parameters"]


def test_logits_unsharded(ref, zoo_model):
    logits, aux = forward(zoo_model, ref.tokens)
    assert rel_err(logits, ref.logits) < TOL
    counts = np.asarray(aux["expert_counts"])
    assert counts.shape == (2, 8) and (counts.sum(1) == B * L * 2).all()
    assert np.isfinite(float(aux["load_balance_loss"]))


@pytest.mark.parametrize("mesh,strategy,inputs_shape", [
    (dict(fsdp=2, expert=2, context=2), "ep_as_cp", None),
    (dict(fsdp=4, tensor=2), "fsdp", (B, L)),
], ids=["ep_as_cp", "fsdp+tensor"])
def test_logits_sharded(ref, devices, mesh, strategy, inputs_shape):
    p = Partitioner(make_mesh(**mesh), strategy)
    model = mixtral.from_hf(ref.path, partitioner=p, inputs_shape=inputs_shape)
    # parameters arrive sharded as the partitioner says (stacked: an unsharded layer axis)
    wi = model.layers[0].mlp.wi_gate[...]
    assert wi.shape[0] == model.config.num_hidden_layers
    assert wi.sharding.is_equivalent_to(
        p.sharding(("layers", "experts", "embed", "mlp"), "moe"), 4)
    assert wi.addressable_shards[0].data.shape != wi.shape
    q = model.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.is_equivalent_to(
        p.sharding(("layers", "embed", "heads", "head_dim"), "attention"), 4)
    logits, _ = forward(model, ref.tokens)
    assert rel_err(logits, ref.logits) < TOL


def test_attention_parity(ref, zoo_model):
    x = np.random.RandomState(1).randn(B, L, 32).astype(np.float32)
    pos = np.broadcast_to(np.arange(L), (B, L))
    hf_layer = ref.model.model.layers[0]
    with torch.no_grad():
        pe = ref.model.model.rotary_emb(torch.tensor(x), torch.tensor(pos))
        want = hf_layer.self_attn(hidden_states=torch.tensor(x), position_embeddings=pe,
                                  attention_mask=hf_mask(pos, 6))[0].numpy()
    got = CALL(zoo_model.layer(0).self_attn, jnp.asarray(x), positions=jnp.asarray(pos))
    assert rel_err(got, want) < TOL


def test_moe_block_parity_and_routing(ref, zoo_model):
    x = np.random.RandomState(2).randn(B, L, 32).astype(np.float32)
    hf_moe = ref.model.model.layers[1].mlp
    with torch.no_grad():
        want = hf_moe(torch.tensor(x)).numpy()
        _, _, idx = hf_moe.gate(torch.tensor(x))
    got, aux = CALL(zoo_model.layer(1).mlp, jnp.asarray(x))
    assert rel_err(got, want) < TOL
    np.testing.assert_array_equal(np.asarray(aux["expert_counts"]),
                                  np.bincount(idx.numpy().ravel(), minlength=8))


def test_decoder_layer_parity(ref, zoo_model):
    x = np.random.RandomState(3).randn(B, L, 32).astype(np.float32)
    pos = np.broadcast_to(np.arange(L), (B, L))
    hf_layer = ref.model.model.layers[1]
    with torch.no_grad():
        pe = ref.model.model.rotary_emb(torch.tensor(x), torch.tensor(pos))
        want = hf_layer(torch.tensor(x), attention_mask=hf_mask(pos, 6),
                        position_ids=torch.tensor(pos), position_embeddings=pe)
        want = (want[0] if isinstance(want, tuple) else want).numpy()
    got, aux = CALL(zoo_model.layer(1), jnp.asarray(x), positions=jnp.asarray(pos))
    assert rel_err(got - x, want - x) < TOL and aux is not None  # the residual branch


def test_packed_documents_match_separate_runs(ref, zoo_model):
    """Rows packing two documents and padding = each document run alone by transformers."""
    tokens, positions, segments, docs = [], [], [], []
    for row, (n, m) in enumerate([(9, 5), (3, 13), (16, 0), (7, 7)]):
        a, b = ref.tokens[row, :n], ref.tokens[(row + 1) % B, :m]
        pad = L - n - m
        tokens.append(np.concatenate([a, b, np.zeros(pad, int)]))
        positions.append(np.concatenate([np.arange(n), np.arange(m), np.zeros(pad, int)]))
        segments.append(np.array([1] * n + [2] * m + [0] * pad))
        docs += [(row, 0, a), (row, n, b)]
    logits, _ = forward(zoo_model, np.stack(tokens), np.stack(positions), np.stack(segments))
    for row, start, doc in docs:
        if len(doc):
            with torch.no_grad():
                want = ref.model(torch.tensor(doc[None])).logits.numpy()[0]
            assert rel_err(logits[row, start:start + len(doc)], want) < TOL


def test_gradients_match_torch(ref, zoo_model):
    """d sum(logits * R) / d params, zoo (jax.grad) vs transformers (autograd)."""
    r = np.random.RandomState(4).randn(B, L, V).astype(np.float32)
    graphdef, params, rest = nnx.split(zoo_model, nnx.Param, ...)

    def loss(params):
        logits, _ = nnx.merge(graphdef, params, rest)(jnp.asarray(ref.tokens))
        return jnp.sum(logits * r)

    g = nnx.merge(graphdef, jax.jit(jax.grad(loss))(params), rest)
    ref.model.zero_grad()
    (ref.model(torch.tensor(ref.tokens)).logits * torch.tensor(r)).sum().backward()
    tg = {n: p.grad.numpy() for n, p in ref.model.named_parameters()}
    pairs = [
        (g.embed_tokens.embedding[...], tg["model.embed_tokens.weight"]),
        (g.lm_head.kernel[...], tg["lm_head.weight"].T),
        (g.layer(0).self_attn.q_proj.kernel[...].reshape(32, 32),
         tg["model.layers.0.self_attn.q_proj.weight"].T),
        (g.layer(0).self_attn.o_proj.kernel[...].reshape(32, 32),
         tg["model.layers.0.self_attn.o_proj.weight"].T),
        (g.layer(1).mlp.router[...], tg["model.layers.1.mlp.gate.weight"].T),
        (g.layer(1).mlp.wo[...], tg["model.layers.1.mlp.experts.down_proj"].transpose(0, 2, 1)),
        (g.layer(1).mlp.wi_gate[...],
         tg["model.layers.1.mlp.experts.gate_up_proj"][:, :48].transpose(0, 2, 1)),
        (g.layer(0).input_layernorm.scale[...], tg["model.layers.0.input_layernorm.weight"]),
    ]
    for got, want in pairs:
        assert rel_err(got, want) < TOL


def test_to_hf_round_trip(ref, tmp_path):
    """A zoo-initialised model, written by to_hf, reloads in transformers with equal logits."""
    # the reference's shapes, so the compiled forward is shared; fresh zoo initialisation
    cfg = mixtral.MixtralConfig.from_hf_config(ref.config.to_dict())
    model = mixtral.Mixtral(cfg, rngs=nnx.Rngs(7))
    for layer in model.layers:  # non-unit norm scales
        layer.post_attention_layernorm.scale[...] = 1 + 0.3 * jax.random.normal(
            jax.random.key(layer.layer_idx), (32,))
    tokens = np.random.RandomState(5).randint(0, V, (B, L))
    logits, _ = forward(model, tokens)
    mixtral.to_hf(model, tmp_path / "out", max_shard_bytes=40_000)  # several shards + index
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    assert rel_err(logits, want) < TOL
    back = mixtral.from_hf(tmp_path / "out")
    for x, y in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert back.config == model.config


def test_legacy_rope_spelling(ref, zoo_model, tmp_path):
    """Published checkpoints spell rope as rope_theta (no rope_parameters): same model."""
    legacy = tmp_path / "legacy"
    shutil.copytree(ref.path, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_theta"] = theta
    (legacy / "config.json").write_text(json.dumps(cfg))
    model = mixtral.from_hf(legacy)
    assert model.config == zoo_model.config and model.config.rope_theta == 10000.0
    logits, _ = forward(model, ref.tokens)
    assert rel_err(logits, ref.logits) < TOL
