"""`zoo.layers.HyperConnection` / `HyperHead` (DeepSeek-V4's mHC) against transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` (torch fp32, random weights copied
through the layers' own `hf_keys`, the decoder layer's expand step written as transformers
does), forward and gradients; the mixing matrix against a plain Sinkhorn loop; sharded
streams equal unsharded ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import assert_close
from zoo.layers.hyper_connection import (HyperConnection, HyperHead, expand_streams,
                                         sinkhorn)
from zoo.partitioning import Partitioner, make_mesh

torch = pytest.importorskip("torch")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

B, L, N, D, ITERS = 2, 8, 4, 16, 20


def hf_config():
    return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=ITERS, hc_eps=1e-6,
                            rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=32)


def copy_weights(hf_module, ours, prefix="m"):
    """The torch module's random weights into ours, through our own Hugging Face keys."""
    state = {k: v.detach().numpy() for k, v in hf_module.state_dict().items()}
    rows = ours.hf_keys(prefix)
    assert sorted(k for r in rows for k in r.keys) == sorted(f"{prefix}.{k}" for k in state)
    for row in rows:
        var = functools.reduce(getattr, row.path, ours)
        var[...] = jnp.asarray(row.to_zoo(state[row.keys[0][len(prefix) + 1:]], var.shape))


def random_(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def streams(seed=1):
    return np.random.default_rng(seed).standard_normal((B, L, N, D)).astype(np.float32)


def plain_sinkhorn(m, iters, eps):
    """Column, then (row, column) x (iters - 1), one matrix at a time in float64."""
    m = np.array(m, np.float64)
    for i in range(2 * iters - 1):
        axis = 0 if i % 2 == 0 else 1  # sum over rows (column sums) first
        m = m / (m.sum(axis=axis, keepdims=True) + eps)
    return m


def test_sinkhorn_matches_plain_loop_and_is_doubly_stochastic():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, N, N)) * 3
    pos = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True) + 1e-6
    ours = np.asarray(sinkhorn(jnp.asarray(pos, jnp.float32), ITERS, 1e-6))
    for i in range(3):
        assert_close(ours[i], plain_sinkhorn(pos[i], ITERS, 1e-6), "sinkhorn", rtol=1e-5)
    np.testing.assert_allclose(ours.sum(-2), 1.0, atol=1e-5)  # columns: exact after the last
    np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-3)  # rows: converged


def test_hyper_connection_matches_transformers_forward_and_grads():
    hf = random_(v4.DeepseekV4HyperConnection(hf_config()).float(), 0)
    ours = HyperConnection(embed_dim=D, hc_mult=N, sinkhorn_iters=ITERS, eps=1e-6,
                           norm_eps=1e-6, partitioner=None, rngs=nnx.Rngs(0))
    copy_weights(hf, ours)
    x = streams()
    y = np.random.default_rng(2).standard_normal((B, L, D)).astype(np.float32)
    ct = np.random.default_rng(3).standard_normal((B, L, N, D)).astype(np.float32)
    ct_h = np.random.default_rng(4).standard_normal((B, L, D)).astype(np.float32)

    tx, ty = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
    post, comb, collapsed = hf(tx)
    out = post.unsqueeze(-1) * ty.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), tx)
    ((out * torch.tensor(ct)).sum() + (collapsed * torch.tensor(ct_h)).sum()).backward()

    def loss(module, x, y):
        h, post, comb = module.collapse(x)
        out = module.expand(y, x, post, comb)
        return jnp.sum(out * ct) + jnp.sum(h * ct_h), (h, post, comb, out)

    (_, (h, p_, c_, o_)), (g_mod, gx, gy) = jax.jit(nnx.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True))(ours, jnp.asarray(x), jnp.asarray(y))
    assert_close(np.asarray(h), collapsed.detach().numpy(), "collapsed")
    assert_close(np.asarray(p_), post.detach().numpy(), "post")
    assert_close(np.asarray(c_), comb.detach().numpy(), "comb")
    assert_close(np.asarray(o_), out.detach().numpy(), "streams out")
    assert_close(np.asarray(gx), tx.grad.numpy(), "d streams", rtol=1e-4)
    assert_close(np.asarray(gy), ty.grad.numpy(), "d block output", rtol=1e-4)
    assert_close(np.asarray(g_mod.fn[...]).T, hf.fn.grad.numpy(), "d fn", rtol=1e-4)
    assert_close(np.asarray(g_mod.base[...]), hf.base.grad.numpy(), "d base", rtol=1e-4)
    assert_close(np.asarray(g_mod.scale[...]), hf.scale.grad.numpy(), "d scale", rtol=1e-4)
    # the mixing matrix is doubly stochastic, per token
    np.testing.assert_allclose(np.asarray(c_).sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(c_).sum(-1), 1.0, atol=1e-3)
    # __call__ is collapse, block, expand
    assert_close(np.asarray(ours(jnp.asarray(x), lambda h: 2 * h)),
                 np.asarray(ours.expand(2 * h, jnp.asarray(x), p_, c_)), "__call__")


def test_hyper_head_matches_transformers_forward_and_grads():
    hf = random_(v4.DeepseekV4HyperHead(hf_config()).float(), 1)
    ours = HyperHead(embed_dim=D, hc_mult=N, eps=1e-6, norm_eps=1e-6, partitioner=None,
                     rngs=nnx.Rngs(0))
    copy_weights(hf, ours)
    x = streams(5)
    ct = np.random.default_rng(6).standard_normal((B, L, D)).astype(np.float32)
    tx = torch.tensor(x, requires_grad=True)
    out = hf(tx)
    (out * torch.tensor(ct)).sum().backward()

    def loss(module, x):
        y = module(x)
        return jnp.sum(y * ct), y

    (_, y), (g_mod, gx) = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        ours, jnp.asarray(x))
    assert_close(np.asarray(y), out.detach().numpy(), "hyper head")
    assert_close(np.asarray(gx), tx.grad.numpy(), "d streams", rtol=1e-4)
    assert_close(np.asarray(g_mod.hc_fn[...]).T, hf.hc_fn.grad.numpy(), "d hc_fn", rtol=1e-4)
    assert_close(np.asarray(g_mod.hc_scale[...]), hf.hc_scale.grad.numpy(), "d hc_scale",
                 rtol=1e-4)


def test_sharded_streams_equal_unsharded(devices):
    """fsdp x context x tensor: the streams shard like the residual stream; forward and
    gradients equal the unsharded layer's."""
    mesh = make_mesh(fsdp=2, context=2, tensor=2, devices=devices)
    p = Partitioner(mesh, "cp")
    kw = dict(embed_dim=D, hc_mult=N, sinkhorn_iters=4, rngs=nnx.Rngs(3))
    sharded, plain = HyperConnection(partitioner=p, **kw), HyperConnection(partitioner=None, **kw)
    head_s, head_p = (HyperHead(embed_dim=D, hc_mult=N, partitioner=q, rngs=nnx.Rngs(4))
                      for q in (p, None))
    for dst, src in ((sharded, plain), (head_s, head_p)):  # same values, by key path
        values = dict(nnx.to_flat_state(nnx.state(src)))
        for path, var in nnx.to_flat_state(nnx.state(dst)):
            var[...] = values[path][...]
    x = jnp.asarray(streams(7))

    def loss(hc, head, x):
        out = hc(x, lambda h: jnp.tanh(h))
        return jnp.sum(head(out) ** 2)

    ref_l, ref_g = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1, 2)))(plain, head_p, x)
    xs = jax.device_put(x, p.sharding(("batch", "length", None, "act_embed")))
    got_l, got_g = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1, 2)))(sharded, head_s, xs)
    assert p.spec(("batch", "length", None, "act_embed"))[0] is not None
    assert_close(float(got_l), float(ref_l), "loss", rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(got_g[0])), jax.tree.leaves(nnx.state(ref_g[0]))):
        assert_close(np.asarray(a), np.asarray(b), "d hc", rtol=1e-4)
    assert_close(np.asarray(got_g[2]), np.asarray(ref_g[2]), "d streams", rtol=1e-4)


def test_expand_streams_and_errors():
    x = jnp.arange(2 * 3 * D, dtype=jnp.float32).reshape(2, 3, D)
    s = expand_streams(x, N)
    assert s.shape == (2, 3, N, D) and bool(jnp.all(s[:, :, 2] == x))
    hc = HyperConnection(embed_dim=D, hc_mult=N, partitioner=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"streams \[batch, length, 4, 16\].*expand_streams"):
        hc.collapse(x)
    with pytest.raises(ValueError, match="hc_mult=0 must be a positive int"):
        HyperConnection(embed_dim=D, hc_mult=0, partitioner=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        HyperConnection(embed_dim=D, sinkhorn_iters=0, partitioner=None, rngs=nnx.Rngs(0))
