"""Core layers against numpy / independent formulas, and their parameter shardings."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.layers import MLP, Embed, Linear, RMSNorm, RoPE, YaRN
from zoo.partitioning import Partitioner, make_mesh


def _np(x):
    return np.asarray(x, dtype=np.float64)


def test_rmsnorm_matches_numpy():
    norm = RMSNorm(16, eps=1e-5, rngs=nnx.Rngs(0))
    norm.scale[...] = jax.random.normal(jax.random.key(1), (16,))
    x = jax.random.normal(jax.random.key(2), (2, 5, 16)) * 3
    xn = _np(x)
    want = _np(norm.scale[...]) * xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(_np(norm(x)), want, rtol=1e-5, atol=1e-6)
    # bf16 input: normalised in float32, result in bf16 within bf16 precision
    yb = norm(x.astype(jnp.bfloat16))
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_allclose(_np(yb.astype(jnp.float32)), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="RMSNorm of dim 16"):
        norm(jnp.ones((2, 8)))


def test_mlp_forward_and_grad_match_numpy():
    mlp = MLP(embed_dim=8, mlp_dim=12, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (2, 3, 8))
    g, u, d = (_np(m.kernel[...]) for m in (mlp.gate, mlp.up, mlp.down))
    xn = _np(x)
    silu = lambda z: z / (1 + np.exp(-z))
    h = silu(xn @ g) * (xn @ u)
    np.testing.assert_allclose(_np(mlp(x)), h @ d, rtol=1e-5, atol=1e-6)
    # d(sum y)/d down = h^T @ ones: the gradient goes through the parameters too
    grads = nnx.grad(lambda m: m(x).sum())(mlp)
    want = h.reshape(-1, 12).T @ np.ones((6, 8))
    np.testing.assert_allclose(_np(grads.down.kernel[...]), want, rtol=1e-5, atol=1e-5)


def test_linear_multi_dim_features_and_bias():
    lin = Linear(6, (2, 3), in_axes=("embed",), out_axes=("heads", "head_dim"), use_bias=True,
                 rngs=nnx.Rngs(0))
    lin.bias[...] = jnp.arange(6.0).reshape(2, 3)
    x = jax.random.normal(jax.random.key(0), (4, 6))
    want = np.einsum("bd,dnh->bnh", _np(x), _np(lin.kernel[...])) + np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(_np(lin(x)), want, rtol=1e-5, atol=1e-6)
    back = Linear((2, 3), 6, in_axes=("heads", "head_dim"), out_axes=("embed",),
                  rngs=nnx.Rngs(1))
    np.testing.assert_allclose(_np(back(lin(x))), np.einsum("bnh,nhd->bd", want,
                               _np(back.kernel[...])), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not match in_features"):
        lin(jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="must name each"):
        Linear(6, 4, in_axes=("embed", "mlp"), out_axes=("mlp",), rngs=nnx.Rngs(0))


def test_embed_lookup_and_attend():
    emb = Embed(11, 4, rngs=nnx.Rngs(0))
    tokens = jnp.array([[0, 3, 10], [5, 5, 1]])
    table = _np(emb.embedding[...])
    np.testing.assert_array_equal(_np(emb(tokens)), table[np.asarray(tokens)])
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    np.testing.assert_allclose(_np(emb.attend(x)), _np(x) @ table.T, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="integer token ids"):
        emb(jnp.ones((2, 3)))


@pytest.mark.parametrize("strategy,mesh,local", [
    ("fsdp", dict(fsdp=8), ("fsdp",)), ("ep_as_cp", dict(fsdp=2, expert=4), None),
    ("fsdp", dict(fsdp=4, tensor=2), None)])
def test_sharded_embed_lookup_is_exact(strategy, mesh, local, devices):
    """Under FSDP each device looks up its own feature slice for every token and the rows move
    by all-to-all (`Embed._lookup_slices`): no table-sized gather; elsewhere the table is
    gathered. Rows and the table's gradient equal the unsharded lookup's either way."""
    emb = Embed(64, 32, partitioner=Partitioner(make_mesh(**mesh), strategy),
                dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert (emb._local_lookup() or (None,))[0] == local
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    w = jax.random.normal(jax.random.key(2), (8, 16, 32))

    def loss(e, t):
        return jnp.sum(e(t).astype(jnp.float32) * w)

    fwd = jax.jit(lambda e, t: e(t))
    np.testing.assert_array_equal(_np(fwd(emb, tokens)),
                                  _np(emb.embedding[...].astype(jnp.bfloat16))[np.asarray(tokens)])
    grad = jax.jit(jax.grad(loss))(emb, tokens).embedding[...]
    want = np.zeros((64, 32))
    np.add.at(want, np.asarray(tokens), _np(w))
    np.testing.assert_allclose(_np(grad), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    hlo = fwd.lower(emb, tokens).compile().as_text()
    whole_table = re.search(r"= (bf16|f32)\[(64|32),32\]\S* all-gather", hlo)
    assert (whole_table is None) == bool(local), hlo
    assert ("all-to-all" in hlo) == bool(local)


def _rope_reference(x, positions, inv_freq, interleaved, factor=1.0):
    """Rotation as complex multiplication: an independent formulation."""
    x = _np(x)
    h = x.shape[-1]
    if interleaved:
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : h // 2] + 1j * x[..., h // 2:]
    # angles formed in float32, as Hugging Face does; the rotation itself in float64
    angle = _np(np.asarray(positions, np.float32)[..., None, None]
                * np.asarray(inv_freq, np.float32))
    z = z * np.exp(1j * angle) * factor
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : h // 2], out[..., h // 2:] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_complex_rotation(interleaved):
    rope = RoPE(theta=500.0, interleaved=interleaved)
    x = jax.random.normal(jax.random.key(0), (2, 7, 3, 8))
    positions = jnp.array([[0, 1, 2, 3, 0, 1, 9], [5, 4, 3, 2, 1, 0, 100]])
    inv = 1.0 / 500.0 ** (np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(_np(rope.apply(x, positions)),
                               _rope_reference(x, positions, inv, interleaved),
                               rtol=1e-5, atol=1e-5)
    # relative positions: <R(p)q, R(p')k> depends only on p - p'
    q = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(2), (1, 1, 1, 8))
    dots = [float((rope.apply(q, jnp.array([[p + s]])) * rope.apply(k, jnp.array([[s]]))).sum())
            for p, s in [(3, 0), (3, 10), (3, 57)]]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-4)


def test_rope_interleaved_and_half_split_give_equal_scores_after_permutation():
    # Hugging Face DeepSeek de-interleaves q and k before a half-split rotation: scores match.
    q = jax.random.normal(jax.random.key(1), (1, 4, 1, 8))
    k = jax.random.normal(jax.random.key(2), (1, 4, 1, 8))
    pos = jnp.arange(4)[None]
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    inter = RoPE(interleaved=True)
    half = RoPE(interleaved=False)
    s1 = jnp.einsum("blnh,bsnh->bls", inter.apply(q, pos), inter.apply(k, pos))
    s2 = jnp.einsum("blnh,bsnh->bls", half.apply(q[..., perm], pos), half.apply(k[..., perm], pos))
    np.testing.assert_allclose(_np(s1), _np(s2), rtol=1e-5, atol=1e-5)


def test_yarn_matches_hugging_face():
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                   beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0, rope_theta=10000.0)
    cfg = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=scaling,
                           max_position_embeddings=163840)
    cfg.head_dim = 64
    inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["yarn"](cfg, torch.device("cpu"))
    yarn = YaRN(factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                mscale_all_dim=1.0)
    rope = RoPE(theta=10000.0, interleaved=True, scaling=yarn)
    np.testing.assert_allclose(rope.inv_freq(64), inv_hf.numpy(), rtol=1e-5)
    assert math.isclose(rope.cos_sin_factor(), factor_hf, rel_tol=1e-7)
    # DeepSeek's softmax-scale correction: (0.1 * ln(40) + 1)**2
    assert math.isclose(yarn.softmax_scale_multiplier(), (0.1 * math.log(40) + 1) ** 2)
    # mscale alone (no mscale_all_dim): cos/sin scaled by 0.1 ln(s) + 1
    plain = YaRN(factor=4.0, original_max_position_embeddings=2048)
    assert math.isclose(plain.cos_sin_factor(), 0.1 * math.log(4) + 1)
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 64))
    pos = jnp.array([[0, 7, 1000, 5000, 160000]])
    np.testing.assert_allclose(_np(rope.apply(x, pos)),
                               _rope_reference(x, pos, rope.inv_freq(64), True, factor_hf),
                               rtol=1e-4, atol=1e-4)


def test_rope_errors():
    with pytest.raises(ValueError, match="must be even"):
        RoPE().apply(jnp.ones((1, 2, 1, 7)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="positions of shape"):
        RoPE().apply(jnp.ones((1, 2, 1, 8)), jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="factor > 0"):
        YaRN(factor=0.0, original_max_position_embeddings=4096)


@pytest.mark.parametrize("sizes,strategy,gate_spec,moe_gate_spec,emb_spec", [
    (dict(fsdp=8), "fsdp", P("fsdp", None), P("fsdp", None), P(None, "fsdp")),
    (dict(fsdp=4, tensor=2), "fsdp", P("fsdp", "tensor"), P("fsdp", "tensor"),
     P("tensor", "fsdp")),
    (dict(fsdp=2, expert=2, context=2), "ep_as_cp", P(("fsdp", "context", "expert"), None),
     P(("fsdp", "context"), None), P(None, ("fsdp", "context", "expert"))),
    (dict(data=2, context=4), "cp", P("context", None), P("context", None), P(None, "context")),
])
def test_parameters_land_sharded(devices, sizes, strategy, gate_spec, moe_gate_spec, emb_spec):
    p = Partitioner(make_mesh(**sizes), strategy)
    mlp = MLP(embed_dim=16, mlp_dim=32, partitioner=p, rngs=nnx.Rngs(0))
    shared = MLP(embed_dim=16, mlp_dim=32, partitioner=p, scope="moe", rngs=nnx.Rngs(0))
    emb = Embed(64, 16, partitioner=p, rngs=nnx.Rngs(0))
    norm = RMSNorm(16, partitioner=p, rngs=nnx.Rngs(0))
    mesh = p.mesh
    for arr, spec in [(mlp.gate.kernel[...], gate_spec), (shared.gate.kernel[...], moe_gate_spec),
                      (emb.embedding[...], emb_spec), (norm.scale[...], P(None))]:
        assert arr.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), arr.ndim), (
            arr.sharding.spec, spec)
    # the sharded MLP computes what the unsharded one does
    plain = MLP(embed_dim=16, mlp_dim=32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (8, 8, 16))
    y = jax.jit(lambda m, x: m(x))(mlp, x)
    np.testing.assert_allclose(_np(y), _np(plain(x)), rtol=1e-5, atol=1e-5)
    assert y.sharding.is_equivalent_to(p.sharding(("batch", "length", "act_embed")), 3)


def test_indivisible_parameter_raises_at_construction(devices):
    p = Partitioner(make_mesh(fsdp=8), "fsdp")
    with pytest.raises(ValueError, match=r"dimension 0 \('embed', size 12\).*8 shards.*'fsdp'"):
        MLP(embed_dim=12, mlp_dim=32, partitioner=p, rngs=nnx.Rngs(0))
