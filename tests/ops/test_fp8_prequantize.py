"""FP8 weight copies made once (`zoo.ops.fp8.prequantize`, `QuantizedWeight`): the products
that take a copy equal those that quantise the weight themselves, forward and backward, with
leading (stack, expert) dims as batch dims; MLA's latent expansion takes the copy across its
shard_map, or falls back to per-shard quantisation where a 128-column block would straddle two
head shards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.ops import fp8


def data(shape, seed, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def weight_block_amaxes(jaxpr) -> int:
    """``reduce_max`` over ``[..., nr, 128, nc, 128]`` blocks in `jaxpr` and nested jaxprs."""
    n = 0
    for eqn in jaxpr.eqns:
        shape = eqn.invars[0].aval.shape if eqn.invars else ()
        n += (eqn.primitive.name == "reduce_max" and len(shape) >= 4
              and shape[-3] == shape[-1] == 128)
        for p in eqn.params.values():
            for inner in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(inner, "jaxpr", inner)
                n += weight_block_amaxes(inner) if hasattr(inner, "eqns") else 0
    return n


def test_prequantized_dot_is_dot_forward_and_backward():
    x, w = data((3, 5, 300), 0), data((300, 200), 1)

    def grads(weight_of):
        def loss(x, w):
            y = fp8.dot(x, weight_of(w))
            return jnp.sum(y * jnp.sin(y)), y
        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)

    (_, y), (dx, dw) = grads(lambda w: w)
    (_, y_pre), (dx_pre, dw_pre) = grads(fp8.prequantize)
    for a, b in ((y, y_pre), (dx, dx_pre), (dw, dw_pre)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert dw_pre.dtype == w.dtype and float(jnp.abs(dw_pre).max()) > 0


def test_prequantize_batch_dims_equal_quantize_per_slice():
    # a normal slice, one whose blocks' amax/448 fall below float32's smallest normal (the
    # statistics' scale extreme), an all-zero one
    ws = jnp.stack([data((300, 200), 2), data((300, 200), 3, 1e-37), jnp.zeros((300, 200))])
    x = data((4, 300), 4)

    @jax.jit
    def both(ws, x):
        pre = fp8.prequantize(ws)
        ref = [(*fp8.quantize(w, block=fp8.WEIGHT_BLOCK),
                fp8.quantize_stats(w, block=fp8.WEIGHT_BLOCK), fp8.dot(x, w)) for w in ws]
        mine = [(pre.q[i], pre.scale[i], pre.stats[i], fp8.dot(x, pre.map(lambda a, i=i: a[i])))
                for i in range(len(ws))]
        return pre, ref, mine

    pre, ref, mine = both(ws, x)
    assert pre.q.dtype == jnp.float8_e4m3fn and pre.scale.shape == (3, 3, 2)
    assert pre.stats.shape == (3, len(fp8.STATS)) and pre.shape == ws.shape
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(mine)):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert float(pre.stats[1, 1]) == 6 and float(pre.stats[0, 1]) == 0  # 6 blocks a slice


@pytest.mark.parametrize("tiles", [False, True])
def test_prequantized_ragged_dot_is_ragged_dot_forward_and_backward(tiles):
    """The MoE's grouped product with a ``[G, K, N]`` copy equals the one quantising the
    weight itself, bit for bit: output, the rows' (or the tiles' values') gradient and the
    weight's; for rows and for FP8 tiles from the dispatch (bfloat16 rows, float32 weight)."""
    m, k, n, sizes = 300, 200, 136, jnp.array([100, 0, 150, 40], jnp.int32)  # 10 rows unused
    x = jnp.asarray(data((m, k), 20), jnp.bfloat16 if tiles else jnp.float32)
    w = data((len(sizes), k, n), 21, 0.05)

    def grads(weight_of):
        def loss(x, w):
            y = fp8.ragged_dot(fp8.quantize_tiles(x) if tiles else x, weight_of(w), sizes)
            return jnp.sum(y * jnp.sin(y)), y
        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)

    (_, y), (dx, dw) = grads(lambda w: w)
    (_, y_pre), (dx_pre, dw_pre) = grads(fp8.prequantize)
    for a, b in ((y, y_pre), (dx, dx_pre), (dw, dw_pre)):
        assert a.dtype == b.dtype
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert dx_pre.dtype == x.dtype and dw_pre.dtype == w.dtype
    assert float(jnp.abs(dw_pre[2]).max()) > 0 and not np.any(np.asarray(dw_pre[1]))
    # the copy's values are what the product multiplies: a copy of other values changes it
    other = fp8.prequantize(2 * w)._replace(w=w)
    y_other = fp8.ragged_dot(fp8.quantize_tiles(x) if tiles else x, other, sizes)
    np.testing.assert_allclose(np.asarray(y_other), 2 * np.asarray(y), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="power_of_two=True with a QuantizedWeight"):
        fp8.ragged_dot(x, fp8.prequantize(w), sizes, power_of_two=True)
    with pytest.raises(ValueError, match=r"fp8.ragged_dot wants x \[M, K\]"):
        fp8.ragged_dot(x[:, :128], fp8.prequantize(w), sizes)


def test_prequantize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="prequantize wants a weight"):
        fp8.prequantize(jnp.ones((128,)))
    with pytest.raises(ValueError, match="power_of_two=True with a QuantizedWeight"):
        fp8.dot(jnp.ones((2, 128)), fp8.prequantize(jnp.ones((128, 128))), power_of_two=True)
    with pytest.raises(ValueError, match=r"fp8.dot wants x \[..., K\]"):
        fp8.dot(jnp.ones((2, 64)), fp8.prequantize(jnp.ones((128, 128))))


@pytest.mark.slow  # ~9-10 s each on a loaded 2-core box: four compiles of the ring's gradient
@pytest.mark.parametrize("hv", [32, 16])  # N*(Hn+Hv)/tensor = 128 (the copy crosses), 96 (not)
def test_mla_attention_takes_the_fp8_copy_under_tensor_and_ring_cp(devices, hv):
    """The op with ``kv_up``'s FP8 copy equals the op quantising ``kv_up`` itself, forward
    and backward, under 2-way context (ring) x 2-way tensor parallelism."""
    from zoo.ops import mla_attention
    from zoo.partitioning import Partitioner, make_mesh
    B, L, N, R, Hn, Hr = 2, 16, 4, 32, 32, 16
    q, latent, k_pe = data((B, L, N, Hn + Hr), 12), data((B, L, R), 13), data((B, L, Hr), 14)
    kv_up = data((R, N, Hn + hv), 15, 0.2)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    mesh = make_mesh(context=2, tensor=2, devices=devices[:4])
    p = Partitioner(mesh, "cp")

    def run(partitioner, implementation, pre, count=False):
        def loss(q, latent, k_pe, kv_up):
            w = fp8.prequantize(kv_up.reshape(R, -1)) if pre else kv_up
            o = mla_attention(q, latent, k_pe, w, qk_nope_head_dim=Hn, q_positions=pos,
                              kv_positions=pos, partitioner=partitioner,
                              implementation=implementation, fp8="blockwise")
            return jnp.sum(o * jnp.cos(o)), o
        if count:  # the forward's quantisations of kv_up (128x128-block amax reductions)
            return weight_block_amaxes(jax.make_jaxpr(loss)(q, latent, k_pe, kv_up).jaxpr)
        grad = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)
        return jax.jit(grad)(q, latent, k_pe, kv_up)

    # the copy crosses into the shard_map when each head shard holds whole 128-column blocks;
    # otherwise each shard quantises its own columns again
    assert run(p, "ring", True, count=True) == (1 if hv == 32 else 2)
    assert run(None, "auto", True, count=True) == 1

    (_, o), grads = run(p, "ring", False)
    (_, o_pre), grads_pre = run(p, "ring", True)
    np.testing.assert_allclose(np.asarray(o_pre), np.asarray(o), rtol=0, atol=1e-6)
    for g, g_pre in zip(grads, grads_pre):
        assert g_pre.dtype == g.dtype
        np.testing.assert_allclose(np.asarray(g_pre), np.asarray(g), rtol=0,
                                   atol=1e-6 * float(jnp.abs(g).max()))
