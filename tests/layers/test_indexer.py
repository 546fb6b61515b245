"""`zoo.layers.Indexer` against transformers' ``DeepseekV32Indexer`` (torch fp32, random weights
copied through the indexer's own `hf_keys`) on packed documents with padding: the index scores
where visible, and the top-k wherever the k-th score clears the next one by a margin (torch's
order among ties is unspecified). Plus the tie rule and construction errors."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from support import assert_close
from zoo.layers import Indexer
from zoo.layers.rope import RoPE
from zoo.models.hf import rope_from_hf

torch = pytest.importorskip("torch")
v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
from transformers import DeepseekV32Config  # noqa: E402

B, L, D, RQ, NI, HI, HR, TOPK = 2, 24, 32, 24, 8, 16, 8, 6
DOCS = ([9, 11], [6, 5, 7])  # the rest of each row is padding
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.5,
             "beta_fast": 32.0, "beta_slow": 1.0},
}


def packed():
    pos, seg = np.zeros((B, L), np.int64), np.zeros((B, L), np.int64)
    for b, docs in enumerate(DOCS):
        at = 0
        for d, n in enumerate(docs, start=1):
            pos[b, at:at + n], seg[b, at:at + n] = np.arange(n), d
            at += n
    return pos, seg


def hf_pair(rope_name):
    cfg = DeepseekV32Config(hidden_size=D, q_lora_rank=RQ, qk_rope_head_dim=HR,
                            index_n_heads=NI, index_head_dim=HI, index_topk=TOPK,
                            max_position_embeddings=32, rope_parameters=dict(ROPES[rope_name]))
    torch.manual_seed(0)
    hf = v32.DeepseekV32Indexer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    theta, scaling = rope_from_hf({"rope_parameters": ROPES[rope_name],
                                   "max_position_embeddings": 32}, default_theta=10000.0,
                                  what="test")
    ours = Indexer(num_heads=NI, head_dim=HI, rope_head_dim=HR, q_lora_rank=RQ,
                   inputs_shape=(B, L, D), partitioner=None,
                   rope=RoPE(theta=theta, interleaved=True, scaling=scaling),
                   rngs=nnx.Rngs(0))
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    rows = ours.hf_keys("indexer")
    assert sorted(k for r in rows for k in r.keys) == sorted(f"indexer.{k}" for k in state)
    for row in rows:
        var = functools.reduce(getattr, row.path, ours)
        var[...] = jnp.asarray(row.to_zoo(state[row.keys[0][len("indexer."):]], var.shape))
    return cfg, hf, ours


@pytest.mark.parametrize("rope_name", ["default", "yarn"])
def test_matches_transformers(rope_name):
    cfg, hf, ours = hf_pair(rope_name)
    pos, seg = packed()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    q_lat = rng.standard_normal((B, L, RQ)).astype(np.float32)
    visible = ((seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
               & (seg[:, :, None] != 0) & (seg[:, None, :] != 0))
    # transformers returns only the indices: recompute its scores from the same module
    # pieces to compare values, then call the module itself for the top-k
    with torch.no_grad():
        pid = torch.tensor(pos)
        cos, sin = v32.DeepseekV32RotaryEmbedding(cfg)(torch.tensor(x), pid)
        hf_idx = hf(torch.tensor(x), torch.tensor(q_lat), (cos, sin), torch.tensor(visible),
                    pid).numpy()
        q = hf.wq_b(torch.tensor(q_lat)).view(B, L, NI, HI)
        k = hf.k_norm(hf.wk(torch.tensor(x))).unsqueeze(2)
        q_rot, k_rot = v32.apply_rotary_pos_emb(q[..., :HR], k[..., :HR], cos, sin, 2)
        q, k = torch.cat([q_rot, q[..., HR:]], -1), torch.cat([k_rot, k[..., HR:]], -1)[:, :, 0]
        s = torch.relu(torch.einsum("blnh,bsh->blns", q, k) * HI ** -0.5)
        w = hf.weights_proj(torch.tensor(x)) * NI ** -0.5
        hf_scores = torch.einsum("blns,bln->bls", s, w).numpy()

    scores = np.asarray(ours(jnp.asarray(x), jnp.asarray(q_lat), positions=jnp.asarray(pos),
                             segment_ids=jnp.asarray(seg)))
    assert np.all(np.isneginf(scores[~visible]))
    assert_close(scores[visible], hf_scores[visible], f"{rope_name} index scores", rtol=1e-5)

    idx = np.asarray(Indexer.topk(jnp.asarray(scores), TOPK, jnp.asarray(pos)))
    assert idx.shape == (B, L, TOPK)
    checked = 0
    for b in range(B):
        for i in range(L):
            n = int(visible[b, i].sum())
            if n == 0:
                assert np.all(idx[b, i] == -1)
                continue
            row = np.sort(hf_scores[b, i][visible[b, i]])[::-1]
            m = min(TOPK, n)
            assert np.all(idx[b, i, m:] == -1)
            if m < n and row[m - 1] - row[m] < 1e-4 * max(abs(row[0]), 1.0):
                continue  # the k-th score is (nearly) tied with the next: order unspecified
            assert set(idx[b, i, :m]) == set(hf_idx[b, i, :m]), (b, i)
            checked += 1
    assert checked >= B * L // 2, checked


def test_tie_rule():
    """Equal scores: the larger position first, wherever the keys sit in the arrays."""
    pos = jnp.asarray([[3, 0, 2, 1, 5, 4]])  # a reordered row of one document
    scores = jnp.asarray([[[1.0, 2.0, 1.0, 0.0, 1.0, -0.0]]])
    idx = np.asarray(Indexer.topk(scores, 4, pos))[0, 0]
    # 2.0 (pos 0), then the 1.0s by position 5, 3, 2
    assert idx.tolist() == [1, 4, 0, 2]
    # 0.0 and -0.0 tie too: position 4 (-0.0) before position 1 (0.0)
    idx = np.asarray(Indexer.topk(scores, 6, pos))[0, 0]
    assert idx.tolist() == [1, 4, 0, 2, 5, 3]
    # -inf slots are empty; k larger than the keys is clamped
    masked = scores.at[0, 0, 1].set(-jnp.inf)
    idx = np.asarray(Indexer.topk(masked, 9, pos))[0, 0]
    assert idx.tolist() == [4, 0, 2, 5, 3, -1]


def test_errors():
    kw = dict(num_heads=4, head_dim=16, q_lora_rank=8, inputs_shape=(1, 8, 16),
              partitioner=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rope_head_dim"):
        Indexer(rope_head_dim=5, **kw)
    with pytest.raises(ValueError, match="rope_head_dim"):
        Indexer(rope_head_dim=32, **kw)
    ind = Indexer(rope_head_dim=8, **kw)
    with pytest.raises(ValueError, match="q_lora_rank"):
        ind(jnp.ones((1, 8, 16)), jnp.ones((1, 8, 4)), positions=jnp.arange(8)[None])
    with pytest.raises(ValueError, match="kv_positions"):
        Indexer.topk(jnp.ones((1, 8, 8)), 2, jnp.arange(4)[None])


def test_sharded_matches_unsharded():
    """Built under an fsdp x context mesh (parameters sharded at creation), jitted: the same
    scores as the unsharded module with the same weights."""
    import zoo

    p = zoo.Partitioner(zoo.make_mesh(fsdp=4, context=2), "cp")
    kw = dict(num_heads=NI, head_dim=HI, rope_head_dim=HR, q_lora_rank=RQ,
              inputs_shape=(B, L, D), rngs=nnx.Rngs(3))
    sharded, plain = Indexer(partitioner=p, **kw), Indexer(partitioner=None, **kw)
    assert sharded.wq_b.kernel[...].sharding.spec[0] is not None  # q_lora is cut
    for (_, mine), (_, theirs) in zip(nnx.iter_graph(sharded), nnx.iter_graph(plain)):
        if isinstance(mine, nnx.Param):  # the same weights, kept in the sharded layout
            mine[...] = jax.device_put(theirs[...], mine[...].sharding)
    pos, seg = packed()
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
    q_lat = jnp.asarray(rng.standard_normal((B, L, RQ)), jnp.float32)
    fn = nnx.jit(lambda m, x, q, pos, seg: m(x, q, positions=pos, segment_ids=seg))
    got = fn(sharded, x, q_lat, jnp.asarray(pos), jnp.asarray(seg))
    want = plain(x, q_lat, positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
    finite = np.isfinite(np.asarray(want))
    assert np.array_equal(finite, np.isfinite(np.asarray(got)))
    assert_close(np.asarray(got)[finite], np.asarray(want)[finite], "sharded scores", 1e-5)
