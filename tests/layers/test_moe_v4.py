"""DeepSeek-V4's MoE options in `zoo.layers.MoE`: ``sqrtsoftplus`` scores with a selection
bias, hash routing (``tid2eid``), SwiGLU clamped (routed and shared experts), against
transformers' ``DeepseekV4SparseMoeBlock`` (``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter``,
torch fp32, forward and gradients), the routing against a plain per-token loop, and hash
routing under expert parallelism equal to unsharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import assert_close
from zoo.layers.moe import MoE
from zoo.ops import moe as ops
from zoo.ops.grouped import GLU
from zoo.partitioning import Partitioner, make_mesh

torch = pytest.importorskip("torch")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

B, L, D, F, E, K, V, LIMIT, SCALE = 2, 8, 16, 8, 8, 2, 24, 1.5, 1.5


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, L))


def table(seed=0):
    """A tid2eid table: K distinct experts per token id."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(E)[:K] for _ in range(V)]).astype(np.int64)


def plain_route(logits, k, bias=None, fixed=None, scale=SCALE):
    """One token at a time: sqrt(softplus) scores, the k best of scores + bias (or the fixed
    experts), their scores normalised (+1e-20) and scaled."""
    w_out, i_out = [], []
    for row, b_row, f_row in zip(logits.reshape(-1, E), *(
            [bias] * logits[..., 0].size if bias is not None else [None] * logits[..., 0].size,
            fixed.reshape(-1, k) if fixed is not None else [None] * logits[..., 0].size)):
        s = np.sqrt(np.log1p(np.exp(row.astype(np.float64))))
        idx = f_row if f_row is not None else np.argsort(-(s + (0 if b_row is None else b_row)))[:k]
        w = s[idx] / (s[idx].sum() + 1e-20)
        w_out.append(w * scale)
        i_out.append(idx)
    shape = (*logits.shape[:-1], k)
    return np.reshape(w_out, shape), np.reshape(i_out, shape)


def test_route_sqrtsoftplus_and_fixed_indices_match_plain_loop():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((B, L, E)).astype(np.float32) * 2
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32)
    w, i, s = ops.route(jnp.asarray(logits), k=K, scoring="sqrtsoftplus",
                        bias=jnp.asarray(bias), routed_scaling_factor=SCALE)
    ref_w, ref_i = plain_route(logits, K, bias=bias)
    np.testing.assert_array_equal(np.sort(np.asarray(i), -1), np.sort(ref_i, -1))
    order = np.argsort(np.asarray(i), -1), np.argsort(ref_i, -1)
    assert_close(np.take_along_axis(np.asarray(w), order[0], -1),
                 np.take_along_axis(ref_w, order[1], -1), "weights", rtol=1e-6)
    assert_close(np.asarray(s), np.sqrt(np.log1p(np.exp(logits.astype(np.float64)))), "scores",
                 rtol=1e-6)
    # the bias moved the selection somewhere (else the test could not tell it is applied)
    _, unbiased = plain_route(logits, K)
    assert (np.sort(unbiased, -1) != np.sort(ref_i, -1)).any()
    fixed = table()[tokens()]
    w, i, _ = ops.route(jnp.asarray(logits), k=K, scoring="sqrtsoftplus", indices=fixed,
                        bias=jnp.asarray(bias), routed_scaling_factor=SCALE)
    ref_w, ref_i = plain_route(logits, K, fixed=fixed)
    np.testing.assert_array_equal(np.asarray(i), ref_i)
    assert_close(np.asarray(w), ref_w, "hashed weights", rtol=1e-6)


def hf_block(hashed: bool, seed: int):
    cfg = DeepseekV4Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E,
                           num_experts_per_tok=K, n_shared_experts=1, vocab_size=V,
                           num_hidden_layers=1, routed_scaling_factor=SCALE,
                           swiglu_limit=LIMIT, scoring_func="sqrtsoftplus",
                           mlp_layer_types=["hash_moe" if hashed else "moe"])
    block = v4.DeepseekV4SparseMoeBlock(cfg, layer_idx=0).float()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p))
        if hashed:
            block.gate.tid2eid.copy_(torch.from_numpy(table(seed)))
        else:
            block.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    return block


def ours_from(block, hashed: bool, partitioner=None, **kw):
    moe = MoE(num_experts=E, num_experts_per_tok=K, mlp_dim=F, inputs_shape=(B, L, D),
              partitioner=partitioner, scoring="sqrtsoftplus",
              routed_scaling_factor=SCALE, num_shared_experts=1,
              activation=GLU(limit=LIMIT), shared_limit=LIMIT,
              hash_vocab_size=V if hashed else None, rngs=nnx.Rngs(0), **kw)
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gate_up, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]
    values = {("router",): sd["gate.weight"].T, ("wi_gate",): gate_up[:, :F].transpose(0, 2, 1),
              ("wi_up",): gate_up[:, F:].transpose(0, 2, 1), ("wo",): down.transpose(0, 2, 1)}
    for name in ("gate", "up", "down"):
        values[("shared_experts", name, "kernel")] = sd[f"shared_experts.{name}_proj.weight"].T
    if hashed:
        values[("tid2eid",)] = sd["gate.tid2eid"].astype(np.int32)
        assert moe.e_score_correction_bias is None
    else:
        values[("e_score_correction_bias",)] = sd["gate.e_score_correction_bias"]
        assert moe.tid2eid is None
    flat = dict(nnx.to_flat_state(nnx.state(moe)))
    assert set(values) == set(flat), set(flat) ^ set(values)
    for path, value in values.items():
        flat[path][...] = jax.device_put(jnp.asarray(value), flat[path][...].sharding)
    return moe


@pytest.mark.parametrize("hashed", [False, True], ids=["sqrtsoftplus", "hash"])
def test_matches_transformers_forward_and_grads(hashed):
    block = hf_block(hashed, seed=int(hashed))
    moe = ours_from(block, hashed)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    ct = rng.standard_normal((B, L, D)).astype(np.float32)
    ids = tokens(3)
    tx = torch.tensor(x, requires_grad=True)
    out = block(tx, input_ids=torch.tensor(ids))
    (out * torch.tensor(ct)).sum().backward()
    # the clamps bite: some gate and up pre-activations lie beyond the limit
    with torch.no_grad():
        pre = torch.einsum("td,efd->tef", tx.reshape(-1, D), block.experts.gate_up_proj)
    assert (pre[..., :F] > LIMIT).float().mean() > 0.05
    assert (pre[..., F:].abs() > LIMIT).float().mean() > 0.05

    def loss(moe, x):
        y, aux = moe(x, jnp.asarray(ids)) if hashed else moe(x)
        return jnp.sum(y * ct), (y, aux)

    (_, (y, aux)), (g, gx) = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        moe, jnp.asarray(x))
    assert_close(np.asarray(y), out.detach().numpy(), "moe output", rtol=1e-5)
    assert_close(np.asarray(gx), tx.grad.numpy(), "d x", rtol=1e-4)
    assert_close(np.asarray(g.router[...]).T, block.gate.weight.grad.numpy(), "d router",
                 rtol=1e-4)
    gu = block.experts.gate_up_proj.grad.numpy()
    assert_close(np.asarray(g.wi_gate[...]), gu[:, :F].transpose(0, 2, 1), "d gate", rtol=1e-4)
    assert_close(np.asarray(g.wi_up[...]), gu[:, F:].transpose(0, 2, 1), "d up", rtol=1e-4)
    assert_close(np.asarray(g.wo[...]),
                 block.experts.down_proj.grad.numpy().transpose(0, 2, 1), "d down", rtol=1e-4)
    assert_close(np.asarray(g.shared_experts.up.kernel[...]),
                 block.shared_experts.up_proj.weight.grad.numpy().T, "d shared up", rtol=1e-4)
    if hashed:  # the experts are the table's
        counts = np.bincount(table(1)[ids].reshape(-1), minlength=E)
        np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), counts)
        assert "tid2eid" not in {p[0] for p, _ in nnx.to_flat_state(nnx.state(g, nnx.Param))}


@pytest.mark.slow  # ~20 s on a loaded 2-core box: three compiled gradients
def test_hash_routing_under_expert_parallelism_equals_unsharded(devices):
    """ep_as_cp (the expert axis shards the sequence outside the experts) with all_to_all, and
    expert x tensor with all_gather: forward and gradients equal the unsharded layer's."""
    block = hf_block(True, seed=4)
    ref = ours_from(block, True)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    ct = rng.standard_normal((B, L, D)).astype(np.float32)
    ids = jnp.asarray(tokens(6))

    def loss(moe, x, ids):
        y, _ = moe(x, ids)
        return jnp.sum(y * ct)

    ref_l, (ref_g, ref_gx) = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(
        ref, jnp.asarray(x), ids)
    for strategy, mesh, dispatch in (("ep_as_cp", dict(fsdp=2, expert=4), "all_to_all"),
                                     ("fsdp", dict(expert=2, tensor=2), "all_gather")):
        n = int(np.prod(list(mesh.values())))
        p = Partitioner(make_mesh(**mesh, devices=devices[:n]), strategy)
        moe = ours_from(block, True, partitioner=p, dispatch=dispatch)
        act = p.sharding(("batch", "length", "act_embed"))
        xs = jax.device_put(jnp.asarray(x), act)
        ids_s = jax.device_put(ids, p.sharding(("batch", "length")))
        got_l, (g, gx) = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(moe, xs, ids_s)
        assert_close(float(got_l), float(ref_l), f"{strategy} loss", rtol=1e-5)
        assert_close(np.asarray(gx), np.asarray(ref_gx), f"{strategy} d x", rtol=1e-4)
        for name in ("router", "wi_gate", "wo"):
            assert_close(np.asarray(getattr(g, name)[...]), np.asarray(getattr(ref_g, name)[...]),
                         f"{strategy} d {name}", rtol=1e-4)


def test_errors():
    kw = dict(num_experts=E, num_experts_per_tok=K, mlp_dim=F, inputs_shape=(B, L, D),
              partitioner=None, scoring="sqrtsoftplus", rngs=nnx.Rngs(0))
    moe = MoE(hash_vocab_size=V, **kw)
    x = jnp.zeros((B, L, D))
    with pytest.raises(ValueError, match=r"needs the token ids.*moe\(x, tokens=ids\)"):
        moe(x)
    with pytest.raises(ValueError, match="hash_vocab_size=0 must be a positive int"):
        MoE(hash_vocab_size=0, **kw)
    with pytest.raises(ValueError, match="n_group=2 has no meaning"):
        MoE(hash_vocab_size=V, n_group=2, topk_group=2, **kw)
    with pytest.raises(ValueError, match="scoring='relu' must be one of"):
        MoE(**{**kw, "scoring": "relu"})
    assert MoE(**kw).e_score_correction_bias is not None  # sqrtsoftplus selects with a bias
