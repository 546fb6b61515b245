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


# -- selection in bounded memory (query chunks, key blocks, skipped blocks) ---------------------

def random_inputs(seed, rows=B, length=L):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((rows, length, D)), jnp.float32),
            jnp.asarray(rng.standard_normal((rows, length, RQ)), jnp.float32))


def plain_indexer(partitioner=None):
    return Indexer(num_heads=NI, head_dim=HI, rope_head_dim=HR, q_lora_rank=RQ,
                   inputs_shape=(B, L, D), partitioner=partitioner, rngs=nnx.Rngs(4))


def test_select_in_chunks_equals_the_full_topk():
    """`select` in query chunks of 4 and key blocks of 5 (not a divisor of 24: the keys are
    padded) and with the defaults gives exactly `topk` of the full [B, L, L] scores, on packed
    rows with padding (queries near a document's start have empty slots)."""
    ind = plain_indexer()
    pos, seg = (jnp.asarray(a) for a in packed())
    x, q_lat = random_inputs(1)
    want = np.asarray(Indexer.topk(ind(x, q_lat, positions=pos, segment_ids=seg), TOPK, pos))
    assert (want == -1).any() and (want >= 0).any()
    for chunk, block in ((4, 5), ("auto", "auto")):
        got = jax.jit(lambda x, q, c=chunk, b=block: ind.select(
            x, q, TOPK, positions=pos, segment_ids=seg, query_chunk=c, key_block=b))(x, q_lat)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{chunk}, {block}")


def test_select_keys_keeps_the_tie_rule_across_blocks_and_chunks():
    """Integer queries, weights and keys (exact sums in float32, so many equal scores) on a
    shuffled row of two documents: every chunking gives `topk(score)`'s indices exactly, so
    ties resolve to the larger position whichever block or chunk the keys fall in."""
    Lr, Ni, Hi, k = 32, 4, 4, 5
    ind = Indexer(num_heads=Ni, head_dim=Hi, rope_head_dim=2, q_lora_rank=4,
                  inputs_shape=(1, Lr, 8), partitioner=None, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.integers(-1, 2, (1, Lr, Ni, Hi)), jnp.float32)
    w = jnp.asarray(rng.integers(0, 3, (1, Lr, Ni)), jnp.float32)
    keys = jnp.asarray(rng.integers(-1, 2, (1, Lr, Hi)), jnp.float32)
    perm = rng.permutation(Lr)
    pos = jnp.asarray(np.concatenate([np.arange(20), np.arange(12)])[perm][None], jnp.int32)
    seg = jnp.asarray(np.array([1] * 20 + [2] * 12)[perm][None], jnp.int32)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    scores = ind.score(q, w, keys, **kw)
    want = np.asarray(Indexer.topk(scores, k, pos))
    # the tie rule decides membership somewhere: the k-th best equals the next visible score
    s = np.sort(np.where(np.isfinite(scores), scores, -np.inf)[0], axis=-1)[:, ::-1]
    assert np.any(np.isfinite(s[:, k]) & (s[:, k - 1] == s[:, k]))
    for chunk, block in ((8, 3), (1, 32), (4, 1)):
        got = jax.jit(lambda q, w, keys, c=chunk, b=block: ind.select_keys(
            q, w, keys, k, **kw, query_chunk=c, key_block=b))(q, w, keys)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{chunk}, {block}")


def test_blocks_no_query_of_a_chunk_sees_are_not_scored():
    """`select_keys` scores a key block for a query chunk only if some pair is visible: on one
    causal document (the natural order, and the cp=2 load-balanced order) the count of scored
    blocks (a `score` override that counts its calls at run time) is the count of (chunk,
    block) pairs with a visible pair, here 10 of 16 in the natural order."""
    calls = []

    class Counting(Indexer):
        def score(self, q, w, k, **kw):
            jax.debug.callback(lambda: calls.append(1))
            return super().score(q, w, k, **kw)

    Lr, C = 32, 8
    ind = Counting(num_heads=2, head_dim=4, rope_head_dim=2, q_lora_rank=4,
                   inputs_shape=(1, Lr, 8), partitioner=None, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(6)
    q, w, keys = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                  for s in ((1, Lr, 2, 4), (1, Lr, 2), (1, Lr, 4)))
    import zoo

    natural = np.arange(Lr)
    balanced = zoo.data.load_balance(natural[None], 2, strategy="document",
                                     positions=natural[None], segment_ids=np.ones((1, Lr)))[0]
    for order in (natural, balanced):
        pos = jnp.asarray(order[None], jnp.int32)
        seg = jnp.ones((1, Lr), jnp.int32)
        kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
        blocks = order.reshape(-1, C)
        expect = sum(int(blocks[kb].min() <= blocks[qc].max())
                     for qc in range(Lr // C) for kb in range(Lr // C))
        calls.clear()
        got = ind.select_keys(q, w, keys, 3, **kw, query_chunk=C, key_block=C)
        jax.block_until_ready(got)
        jax.effects_barrier()
        want = Indexer.topk(Indexer.score(ind, q, w, keys, **kw), 3, pos)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert len(calls) == expect < (Lr // C) ** 2, (len(calls), expect)
        if order is natural:
            assert expect == 10


def test_select_under_context_parallelism_equals_unsharded(devices):
    """Under data 2 x context 4 on packed rows reordered by `zoo.data.load_balance`, `select`
    (chunks of 2 of each shard's 6 queries, key blocks of 5 over the all-gathered 24) picks
    the same keys as the unsharded full top-k."""
    import zoo

    p = zoo.Partitioner(zoo.make_mesh(data=2, context=4), "cp")
    sharded, plain = plain_indexer(p), plain_indexer(None)
    for (_, mine), (_, theirs) in zip(nnx.iter_graph(sharded), nnx.iter_graph(plain)):
        if isinstance(mine, nnx.Param):
            mine[...] = jax.device_put(theirs[...], mine[...].sharding)
    pos, seg = packed()
    x, q_lat = random_inputs(2)
    want = np.asarray(Indexer.topk(plain(x, q_lat, positions=jnp.asarray(pos),
                                         segment_ids=jnp.asarray(seg)), TOPK, jnp.asarray(pos)))
    index = np.broadcast_to(np.arange(L), (B, L))
    bal = zoo.data.load_balance(dict(x=np.asarray(x), q=np.asarray(q_lat), positions=pos,
                                     segment_ids=seg, index=index), 4, strategy="document")
    assert not np.array_equal(bal["index"], index)
    got = np.asarray(jax.jit(lambda m, x, q, pos, seg: m.select(
        x, q, TOPK, positions=pos, segment_ids=seg, query_chunk=2, key_block=5))(
        sharded, *(jnp.asarray(bal[n]) for n in ("x", "q", "positions", "segment_ids"))))
    # back to the natural order: the keys the indices name, then the rows of queries
    got = np.where(got >= 0, np.take_along_axis(bal["index"][:, None, :].repeat(L, 1),
                                                np.maximum(got, 0), axis=2), -1)
    got = np.take_along_axis(got, np.argsort(bal["index"], axis=1)[..., None], axis=1)
    np.testing.assert_array_equal(got, want)


def test_selection_memory_is_bounded():
    """Compiled for one row of 2,048 keys and 8 heads, the selection in chunks of 64 queries and
    blocks of 256 keys holds a small fraction of what the unchunked one holds (its [L, N, S]
    float32 per-head scores: 128 MiB)."""
    Lr, Ni, Hi = 2048, 8, 16
    ind = Indexer(num_heads=Ni, head_dim=Hi, rope_head_dim=8, q_lora_rank=8,
                  inputs_shape=(1, Lr, 16), partitioner=None, rngs=nnx.Rngs(0))
    sds = jax.ShapeDtypeStruct
    args = (sds((1, Lr, Ni, Hi), jnp.float32), sds((1, Lr, Ni), jnp.float32),
            sds((1, Lr, Hi), jnp.float32), sds((1, Lr), jnp.int32), sds((1, Lr), jnp.int32))

    def temp(chunk, block):
        def f(q, w, keys, pos, seg):
            return ind.select_keys(q, w, keys, 64, q_positions=pos, kv_positions=pos,
                                   q_segment_ids=seg, kv_segment_ids=seg, query_chunk=chunk,
                                   key_block=block)
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    full, chunked = temp(None, Lr), temp(64, 256)
    assert full >= Lr * Ni * Lr * 4, full
    assert chunked < full / 16, (chunked, full)


def test_select_chunk_errors():
    ind = plain_indexer()
    x, q_lat = random_inputs(0)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    for bad, match in (({"query_chunk": 0}, "query_chunk=0"),
                       ({"key_block": True}, "key_block=True"),
                       ({"query_chunk": 5}, "query_chunk=5 must divide the 24")):
        with pytest.raises(ValueError, match=match):
            ind.select(x, q_lat, TOPK, positions=pos, **bad)
