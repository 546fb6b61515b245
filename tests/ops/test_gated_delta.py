"""`zoo.ops.gated_delta`: the chunked gated delta rule against the recurrent one and a numpy
loop, against transformers' PyTorch reference, and under context parallelism on load-balanced
rows against the unsharded op (forward and gradients).

A limitation of XLA:CPU in jaxlib 0.10 shapes the op, and these tests hold it: its LAPACK
triangular solve (``lapack_strsm_ffi``) splits a large batch into tasks on the intra-op thread
pool and blocks until they finish. Under context parallelism every virtual device reaches the
chunked pass's solve at once (a collective releases them together), so with 8 devices all 8
pool threads wait on tasks that no thread is left to run: the program deadlocks with no CPU
in use (seen with gdb: every ``tf_XLAEigen`` thread in ``ParallelBatchMap`` ->
``BlockingCounter::Wait``). Solves under 2e5 FLOP a call run inline (no tasks), so small
shards never hung. `zoo.ops.gated_delta_chunked.solve_unit_lower` therefore solves on CPU by a
product with a blocked inverse (plain dots) and keeps the native solve on GPU/TPU;
`test_unit_lower_solve` checks both the numbers and that no LAPACK call is left in a CPU
program. Tolerances (`tol`) scale with the compared dtype's epsilon and the arrays' magnitude.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo.data import load_balance
from zoo.ops import gated_delta as gd
from zoo.ops import gated_delta_chunked as gdc
from zoo.ops import gated_delta_cp as gcp

B, L, HK, H, DK, DV, W = 2, 128, 1, 2, 8, 4, 4
D_CONV = 2 * HK * DK + H * DV  # the convolution makes q, k, v as in the layer


def packed(doc_lengths, length):
    seg, pos = np.zeros(length, np.int32), np.zeros(length, np.int32)
    start = 0
    for i, n in enumerate(doc_lengths):
        seg[start:start + n] = i + 1
        pos[start:start + n] = np.arange(n)
        start += n
    return seg, pos


@functools.cache
def data(length=L):
    """Inputs in packing order. Row 0: documents shorter than the convolution (2, 3 tokens),
    one ending at 32 (a shard edge for cp 4 under "row") and padding; row 1: one document
    starting mid-chunk after a short one and filling the row."""
    rng = np.random.default_rng(0)
    f = np.float32
    rows = [packed([5, 2, 25, 3, 29, 40, 14], length), packed([7, length - 7], length)]
    seg, pos = (np.stack([r[i] for r in rows]) for i in range(2))
    return dict(q=rng.normal(size=(B, length, HK, DK)).astype(f),
                k=rng.normal(size=(B, length, HK, DK)).astype(f),
                v=rng.normal(size=(B, length, H, DV)).astype(f),
                g=(-0.4 * np.abs(rng.normal(size=(B, length, H)))).astype(f),
                beta=rng.uniform(size=(B, length, H)).astype(f),
                x=rng.normal(size=(B, length, D_CONV)).astype(f),
                w_out=rng.normal(size=(B, length, H, DV)).astype(f),
                w_conv=rng.normal(size=(B, length, D_CONV)).astype(f),
                segment_ids=seg, positions=pos)


WEIGHT = np.random.default_rng(1).normal(size=(D_CONV, W)).astype(np.float32)


def tol(dtype, scale, computed=50):
    """Tolerance for an array of `dtype` whose entries reach `scale`: `computed` float32
    epsilons of accumulated error (the op computes in float32; sharded and unsharded differ by
    about 10) plus the rounding to `dtype` (one of its epsilons), both relative to `scale`."""
    eps = computed * float(jnp.finfo(jnp.float32).eps) + float(jnp.finfo(dtype).eps)
    return dict(atol=eps * float(np.abs(scale).max()), rtol=0)


def numpy_loop(q, k, v, g, beta, seg, pos):
    """The gated delta rule token by token, rows in packing order."""
    out = np.zeros(v.shape, np.float64)
    r = v.shape[2] // q.shape[2]
    for b in range(q.shape[0]):
        for h in range(v.shape[2]):
            S = np.zeros((q.shape[-1], v.shape[-1]))
            for t in range(q.shape[1]):
                if seg[b, t] == 0:
                    continue
                if t == 0 or seg[b, t] != seg[b, t - 1] or pos[b, t] != pos[b, t - 1] + 1:
                    S = np.zeros_like(S)
                qt, kt = q[b, t, h // r].astype(np.float64), k[b, t, h // r].astype(np.float64)
                qt = qt / np.sqrt(qt @ qt + 1e-6) / np.sqrt(len(qt))
                kt = kt / np.sqrt(kt @ kt + 1e-6)
                S = S * np.exp(g[b, t, h])
                S = S + np.outer(kt, beta[b, t, h] * (v[b, t, h] - S.T @ kt))
                out[b, t, h] = S.T @ qt
    return out


def numpy_conv(x, w, seg, pos):
    out = np.zeros(x.shape, np.float64)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if seg[b, t] == 0:
                continue
            for j in range(w.shape[1]):
                s = t - j
                if s >= 0 and seg[b, s] == seg[b, t] and pos[b, s] == pos[b, t] - j:
                    out[b, t] += w[:, w.shape[1] - 1 - j] * x[b, s]
    return np.where(seg[..., None] != 0, out / (1 + np.exp(-out)), 0.0)


def op(d, impl="chunked", partitioner=None, max_pieces=4):
    return gd.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"],
                               segment_ids=d["segment_ids"], positions=d["positions"],
                               implementation=impl, partitioner=partitioner,
                               max_pieces=max_pieces)


def loss_and_grads(impl="chunked", partitioner=None, max_pieces=4):
    """(outputs, gradients) of a weighted sum of the convolution's and the op's outputs, the
    convolution adding to q, k, v as in the layer (its collectives then come first: XLA:CPU
    deadlocks on independent collectives, see `zoo.ops.gated_delta_cp._pieces`)."""
    def f(q, k, v, g, beta, x, d):
        c = gd.causal_conv1d(x, jnp.asarray(WEIGHT), segment_ids=d["segment_ids"],
                             positions=d["positions"], partitioner=partitioner,
                             max_pieces=max_pieces)
        n = HK * DK
        q = q + c[..., :n].reshape(q.shape)
        k = k + c[..., n:2 * n].reshape(k.shape)
        v = v + c[..., 2 * n:].reshape(v.shape)
        o = op(dict(d, q=q, k=k, v=v, g=g, beta=beta), impl, partitioner, max_pieces)
        return jnp.sum(o * d["w_out"]) + jnp.sum(c * d["w_conv"]), (o, c)

    grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))

    def run(d):
        (_, aux), grads = grad(*(d[n] for n in ("q", "k", "v", "g", "beta", "x")), d)
        return [np.asarray(a) for a in (*aux, *grads)]
    return run


@functools.cache
def unsharded_reference():
    return loss_and_grads()(data())


def test_chunked_matches_recurrent_and_numpy_loop():
    d = data()
    want = numpy_loop(*(d[n] for n in ("q", "k", "v", "g", "beta", "segment_ids",
                                       "positions")))
    for impl in gd.IMPLEMENTATIONS:
        np.testing.assert_allclose(np.asarray(op(d, impl)), want, atol=2e-5, err_msg=impl)
    conv = gd.causal_conv1d(d["x"], WEIGHT, segment_ids=d["segment_ids"],
                            positions=d["positions"])
    np.testing.assert_allclose(np.asarray(conv), numpy_conv(d["x"], WEIGHT, d["segment_ids"],
                                                            d["positions"]), atol=1e-5)


def test_chunked_gradients_match_recurrent():
    """Documents start mid-chunk, padding, L = 96 not a multiple of the chunk (64)."""
    d = {n: (x[:, :96] if isinstance(x, np.ndarray) else x) for n, x in data().items()}
    got, want = loss_and_grads("chunked")(d), loss_and_grads("recurrent")(d)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=f"output/grad {i}")
    assert np.abs(got[4]).max() > 1e-3  # the gradient of g is exercised


def test_chunked_picked_states_and_gradients():
    """`gated_delta_chunked.chunked`'s states after chosen chunks (repeated, the last of a
    padded length), with a zero reset state and with ``identity`` (state ``[K, K + V]``, reset
    ``[I | 0]``, values ``[0 | v]``), forward and gradients through outputs and states, against
    a token-by-token scan of the recurrence."""
    rng = np.random.default_rng(5)
    Bt, Ht, T, K, V, C = 2, 2, 37, 8, 6, 8  # 5 chunks, the last padded
    f = np.float32
    q, k = (gd.l2norm(jnp.asarray(rng.normal(size=(Bt, Ht, T, K)), f)) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(Bt, Ht, T, V)), f)
    g = jnp.asarray(-0.3 * np.abs(rng.normal(size=(Bt, Ht, T))), f)
    beta = jnp.asarray(rng.uniform(size=(Bt, Ht, T)), f)
    reset = np.zeros((Bt, Ht, T), f)
    reset[:, :, 0], reset[0, :, 13], reset[1, :, 21] = 1, 1, 1  # documents start mid-chunk
    reset = jnp.asarray(reset)
    picks = jnp.asarray([[1, 4, 1], [0, 2, 4]], jnp.int32)
    for identity in (False, True):
        width = K + V if identity else V
        R = jnp.eye(K, width, dtype=f) if identity else jnp.zeros((K, V), f)
        w_o = rng.normal(size=(Bt, Ht, T, width)).astype(f)
        w_s = rng.normal(size=(Bt, 3, Ht, K, width)).astype(f)

        def scan(q, k, v, g, beta, R=R, width=width):
            v = jnp.concatenate([jnp.zeros((*v.shape[:-1], width - V), f), v], -1)

            def step(S, x):
                qt, kt, vt, gt, bt, rt = x
                S, o = gd._update(jnp.where(rt[..., None, None] > 0, R, S), qt, kt, vt, gt, bt)
                return S, (o, S)
            xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta, reset))
            _, (o, states) = jax.lax.scan(step, jnp.zeros((Bt, Ht, K, width), f), xs)
            last = jnp.minimum((picks + 1) * C, T) - 1  # the chunk's last real token
            return jnp.moveaxis(o, 0, 2), jax.vmap(lambda s, i: s[i], (1, 0))(states, last)

        def chunked(q, k, v, g, beta, identity=identity):
            return gdc.chunked(q, k, v, g, beta, reset, identity=identity, chunk=C, picks=picks)

        def value_and_grads(fn, w_o=w_o, w_s=w_s):
            def loss(*a):
                o, st = fn(*a)
                return jnp.sum(o * w_o) + jnp.sum(st * w_s), (o, st)
            (_, aux), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                                         has_aux=True))(q, k, v, g, beta)
            return [np.asarray(a) for a in (*aux, *grads)]
        names = ("out", "states", "dq", "dk", "dv", "dg", "dbeta")
        for name, a, b in zip(names, value_and_grads(chunked), value_and_grads(scan)):
            np.testing.assert_allclose(a, b, err_msg=f"identity={identity} {name}",
                                       **tol(jnp.float32, b))

def test_any_row_order_without_mesh():
    """The unsharded op sorts rows into packing order: a permuted row gives permuted outputs,
    and so does the sharded algorithm run as one shard."""
    d = data()
    want = np.asarray(op(d))
    perm = np.random.default_rng(2).permutation(L)
    shuffled = {n: (x[:, perm] if isinstance(x, np.ndarray) and x.ndim > 1 else x)
                for n, x in d.items()}
    np.testing.assert_allclose(np.asarray(op(shuffled)), want[:, perm], atol=1e-6)
    bal = load_balance(d, 4, strategy="row")  # 8 chunks: at most 7 pieces continue a document
    wb = load_balance(want, 4, strategy="row")
    seg = jnp.asarray(bal["segment_ids"])
    xs = gd._prepare(*(bal[n] for n in ("q", "k", "v", "g", "beta")), seg)
    one = gcp.shard(*xs, seg, jnp.asarray(bal["positions"]), axes=(), max_pieces=8)
    np.testing.assert_allclose(np.asarray(gd._finish(one, seg, jnp.float32)), wb, atol=1e-5)


def test_matches_transformers():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    rng = np.random.default_rng(3)
    length, hk, h, dk, dv = 100, 2, 4, 16, 8
    q, k = (rng.normal(size=(1, length, hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(1, length, h, dv)).astype(np.float32)
    a, b = (rng.normal(size=(1, length, h)).astype(np.float32) for _ in range(2))
    A_log = np.log(rng.uniform(1, 16, size=h)).astype(np.float32)
    dt_bias = np.ones(h, np.float32)
    t = torch.from_numpy
    beta_t = t(b).sigmoid()
    g_t = -t(A_log).exp() * torch.nn.functional.softplus(t(a) + t(dt_bias))
    want, _ = hf.torch_chunk_gated_delta_rule(t(q), t(k), t(v), g=g_t, beta=beta_t,
                                              use_qk_l2norm_in_kernel=True)
    g, beta = gd.gates(jnp.asarray(a), jnp.asarray(b), jnp.asarray(A_log), jnp.asarray(dt_bias))
    np.testing.assert_allclose(np.asarray(g), g_t.numpy(), rtol=1e-6)
    seg, pos = np.ones((1, length), np.int32), np.arange(length, dtype=np.int32)[None]
    got = gd.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, positions=pos)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5)
    x = rng.normal(size=(1, length, 12)).astype(np.float32)
    w = rng.normal(size=(12, 4)).astype(np.float32)
    want_conv = hf.causal_conv1d_fn(t(x).transpose(1, 2), t(w), None, activation="silu")
    got_conv = gd.causal_conv1d(x, w, segment_ids=seg, positions=pos)
    np.testing.assert_allclose(np.asarray(got_conv), want_conv.transpose(1, 2).numpy(),
                               atol=1e-5)


def test_bad_input_is_refused():
    d = data()
    q2, k2 = (np.repeat(d[n], 2, axis=2) for n in ("q", "k"))
    v3, g3, b3 = (np.repeat(d[n][:, :, :1], 3, axis=2) for n in ("v", "g", "beta"))
    with pytest.raises(ValueError, match="multiple of key heads"):
        gd.gated_delta_rule(q2, k2, v3, g3, b3, segment_ids=d["segment_ids"],
                            positions=d["positions"])
    with pytest.raises(ValueError, match="float32"):
        gd.gated_delta_rule(d["q"], d["k"], d["v"], d["g"].astype(jnp.bfloat16), d["beta"],
                            segment_ids=d["segment_ids"], positions=d["positions"])
    with pytest.raises(ValueError, match="implementation"):
        op(d, "fused")


CP_CASES = [("cp", dict(context=2, fsdp=4), "row"),
            ("cp", dict(context=4, fsdp=2), "document"),
            ("cp", dict(context=8), "auto"),
            ("ep_as_cp", dict(expert=2, context=2, fsdp=2), "auto")]
CP_IDS = [f"{s}-{'x'.join(map(str, z.values()))}-{lay}" for s, z, lay in CP_CASES]


def balanced(strategy, sizes, layout):
    p = zoo.Partitioner(zoo.make_mesh(**sizes), strategy)
    cp = p.context_size("attention")
    d = data()
    bal = load_balance(d, cp, strategy=layout)
    # the layouts cut documents into pieces shorter than the convolution
    assert layout == "row" or np.any(np.diff(np.flatnonzero(np.diff(bal["segment_ids"][0])))
                                     < W - 1)
    return p, cp, d, bal


@pytest.mark.parametrize("strategy,sizes,layout", CP_CASES[:1], ids=CP_IDS[:1])
def test_context_parallel_convolution_equals_unsharded(strategy, sizes, layout):
    p, cp, d, bal = balanced(strategy, sizes, layout)
    got = gd.causal_conv1d(bal["x"], WEIGHT, segment_ids=bal["segment_ids"],
                           positions=bal["positions"], partitioner=p, max_pieces=16)
    want = gd.causal_conv1d(d["x"], WEIGHT, segment_ids=d["segment_ids"],
                            positions=d["positions"])
    want = load_balance(dict(a=np.asarray(want), segment_ids=d["segment_ids"],
                             positions=d["positions"]), cp, strategy=layout)["a"]
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


FWD_CASES = [(*CP_CASES[0], 4, jnp.float32), (*CP_CASES[2], 16, jnp.bfloat16)]


@pytest.mark.parametrize("strategy,sizes,layout,max_pieces,dtype", FWD_CASES,
                         ids=[f"{CP_IDS[0]}-f32", f"{CP_IDS[2]}-bf16"])
def test_context_parallel_forward_equals_unsharded(strategy, sizes, layout, max_pieces, dtype):
    """The sharded forward in float32 and in bfloat16 (inputs and outputs; the op computes in
    float32, so the two differ by output rounding only)."""
    p, cp, d, bal = balanced(strategy, sizes, layout)

    def cast(x):
        return {n: (a.astype(dtype) if n in ("q", "k", "v", "beta") else a) for n, a in x.items()}
    got = jax.jit(lambda b: op(b, partitioner=p, max_pieces=max_pieces))(cast(bal))
    want = jax.jit(op)(cast(d))
    assert got.dtype == want.dtype == dtype
    want = load_balance(dict(a=np.asarray(want.astype(jnp.float32)), segment_ids=d["segment_ids"],
                             positions=d["positions"]), cp, strategy=layout)["a"]
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, **tol(dtype, want))


@pytest.mark.slow  # 7-17 s each on a loaded 2-core box (the first also builds the reference)
@pytest.mark.parametrize("strategy,sizes,layout", CP_CASES, ids=CP_IDS)
def test_context_parallel_equals_unsharded(strategy, sizes, layout):
    p, cp, d, bal = balanced(strategy, sizes, layout)
    got = loss_and_grads(partitioner=p, max_pieces=16)(bal)
    names = ("out", "conv", "dq", "dk", "dv", "dg", "dbeta", "dx")
    for name, a, b in zip(names, got, unsharded_reference()):
        want = load_balance(dict(a=b, segment_ids=d["segment_ids"], positions=d["positions"]),
                            cp, strategy=layout)["a"]
        np.testing.assert_allclose(a, want, err_msg=name, **tol(a.dtype, want))


def test_unit_lower_solve():
    """The chunked form's UT solve: equal to a float64 solve (forward and gradients, a power of
    two and another size), and on CPU free of LAPACK calls (the deadlock above) while a GPU
    program keeps the native triangular solve."""
    @jax.jit
    def solve_and_vjp(a, b, ct):
        x, vjp = jax.vjp(gdc.solve_unit_lower, a, b)
        return x, *vjp(ct)

    rng = np.random.default_rng(4)
    for C in (64, 12):
        k = rng.normal(size=(2, 3, C, 8))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        a = np.tril(rng.uniform(size=(2, 3, C, 1)) * (k @ np.swapaxes(k, -1, -2)), -1) + np.eye(C)
        b, ct = rng.normal(size=(2, 2, 3, C, 5))
        x = np.linalg.solve(a, b)
        got, da, db = solve_and_vjp(*(m.astype(np.float32) for m in (a, b, ct)))
        want_db = np.linalg.solve(np.swapaxes(a, -1, -2), ct)  # a^-T ct
        want_da = np.tril(-want_db @ np.swapaxes(x, -1, -2), -1)  # its strict lower part
        for name, g, w in (("x", got, x), ("db", db, want_db), ("da", np.tril(da, -1), want_da)):
            np.testing.assert_allclose(np.asarray(g), w, err_msg=f"C={C} {name}",
                                       **tol(jnp.float32, w))
    args = (jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    cpu = jax.jit(gdc.solve_unit_lower).lower(*args).as_text()
    assert "lapack" not in cpu and "triangular_solve" not in cpu
    gpu = jax.jit(gdc.solve_unit_lower).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triangular_solve" in gpu


def test_too_many_pieces_is_loud():
    """More importing pieces than slots: NaN, not a silently wrong state."""
    bal = load_balance(data(), 4, strategy="row")
    seg = jnp.asarray(bal["segment_ids"])
    xs = gd._prepare(*(bal[n] for n in ("q", "k", "v", "g", "beta")), seg)
    out = gcp.shard(*xs, seg, jnp.asarray(bal["positions"]), axes=(), max_pieces=2)
    assert np.isnan(np.asarray(out)).any()


def test_pick_rows_equals_gather_without_scatter():
    """The convolution's context lookup (`gcp.pick_rows`, a one-hot product): equal to a masked
    ``take_along_axis`` in value and gradient, and its backward has no scatter (the gather's
    transpose, a scatter-add, overflows TPU vector memory at full width: libtpu E1001)."""
    rng = np.random.default_rng(5)
    table = rng.normal(size=(2, 6, 7)).astype(np.float32)
    idx = rng.integers(0, 6, size=(2, 11)).astype(np.int32)
    valid = rng.uniform(size=(2, 11)) < 0.7
    ct = rng.normal(size=(2, 11, 7)).astype(np.float32)

    def gather(t, i, m):
        return jnp.where(m[..., None], jnp.take_along_axis(t, i[..., None], axis=1), 0.0)

    def value_and_vjp(f):
        return jax.jit(lambda t, i, m, c: (lambda o, vjp: (o, *vjp(c)))(
            *jax.vjp(lambda t: f(t, i, m), t)))

    got, got_dt = value_and_vjp(gcp.pick_rows)(table, idx, valid, ct)
    want, want_dt = value_and_vjp(gather)(table, idx, valid, ct)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got_dt), np.asarray(want_dt), **tol(jnp.float32, want_dt))
    assert np.any(np.asarray(want_dt) == 0) and np.any(np.abs(np.asarray(want_dt)) > 1)

    def backward_text(f):
        return jax.jit(jax.grad(lambda t: jnp.sum(f(t, idx, valid) * ct))).lower(table).as_text()
    assert "scatter" in backward_text(gather)
    assert "scatter" not in backward_text(gcp.pick_rows)
