"""The chunk-parallel WY/UT form of the gated delta rule (`zoo.ops.gated_delta`), the pass
behind its ``"chunked"`` implementation and each context shard's (`zoo.ops.gated_delta_cp`).

`chunked` runs chunks of ``C = CHUNK`` tokens: memory O(L*D + (L/C)*Dk*Dv), gradients from its
own `jax.custom_vjp` (the backward recomputes each chunk's intra-chunk terms and runs a reverse
scan over the saved chunk states). A document may start anywhere inside a chunk: per-token
reset flags cut the chunk's decay and UT matrices into blocks and swap the carried state for
the reset state at each start. Partial chunks are padded inside the op with identity tokens
(``k = 0``, ``g = 0``, ``beta = 0``). The UT solve is `solve_unit_lower`: the native triangular
solve on GPU/TPU, a blocked inverse on CPU (jaxlib 0.10's LAPACK solve deadlocks XLA:CPU's
thread pool when every virtual device calls it at once, as under context parallelism).

Inputs are prepared (`zoo.ops.gated_delta`: normalised, scaled, heads repeated, float32) in
[B, H, T, .] layout. Legend: B batch, H value heads, T tokens, K Dk, V Dv, N chunks, C chunk
size, P picked states.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["CHUNK", "chunked", "solve_unit_lower", "unit_lower_inverse"]

CHUNK = 64


def _reset_state(K, V, identity):
    return jnp.eye(K, V, dtype=jnp.float32) if identity else jnp.zeros((K, V), jnp.float32)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """Inverse of unit lower-triangular matrices a [..., C, C] by blocked doubling: blocks of
    size s merge pairwise into blocks of 2s, ``[[Ta, 0], [-Td a_ba Ta, Td]]`` (log2 C rounds
    of batched matmuls; C is padded to a power of two with identity)."""
    C = a.shape[-1]
    n = 1 << max(C - 1, 0).bit_length()
    if n != C:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, n - C)] * 2) \
            + jnp.diag((jnp.arange(n) >= C).astype(a.dtype))
    batch = a.shape[:-2]
    t = jnp.ones((*batch, n, 1, 1), a.dtype)  # the inverses of the diagonal 1x1 blocks
    s = 1
    while s < n:
        m = n // (2 * s)
        blocks = jnp.diagonal(a.reshape(*batch, m, 2 * s, m, 2 * s), axis1=-4, axis2=-2)
        a_ba = jnp.moveaxis(blocks, -1, -3)[..., s:, :s]  # [..., m, s, s]
        t = t.reshape(*batch, m, 2, s, s)
        ta, td = t[..., 0, :, :], t[..., 1, :, :]
        t = jnp.concatenate([jnp.concatenate([ta, jnp.zeros_like(ta)], -1),
                             jnp.concatenate([-(td @ a_ba @ ta), td], -1)], -2)
        s *= 2
    return t.reshape(*batch, n, n)[..., :C, :C]


def solve_unit_lower(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a^-1 b`` for unit lower-triangular a [..., C, C], b [..., C, M].

    GPU and TPU programs use the native triangular solve. On CPU, jaxlib 0.10 lowers it to
    LAPACK's ``trsm``, whose kernel splits a large batch into tasks on XLA:CPU's intra-op
    thread pool and blocks until they finish; when every pool thread runs such a solve at
    once -- one per virtual device, all released by the same collective under context
    parallelism -- no thread is left to run the tasks and the program deadlocks. On CPU the
    solve is therefore a product with `unit_lower_inverse` (plain dots; as accurate as the
    solve in float32). The branch is chosen when the program is lowered
    (`jax.lax.platform_dependent`)."""
    def cpu(a, b):
        return unit_lower_inverse(a) @ b

    def native(a, b):
        return jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True,
                                               unit_diagonal=True)
    return jax.lax.platform_dependent(a, b, cpu=cpu, default=native)


def _intra(q, k, v, g, beta, reset, identity):
    """Per-chunk terms that do not depend on the carried state. Inputs [..., N, C, .]. With
    ``identity`` the state has ``K + V`` columns, reset state ``[I | 0]`` and values ``[0 | v]``
    (the zero values never built: their solve is 0)."""
    C = g.shape[-1]
    G = jnp.cumsum(g, -1)
    c = jnp.cumsum(reset, -1)  # block within the chunk; 0 continues the carried state
    idx = jnp.arange(C)
    last = jax.lax.cummax(jnp.where(reset > 0, idx, -1), axis=g.ndim - 1)
    base = jnp.where(last >= 0, jnp.take_along_axis(G - g, jnp.maximum(last, 0), -1), 0.0)
    Gp = G - base  # log decay since the block's start (inclusive)
    same = (c[..., :, None] == c[..., None, :]) & (idx[:, None] >= idx[None, :])
    diff = jnp.where(same, G[..., :, None] - G[..., None, :], 0.0)
    decay = jnp.where(same, jnp.exp(diff), 0.0)
    strict = same & (idx[:, None] > idx[None, :])
    ut = jnp.where(strict, beta[..., :, None] * (k @ jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    ut = ut + jnp.eye(C, dtype=ut.dtype)

    uw = solve_unit_lower(ut, jnp.concatenate([beta[..., None] * v,
                                               (beta * jnp.exp(Gp))[..., None] * k], -1))
    u, w = uw[..., :v.shape[-1]], uw[..., v.shape[-1]:]
    qk = (q @ jnp.swapaxes(k, -1, -2)) * decay
    qg = q * jnp.exp(Gp)[..., None]
    first = (c == 0)[..., None]
    end_same = (c == c[..., -1:])[..., None]
    kdec = jnp.where(end_same, k * jnp.exp(G[..., -1:] - G)[..., None], 0.0)
    if identity:  # w @ [I | 0] = [w | 0], qg @ [I | 0] = [qg | 0]
        u = jnp.concatenate([jnp.where(first, 0.0, -w), u], -1)
        q0 = jnp.concatenate([jnp.where(first, 0.0, qg), jnp.zeros_like(v)], -1)
    else:
        R = _reset_state(k.shape[-1], v.shape[-1], identity)
        u, q0 = u - jnp.where(first, 0.0, w @ R), qg @ R * (~first)
    return dict(u=u, w=jnp.where(first, w, 0.0), qk=qk,
                q0=q0, qg=jnp.where(first, qg, 0.0), kdec=kdec,
                keep=jnp.where(c[..., -1] == 0, jnp.exp(Gp[..., -1]), 0.0),
                fresh=jnp.where(c[..., -1] == 0, 0.0, jnp.exp(Gp[..., -1])))


def _step(identity, S, x):
    """One chunk: carried state S [..., K, V] -> (state after the chunk, outputs [..., C, V])."""
    R = _reset_state(S.shape[-2], S.shape[-1], identity)
    new = x["u"] - x["w"] @ S
    o = x["qg"] @ S + x["q0"] + x["qk"] @ new
    S_end = (x["keep"][..., None, None] * S + x["fresh"][..., None, None] * R
             + jnp.swapaxes(x["kdec"], -1, -2) @ new)
    return S_end, o


def _chunk_inputs(chunk, q, k, v, g, beta, reset):
    """[B, H, T, .] -> [N, B, H, C, .] (T a multiple of C)."""
    def split(x):
        B, H, T = x.shape[:3]
        x = x.reshape(B, H, T // chunk, chunk, *x.shape[3:])
        return jnp.moveaxis(x, 2, 0)
    return tuple(split(x) for x in (q, k, v, g, beta, reset))


def _scan(identity, xs):
    B, H, _, K = xs["w"].shape[1:]
    S0 = jnp.broadcast_to(_reset_state(K, xs["u"].shape[-1], identity),
                          (B, H, K, xs["u"].shape[-1]))

    def body(S, x):
        S_end, o = _step(identity, S, x)
        return S_end, (o, S)

    final, (o, starts) = jax.lax.scan(body, S0, xs)
    return o, starts, final


def _pick(starts, final, picks):
    """States after chunks ``picks`` [B, P] ([B, P, H, K, V]) from the states before every
    chunk [N, B, H, K, V] (chunk n ends where n + 1 starts) and the state after the last."""
    N = starts.shape[0]
    got = jax.vmap(lambda s, i: s[i], in_axes=(1, 0))(starts, jnp.minimum(picks + 1, N - 1))
    return jnp.where((picks == N - 1)[..., None, None, None], final[:, None], got)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_core(identity, chunk, q, k, v, g, beta, reset, picks):
    xs = _intra(*_chunk_inputs(chunk, q, k, v, g, beta, reset), identity)
    o, starts, final = _scan(identity, xs)
    return o, _pick(starts, final, picks)


def _chunked_fwd(identity, chunk, q, k, v, g, beta, reset, picks):
    xs = _intra(*_chunk_inputs(chunk, q, k, v, g, beta, reset), identity)
    o, starts, final = _scan(identity, xs)
    return (o, _pick(starts, final, picks)), (q, k, v, g, beta, reset, picks, starts)


def _chunked_bwd(identity, chunk, res, cot):
    q, k, v, g, beta, reset, picks, starts = res
    do, dpicked = cot  # the picked states' cotangent enters the scan at its chunk only
    chunks = _chunk_inputs(chunk, q, k, v, g, beta, reset)
    xs, intra_vjp = jax.vjp(lambda *a: _intra(*a, chunks[-1], identity), *chunks[:-1])

    def body(dS, inp):
        n, S, x, do_n = inp
        dend = jnp.einsum("bp,bphkv->bhkv", (picks == n).astype(dS.dtype), dpicked)
        _, step_vjp = jax.vjp(functools.partial(_step, identity), S, x)
        dS_start, dx = step_vjp((dS + dend, do_n))
        return dS_start, dx

    _, dxs = jax.lax.scan(body, jnp.zeros_like(starts[0]),
                          (jnp.arange(starts.shape[0]), starts, xs, do), reverse=True)
    dq, dk, dv, dg, dbeta = intra_vjp(dxs)

    def unsplit(x):
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(*x.shape[:2], -1, *x.shape[4:])

    return (*(unsplit(x) for x in (dq, dk, dv, dg, dbeta)), jnp.zeros_like(reset), None)


_chunked_core.defvjp(_chunked_fwd, _chunked_bwd)


def chunked(q, k, v, g, beta, reset, identity=False, chunk=CHUNK, picks=None):
    """Chunked gated delta rule, [B, H, T, .] inputs (any T). Returns (o [B, H, T, V], the
    states after chunks ``picks`` [B, P] ints, [B, P, H, K, V]; None: after the last chunk,
    P = 1). Only the picked states leave the pass (not one per chunk). With ``identity`` the
    state is ``[K, K + V]`` with reset ``[I | 0]`` and values ``[0 | v]`` (`_intra`): o and
    the states are ``K + V`` wide."""
    T = q.shape[2]
    pad = -T % chunk
    if pad:
        def p(x):
            return jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        q, k, v, g, beta, reset = map(p, (q, k, v, g, beta, reset))
    if picks is None:
        picks = jnp.full((q.shape[0], 1), q.shape[2] // chunk - 1, jnp.int32)
    o, states = _chunked_core(identity, chunk, q, k, v, g, beta, reset, picks)
    o = jnp.moveaxis(o, 0, 2)
    return o.reshape(*o.shape[:2], -1, o.shape[-1])[:, :, :T], states

