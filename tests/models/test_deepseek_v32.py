"""DeepSeek-V3.2 beyond the conformance suite (tests/models/test_conformance.py runs its HF
logits and gradients with a top-6 of 16 keys, fsdp, cp, ep_as_cp, packed documents, round trip,
attention swap, parameter counts and recipe):

* `zoo.models.from_hf` dispatches ``deepseek_v32``; the indexer's keys;
* a DSA `MLA` layer under context parallelism (data 2 x context 4) on packed rows reordered by
  `zoo.data.load_balance`: output and every gradient equal the unsharded dense reference
  (``implementation="reference"``: the layer's mask & `TopK` over the expanded K/V); the
  indexer's gradient is exactly zero (its selection is under ``stop_gradient``, as
  transformers' ``no_grad`` indexer);
* the whole model under ``ep_as_cp`` on load-balanced packed rows equals the unsharded one;
* the cache holds the index keys; generation under ``ep_as_cp`` equals the unsharded tokens
  (greedy tokens against transformers' are in test_generate.py); construction errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from conformance import B, L, TOL, reference
from support import rel_err
from zoo.layers import MLA
from zoo.models.deepseek_v32 import DeepSeekV32, DeepSeekV32Config

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")
from test_conformance import FAMILIES  # noqa: E402 -- needs transformers

SPEC = next(f for f in FAMILIES if f.name == "deepseek_v32")
SEGMENTS = [(9, 5), (3, 13), (16, 0), (7, 7)]  # two documents and padding per row


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(SPEC, tmp_path_factory)


def packed(n_rows: int = B):
    """Positions and segment ids of rows packing two documents and padding."""
    positions, segments = [], []
    for n, m in SEGMENTS[:n_rows]:
        pad = L - n - m
        positions.append(np.concatenate([np.arange(n), np.arange(m), np.zeros(pad, int)]))
        segments.append(np.array([1] * n + [2] * m + [0] * pad))
    return np.stack(positions), np.stack(segments)


@pytest.fixture(scope="module")
def model(ref):
    return zoo.models.from_hf(ref.path)  # dispatches on model_type


def test_loads_by_model_type_with_the_indexer(model):
    assert isinstance(model, DeepSeekV32) and model.config.index_topk == 6
    attn = model.layer(1).self_attn
    assert attn.index_topk == 6 and attn.indexer.num_heads == 16
    keys = {k for row in model.hf_key_map() for k in row.keys}
    for name in ("wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight",
                 "k_norm.bias"):
        assert f"model.layers.2.self_attn.indexer.{name}" in keys


MLA_KW = dict(num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=8, index_topk=5, index_n_heads=16,
              index_head_dim=16)


def test_mla_cp_load_balanced_equals_unsharded_reference(devices):
    D = 32
    positions, segments = packed()
    rng = np.random.RandomState(1)
    x, r = rng.randn(B, L, D).astype(np.float32), rng.randn(B, L, D).astype(np.float32)
    want_layer = MLA(**MLA_KW, inputs_shape=(B, L, D), partitioner=None,
                     implementation="reference", rngs=nnx.Rngs(0))
    p = zoo.Partitioner(zoo.make_mesh(data=2, context=4), "cp")
    cp = p.context_size("attention")
    layer = MLA(**MLA_KW, inputs_shape=(B, L, D), partitioner=p, rngs=nnx.Rngs(0))
    assert layer.implementation != "reference"
    bal = zoo.data.load_balance(dict(x=x, r=r, positions=positions, segment_ids=segments,
                                     index=np.broadcast_to(np.arange(L), (B, L))), cp,
                                strategy="document")
    assert not np.array_equal(bal["index"], np.broadcast_to(np.arange(L), (B, L)))

    @jax.jit
    def run(layer, x, r, positions, segments):
        def loss(layer, x):
            out = layer(x, positions=positions, segment_ids=segments)
            return jnp.sum(out * r), out
        (_, out), (g_layer, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            layer, x)
        return out, g_layer, g_x

    want, want_g, want_gx = run(want_layer, *map(jnp.asarray, (x, r, positions, segments)))
    got, got_g, got_gx = run(layer, *(jnp.asarray(bal[k]) for k in
                                      ("x", "r", "positions", "segment_ids")))
    back = np.argsort(bal["index"], axis=1)[..., None]
    real = segments > 0
    got, got_gx = (np.take_along_axis(np.asarray(a), back, axis=1) for a in (got, got_gx))
    assert rel_err(got[real], np.asarray(want)[real]) < TOL
    assert rel_err(got_gx, np.asarray(want_gx)) < TOL
    want_flat = dict(nnx.to_flat_state(nnx.state(want_g, nnx.Param)))
    checked = 0
    for path, v in nnx.to_flat_state(nnx.state(got_g, nnx.Param)):
        w = np.asarray(want_flat[path].get_value())
        g = np.asarray(v.get_value())
        if "indexer" in path:
            assert np.abs(g).max() == 0 and np.abs(w).max() == 0, path
        else:
            assert rel_err(g, w) < TOL, path
            checked += 1
    assert checked >= 7


@pytest.mark.slow  # ~15 s: the model-level twin of the layer test above
def test_ep_as_cp_load_balanced_model_equals_unsharded(ref, model, devices):
    positions, segments = packed()
    tokens = np.where(segments > 0, ref.tokens, 0)
    forward = jax.jit(lambda m, t, p, s: m(t, positions=p, segment_ids=s)[0])
    want = np.asarray(forward(model, *map(
        jnp.asarray, (tokens, positions, segments))))
    p = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    cp = p.context_size("attention")
    assert cp == 4
    sharded = zoo.models.from_hf(ref.path, partitioner=p)
    bal = zoo.data.load_balance(dict(tokens=tokens, positions=positions, segment_ids=segments,
                                     index=np.broadcast_to(np.arange(L), (B, L))), cp,
                                strategy="document")
    got = np.asarray(forward(sharded, *(jnp.asarray(bal[k]) for k in
                                        ("tokens", "positions", "segment_ids"))))
    back = np.take_along_axis(got, np.argsort(bal["index"], axis=1)[..., None], axis=1)
    real = segments > 0
    assert rel_err(back[real], want[real]) < TOL


@pytest.mark.slow  # ~20 s: two generation programs (unsharded, ep_as_cp)
def test_cache_holds_index_keys_and_sharded_generation_equals_unsharded(ref, model, devices):
    """The cache keeps ``index_k`` beside ``latent_pe`` (their bytes per token); greedy tokens
    under ``ep_as_cp`` (prefill through the global top-k, decode over the sharded cache) equal
    the unsharded ones (which test_generate.py checks against transformers')."""
    import zoo.inference as G
    c = model.config
    shapes = G.KVCache.shapes(model, 2, 10)
    assert [sorted(e) for e in shapes.layers] == [["index_k", "latent_pe"]] * len(model.layers)
    want = (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim) * c.num_hidden_layers * 4
    assert G.cache_bytes_per_token(model) == want
    prompts = [[5, 17, 33, 2, 40, 9, 11], [21, 8], [3, 60, 14, 27, 50]]
    tokens = G.generate(model, prompts, max_new_tokens=10)
    p = zoo.Partitioner(zoo.make_mesh(fsdp=2, expert=2, context=2), "ep_as_cp")
    assert G.generate(zoo.models.from_hf(ref.path, partitioner=p), prompts,
                      max_new_tokens=10) == tokens


def test_construction_errors():
    kw = dict(MLA_KW, inputs_shape=(2, 16, 32), partitioner=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="index_topk=0 must be a positive int"):
        MLA(**{**kw, "index_topk": 0})
    with pytest.raises(ValueError, match="index_topk needs q_lora_rank"):
        MLA(**{**kw, "q_lora_rank": None})
    with pytest.raises(ValueError, match=r"does not combine with .*sinks=True"):
        MLA(**{**kw, "sinks": True})
    with pytest.raises(ValueError, match="q_lora_rank=None"):
        DeepSeekV32Config.mini(q_lora_rank=None)
    with pytest.raises(ValueError, match="rope_interleave=False"):
        DeepSeekV32Config.mini(rope_interleave=False)
    with pytest.raises(ValueError, match="index_head_dim=8 must be at least"):
        DeepSeekV32Config.mini(index_head_dim=8)
    raw = DeepSeekV32Config.mini().to_hf_config()
    assert "rope_interleave" not in raw
    raw["mlp_layer_types"] = ["sparse"] * raw["num_hidden_layers"]
    with pytest.raises(ValueError, match=r"mlp_layer_types=.*first_k_dense_replace=1"):
        DeepSeekV32Config.from_hf_config(raw)


def test_sparse_mla_chunked_equals_dense_topk_reference():
    """`sparse_mla_attention` (absorbed, gathered, 4 queries a step) = the expanded MLA under
    ``Causal() & Document() & TopK``, forward and gradients; the automatic chunk rule."""
    from zoo.ops import TopK, dot_product_attention
    from zoo.ops.sparse_attention import (GATHERED_KEYS, choose_query_chunk,
                                          sparse_mla_attention)
    assert choose_query_chunk(16, 5) == 16 and choose_query_chunk(16384, 2048) == 128
    assert choose_query_chunk(7, GATHERED_KEYS * 2) == 1
    Bq, Lq, N, R, Hn, Hr, Hv, k = 2, 16, 3, 8, 4, 4, 6, 5
    keys = iter(jax.random.split(jax.random.key(0), 8))
    q = jax.random.normal(next(keys), (Bq, Lq, N, Hn + Hr))
    latent = jax.random.normal(next(keys), (Bq, Lq, R))
    k_pe = jax.random.normal(next(keys), (Bq, Lq, Hr))
    kv_up = jax.random.normal(next(keys), (R, N, Hn + Hv)) * 0.5
    positions, segments = (jnp.asarray(a[:Bq]) for a in packed())
    scores = jax.random.normal(next(keys), (Bq, Lq, Lq))
    from zoo.layers import Indexer
    from zoo.ops import attention_mask
    visible = attention_mask(positions, positions, segments, segments)
    indices = Indexer.topk(jnp.where(visible, scores, -jnp.inf), k, positions)

    def sparse(q, latent, k_pe, kv_up):
        return sparse_mla_attention(q, latent, k_pe, kv_up, indices, qk_nope_head_dim=Hn,
                                    positions=positions, segment_ids=segments,
                                    implementation="gather", query_chunk=4)

    def dense(q, latent, k_pe, kv_up):
        kv = jnp.einsum("bsr,rnd->bsnd", latent, kv_up)
        kk = jnp.concatenate([kv[..., :Hn], jnp.broadcast_to(k_pe[:, :, None],
                                                              (Bq, Lq, N, Hr))], -1)
        top = TopK.from_indices(indices, positions, segments)
        return dot_product_attention(q, kk, kv[..., Hn:], q_positions=positions,
                                     kv_positions=positions, q_segment_ids=segments,
                                     kv_segment_ids=segments, mask=zoo.ops.Causal()
                                     & zoo.ops.Document() & top)

    r = jax.random.normal(next(keys), (Bq, Lq, N, Hv))

    @jax.jit
    def both(*args):
        def loss(f):
            def of(*a):
                out = f(*a)
                return jnp.sum(out * r), out
            return of
        return [jax.value_and_grad(loss(f), argnums=(0, 1, 2, 3), has_aux=True)(*args)
                for f in (sparse, dense)]

    ((_, got), g_got), ((_, want), g_want) = both(q, latent, k_pe, kv_up)
    assert rel_err(got, want) < TOL
    for a, b in zip(g_got, g_want):
        assert rel_err(a, b) < TOL


@pytest.mark.slow  # ~12 s on a loaded box: two lowered forwards
def test_index_fetch_is_a_config_field(devices):
    """``index_fetch`` (zoo-only) is checked at construction, reaches every DSA layer of
    V3.2 and GLM-5 (`--set index_fetch=hops`), stays out of config.json, and decides the
    program: under cp 4 the "hops" model's lowered forward holds one collective-permute per
    shard distance (latent, positions, segment ids), the "all_gather" model's
    none."""
    from zoo.models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaConfig
    with pytest.raises(ValueError, match=r"DeepSeekV32Config: index_fetch='ring' must be one of"):
        DeepSeekV32Config.mini(index_fetch="ring")
    assert "index_fetch" not in DeepSeekV32Config.mini(index_fetch="hops").to_hf_config()
    p = zoo.Partitioner(zoo.make_mesh(fsdp=2, context=4), "cp")
    tokens = jnp.zeros((2, 64), jnp.int32)
    counts = {}
    for fetch in ("hops", "all_gather"):
        model = DeepSeekV32(DeepSeekV32Config.mini(num_hidden_layers=1, index_fetch=fetch),
                            partitioner=p, rngs=nnx.Rngs(0))
        assert {layer.self_attn.index_fetch for layer in model.layers} == {fetch}
        text = jax.jit(lambda m, t: m(t)[0]).lower(model, tokens).as_text()
        counts[fetch] = text.count("stablehlo.collective_permute")
    assert counts == {"hops": 3 * 3, "all_gather": 0}
    glm = GlmMoeDsa(GlmMoeDsaConfig.mini(index_fetch="hops"), rngs=nnx.Rngs(0))
    assert {layer.self_attn.index_fetch for layer in glm.layers} == {"hops"}
