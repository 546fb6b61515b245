"""`zoo.ops.fp8` against a NumPy reference written here: a plain loop over blocks quantises with
ml_dtypes, and products of the dequantised operands in float64 give the exact value the FP8
GEMMs approximate up to float32 accumulation."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from zoo.ops import fp8

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def np_quantize(x, block, dtype=E4M3, power_of_two=False):
    """Loop over the blocks of a 2-D float32 array: (q, scale)."""
    x = np.asarray(x, np.float32)
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    (rows, cols), (br, bc) = x.shape, block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    q, scale = np.zeros(x.shape, dtype), np.zeros((nr, nc), np.float32)
    for i in range(nr):
        for j in range(nc):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = np.abs(blk).max() * np.float32(1 / fmax)
            if power_of_two and s > 0:
                s = np.float32(2.0 ** math.ceil(math.log2(float(s))))
            if s < np.finfo(np.float32).tiny:
                s = np.float32(1)
            scale[i, j] = s
            tile = np.clip(blk * (np.float32(1) / s), -fmax, fmax).astype(dtype)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = tile
    return q, scale


def dequantize(q, scale, block):
    """float64 q * scale, each scale repeated over its block."""
    br, bc = block
    full = np.repeat(np.repeat(np.asarray(scale, np.float64), br, 0), bc, 1)
    return np.asarray(q).astype(np.float64) * full[:q.shape[0], :q.shape[1]]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def data(shape, seed):
    return np.array(jax.random.normal(jax.random.key(seed), shape), np.float32)


@pytest.mark.parametrize("shape,block,power_of_two,dtype", [
    ((3, 300), (1, 128), False, E4M3),        # partial last tile
    ((300, 200), (128, 128), False, E4M3),    # partial blocks in both dims
    ((130, 129), (128, 128), True, E4M3),     # power-of-two scales
    ((4, 256), (1, 128), True, E5M2),
])
def test_quantize_matches_numpy(shape, block, power_of_two, dtype):
    x = data(shape, 0) * 3
    q, s = jax.jit(lambda x: fp8.quantize(x, block=block, dtype=dtype,
                                          power_of_two=power_of_two))(x)
    rq, rs = np_quantize(x, block, dtype, power_of_two)
    assert q.dtype == dtype and s.dtype == np.float32
    assert s.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    np.testing.assert_array_equal(np.asarray(s), rs)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), rq.astype(np.float32))
    fmax = ml_dtypes.finfo(dtype).max
    amax = np.abs(dequantize(rq, rs, block)).max()
    assert np.all(np.asarray(s) <= 2 * np.max(np.abs(x)) / fmax) and amax > 0


def test_quantize_zeros_outliers_and_batch_dims():
    x = data((2, 3, 256), 1)
    x[0, 1, :128] = 0.0                     # an all-zero tile
    x[1, 2, 5] = 3e4                        # one huge value in a tile
    x[1, 0, 130] = 1e-30                    # a tile of one tiny value: underflows, no NaN
    x[1, 0, 128:130] = 0.0
    x[1, 0, 131:] = 0.0
    q, s = fp8.quantize(jnp.asarray(x))
    assert q.shape == x.shape and s.shape == (2, 3, 2)
    qf = np.asarray(q).astype(np.float32)
    assert np.all(np.isfinite(qf)) and np.all(np.abs(qf) <= 448) and np.all(np.isfinite(s))
    for b in range(2):                      # leading dims are batch dims: each slice on its own
        rq, rs = np_quantize(x[b], (1, 128))
        np.testing.assert_array_equal(np.asarray(s[b]), rs)
        np.testing.assert_array_equal(qf[b], rq.astype(np.float32))
    assert np.all(qf[0, 1, :128] == 0) and s[0, 1, 0] == 1      # zeros are exact
    assert qf[1, 2, 5] == 448 and s[1, 2, 0] == np.float32(3e4) * np.float32(1 / 448)
    # the outlier's tile loses its small values, the neighbouring tile keeps full precision
    deq = dequantize(qf[1], np.asarray(s[1]), (1, 128))
    assert np.abs(deq[2, 128:] - x[1, 2, 128:]).max() <= 2 ** -4 * np.abs(x[1, 2, 128:]).max()


def test_quantize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least 2 dims"):
        fp8.quantize(jnp.ones(4))
    with pytest.raises(ValueError, match=r"float8_e4m3fn or jnp\.float8_e5m2"):
        fp8.quantize(jnp.ones((2, 4)), dtype=jnp.bfloat16)


@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2])
def test_dot_and_vjp_match_numpy_emulation(grad_dtype):
    m, k, n = 20, 300, 136                                   # partial tiles and blocks
    x, w, dy = data((m, k), 2), data((k, n), 3) * 0.05, data((m, n), 4)
    x[3, 7] = 200.0                                          # an outlier in one tile of x

    def f(x, w):
        return fp8.dot(x, w, grad_dtype=grad_dtype)

    y, vjp = jax.jit(lambda x, w: jax.vjp(f, x, w))(x, w)
    dx, dw = vjp(jnp.asarray(dy))
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32

    qx, sx = np_quantize(x, (1, 128))
    qw, sw = np_quantize(w, (128, 128))
    qdy, sdy = np_quantize(dy, (1, 128), grad_dtype)
    qxt, sxt = np_quantize(x.T, (1, 128))
    qdyc, sdyc = np_quantize(dy, (128, 1), grad_dtype)
    ref_y = dequantize(qx, sx, (1, 128)) @ dequantize(qw, sw, (128, 128))
    ref_dx = dequantize(qdy, sdy, (1, 128)) @ dequantize(qw, sw, (128, 128)).T
    ref_dw = dequantize(qxt, sxt, (1, 128)) @ dequantize(qdyc, sdyc, (128, 1))
    # the same quantisation: equal up to float32 accumulation
    for got, ref in ((y, ref_y), (dx, ref_dx), (dw, ref_dw)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    # against the float32 products: E4M3 keeps 3 mantissa bits (≤ 6.25% per element, ~5%
    # relative Frobenius error on a product); E5M2 gradients keep 2 (~10%)
    tol = 0.06 if grad_dtype == E4M3 else 0.12
    assert rel(y, x @ w) < 0.06
    assert rel(dx, dy @ w.T) < tol and rel(dw, x.T @ dy) < tol


def test_dot_batch_dims_and_dtypes():
    x = jnp.asarray(data((2, 3, 64), 5), jnp.bfloat16)
    w = jnp.asarray(data((64, 40), 6), jnp.bfloat16)
    y, y2 = jax.jit(lambda x, w: (fp8.dot(x, w), fp8.dot(x.reshape(6, 64), w)))(x, w)
    assert y.shape == (2, 3, 40) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y.reshape(6, 40)), np.asarray(y2))
    dx, dw = jax.jit(jax.grad(lambda x, w: fp8.dot(x, w).sum(), argnums=(0, 1)))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"x \[..., K\] and w \[K, N\]"):
        fp8.dot(x, w.T)


def test_dot_lowers_with_float8_operands():
    """XLA:CPU upcasts fp8 dots when it compiles, but the program it is given multiplies
    float8 operands, forward and backward."""
    x, w = data((8, 256), 7), data((256, 128), 8)

    def loss(x, w):
        return fp8.dot(x, w, grad_dtype=jnp.float8_e5m2).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield tuple(str(v.aval.dtype) for v in eqn.invars)
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    yield from dots(inner)

    kinds = sorted(set(dots(jaxpr.jaxpr)))
    # forward x·w, wgrad x^T·dy, dgrad dy·w^T
    assert kinds == [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"),
                     ("float8_e5m2", "float8_e4m3fn")], kinds
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    lines = [ln for ln in hlo.splitlines() if "stablehlo.dot_general" in ln]
    assert lines and all("f8E" in ln.split("->")[0].split(":")[-1] for ln in lines), lines


def test_ragged_dot_and_vjp_match_numpy_emulation():
    """The grouped (MoE) product: per group, the dequantised operands' product; rows past the
    groups give zeros; 128-row tiles of the weight gradient span group boundaries."""
    m, k, n, sizes = 300, 200, 136, np.array([100, 0, 150, 40], np.int32)  # 10 rows unused
    g = len(sizes)
    x, w, dy = data((m, k), 9), data((g, k, n), 10) * 0.05, data((m, n), 11)
    y, vjp = jax.jit(lambda x, w: jax.vjp(lambda x, w: fp8.ragged_dot(x, w, sizes), x, w))(x, w)
    dx, dw = vjp(jnp.asarray(dy))

    qx, sx = np_quantize(x, (1, 128))
    qdy, sdy = np_quantize(dy, (1, 128))
    qxt, sxt = np_quantize(x.T, (1, 128))
    qdyc, sdyc = np_quantize(dy, (128, 1))
    dqx, dqdy = dequantize(qx, sx, (1, 128)), dequantize(qdy, sdy, (1, 128))
    dqxt, dqdyc = dequantize(qxt, sxt, (1, 128)), dequantize(qdyc, sdyc, (128, 1))
    ref_y, ref_dx, ref_dw = np.zeros((m, n)), np.zeros((m, k)), np.zeros((g, k, n))
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        we = dequantize(*np_quantize(w[e], (128, 128)), (128, 128))
        ref_y[rows], ref_dx[rows] = dqx[rows] @ we, dqdy[rows] @ we.T
        ref_dw[e] = dqxt[:, rows] @ dqdyc[rows]
        start += size
    for got, ref in ((y, ref_y), (dx, ref_dx), (dw, ref_dw)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    assert np.all(np.asarray(y)[290:] == 0) and np.all(np.asarray(dw)[1] == 0)
    exact = jax.lax.ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
    assert rel(y, exact) < 0.06


def test_tiles_pack_and_feed_ragged_dot():
    """FP8 tiles as the MoE's dispatch moves them: `quantize_tiles` (values in the rows' own
    dtype, exactly the E4M3 values), `pack_tiles` to ``K + 4 * ceil(K/128)`` bytes a row and
    back; `ragged_dot` of the tiles equals `ragged_dot` of the rows, and so does ``dx``
    (straight through to the rows); ``dw`` takes ``x^T``'s tiles from the dequantised rows."""
    m, k, n, sizes = 300, 200, 136, np.array([100, 0, 150, 40], np.int32)
    g = len(sizes)
    x = jnp.asarray(data((m, k), 12), jnp.bfloat16)
    w, dy = data((g, k, n), 13) * 0.05, data((m, n), 14)
    tiles = fp8.quantize_tiles(x)
    qx, sx = np_quantize(np.asarray(x, np.float32), (1, 128))
    assert tiles.values.dtype == jnp.bfloat16 and tiles.scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(tiles.values, np.float32), qx.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(tiles.scale), sx)
    packed = fp8.pack_tiles(tiles)
    assert packed.dtype == jnp.uint8 and packed.shape == (m, k + 4 * 2)
    back = fp8.unpack_tiles(packed, k, jnp.bfloat16)
    for a, b in zip(back, tiles):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def product(to_tiles):
        f = lambda x, w: fp8.ragged_dot(fp8.quantize_tiles(x) if to_tiles else x, w, sizes)
        y, vjp = jax.jit(lambda x, w: jax.vjp(f, x, w))(x, w)
        return (y, *vjp(jnp.asarray(dy)))
    (y, dx, dw), (y0, dx0, _) = product(True), product(False)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx0, np.float32))
    rows = qx.astype(np.float32) * np.repeat(sx, 128, 1)[:, :k]  # float32, as the op does
    dqxt = dequantize(*np_quantize(rows.T, (1, 128)), (1, 128))
    dqdyc = dequantize(*np_quantize(dy, (128, 1)), (128, 1))
    ref_dw, start = np.zeros((g, k, n)), 0
    for e, size in enumerate(sizes):
        ref_dw[e] = dqxt[:, start:start + size] @ dqdyc[start:start + size]
        start += size
    np.testing.assert_allclose(np.asarray(dw), ref_dw, rtol=0, atol=2e-6 * np.abs(ref_dw).max())
    with pytest.raises(ValueError, match="quantize_tiles wants rows"):
        fp8.quantize_tiles(x[0])
    with pytest.raises(ValueError, match="unpack_tiles wants uint8 rows of 200"):
        fp8.unpack_tiles(packed[:, :-1], k, jnp.bfloat16)


@pytest.mark.slow
def test_mla_latent_expansion_in_fp8_under_ring_cp(devices):
    """``mla_attention(fp8="blockwise")`` expands the latent with `fp8.dot` on each shard, in
    the forward and the backward of the ring: the output equals the unsharded FP8 op's; the
    gradients differ by FP8's own error only (each shard quantises its own tiles)."""
    from zoo.ops import mla_attention
    from zoo.partitioning import Partitioner, make_mesh
    B, L, N, R, Hn, Hr, Hv = 2, 64, 4, 32, 16, 16, 32
    q, latent, k_pe = data((B, L, N, Hn + Hr), 12), data((B, L, R), 13), data((B, L, Hr), 14)
    kv_up = data((R, N, Hn + Hv), 15) * 0.2
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))

    def run(partitioner, implementation, fp8_mode):
        def loss(*args):
            o = mla_attention(*args, qk_nope_head_dim=Hn, q_positions=pos, kv_positions=pos,
                              partitioner=partitioner, implementation=implementation,
                              fp8=fp8_mode)
            return jnp.sum(o * jnp.cos(o)), o
        grad = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)
        (_, o), grads = jax.jit(grad)(q, latent, k_pe, kv_up)
        return o, grads

    ref, ref_grads = run(None, "auto", "blockwise")
    plain, _ = run(None, "auto", None)
    assert 0.01 < rel(ref, plain) < 0.1
    cp = Partitioner(make_mesh(context=4, devices=devices[:4]), "cp")
    out, grads = run(cp, "ring", "blockwise")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(g))) and rel(g, r) < 0.1
