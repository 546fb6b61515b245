"""The gated delta rule (gated DeltaNet's linear attention) over packed documents, with context
parallelism, and the short causal convolution in front of it.

The recurrence, per value head, with state ``S`` [Dk, Dv] (Hugging Face's
``torch_recurrent_gated_delta_rule``)::

    S <- exp(g_t) S                                  decay (g_t <= 0, log space)
    S <- S + beta_t k_t (v_t - S^T k_t)^T             delta rule write
    o_t = S^T q_t

with ``q``/``k`` L2-normalised (eps 1e-6, as ``l2norm``) and ``q`` scaled by ``1/sqrt(Dk)``
inside the op. `gates` turns the layer's projections into ``g = -exp(A_log) * softplus(a +
dt_bias)`` and ``beta = sigmoid(b)``; `causal_conv1d` is the depthwise convolution (kernel 4,
SiLU) that produces q/k/v. Both follow transformers' ``qwen3_next`` modeling.

Shapes: q, k [B, L, Hk, Dk]; v [B, L, Hv, Dv]; g, beta [B, L, Hv] (g in float32); output
[B, L, Hv, Dv] in v's dtype. ``Hv`` is a multiple of ``Hk``: q/k head ``h`` serves value heads
``h*r .. h*r+r-1`` (``r = Hv // Hk``, transformers' ``repeat_interleave``). All math is float32.

Documents: ``segment_ids`` (0 = padding, documents 1..n numbered in packing order) and
``positions`` say where each token belongs, so rows may come in any order `zoo.data.load_balance`
produces. The state resets at every document start; padding contributes nothing and its
output is 0. Token ``t`` continues the state of the token ``(segment, position - 1)``.

Implementations:

* ``"recurrent"`` -- token by token (`jax.lax.scan`): the reference. Sorts rows into packing
  order (`zoo.data.restore_order`'s key) and back.
* ``"chunked"`` -- the chunk-parallel WY/UT form (chunks of ``C = 64``): memory O(L*D +
  (L/C)*Dk*Dv), gradients from its own `jax.custom_vjp` (the backward recomputes each chunk's
  intra-chunk terms and runs a reverse scan over the saved chunk states). A document may start
  anywhere inside a chunk: per-token reset flags cut the chunk's decay and UT matrices into
  blocks and swap the carried state for the reset state at each start. Partial chunks are
  padded inside the op with identity tokens (``k = 0``, ``g = 0``, ``beta = 0``). The UT
  solve is `solve_unit_lower`: the native triangular solve on GPU/TPU, a blocked inverse on
  CPU (jaxlib 0.10's LAPACK solve deadlocks XLA:CPU's thread pool when every virtual device
  calls it at once, as under context parallelism).

Generation: ``gated_delta_rule(..., return_state=True)`` also gives the state after each row's
last token (prefill), `conv_tail` the convolution's last inputs, and `recurrent_step` continues
a state by T tokens (decode), through the same recurrence as ``"recurrent"``.

Context parallelism (``partitioner`` whose attention scope shards ``length``; under
``ep_as_cp`` that includes the expert axis): `jax.shard_map` over the sequence axes. Each shard
cuts its rows into *pieces*, maximal runs of tokens that follow each other in packing order.

1. A piece that starts at position > 0 *imports* a state; its key (segment, start) is
   all-gathered (``max_pieces`` slots per shard and row). A piece whose successor token is
   imported somewhere *exports*.
2. One chunked pass with values ``[0 | v]`` (the zeros implicit) and reset state ``[I | 0]``
   gives, for every token, its output with a zero incoming state and its query carried back
   to the start of its piece (``q~ = P^T q``), and for every exporting piece its summary
   ``S -> A S + B`` (``[A | B]`` = the state after the piece). Pieces that import or export
   are laid out on chunk boundaries (at most ``2 * max_pieces * (C - 1)`` identity tokens per
   shard) so these are chunk-edge quantities. The pass hands out only those ``max_pieces``
   chunk-edge states (`_chunked`'s ``picks``) and takes their cotangents back into its reverse
   scan at their chunks: no per-chunk ``[Dk, Dk + Dv]`` state array besides the backward's
   saved one.
3. The summaries ``[A | B]`` ([max_pieces, Hv, Dk, Dk + Dv] per shard) are all-gathered and
   composed in packing order on every shard (an exclusive scan over at most
   ``cp * max_pieces`` entries); each importing piece adds ``q~^T S_in`` to its outputs.

Only keys and summaries travel: bytes per layer do not depend on L. The gathered scan is
chosen over a log-step `ppermute` scan because pieces of one document sit on shards in the
layout's order, not the mesh's (``"document"`` puts pieces ``r`` and ``2cp-1-r`` on shard
``r``): a ppermute scan would need ``log2(2cp)`` rounds of keyed composition, while one
all-gather of ``cp * max_pieces`` summaries composes in one step and its bytes are the same
order. A shard with more than ``max_pieces`` importing or exporting pieces in a row returns
NaN (raise ``max_pieces``: ``"row"`` needs 2, ``"document"`` 2 per document).

Legend: B batch, L length, H value heads, Hk key heads, K Dk, V Dv, N chunks, C chunk size,
P max_pieces, n context shards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zoo.partitioning import Partitioner

__all__ = ["CHUNK", "IMPLEMENTATIONS", "causal_conv1d", "conv_tail", "gated_delta_rule", "gates",
           "l2norm", "pick_rows", "recurrent_step", "solve_unit_lower", "unit_lower_inverse"]

IMPLEMENTATIONS = ("chunked", "recurrent")
CHUNK = 64
EPS = 1e-6


def l2norm(x: jax.Array, eps: float = EPS) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (transformers' ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gates(a: jax.Array, b: jax.Array, A_log: jax.Array, dt_bias: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
    """``(g, beta)`` from the layer's projections ``a``, ``b`` [..., H]: ``g = -exp(A_log) *
    softplus(a + dt_bias)`` in float32, ``beta = sigmoid(b)``."""
    a = a.astype(jnp.float32)
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b)


# -- checks -----------------------------------------------------------------------------------

def _check(q, k, v, g, beta, segment_ids, positions, implementation, max_pieces):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must both be [B, L, Hk, Dk]")
    B, L, Hk, _ = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, L):
        raise ValueError(f"v {v.shape} must be [B, L, Hv, Dv] with B, L = {(B, L)} as q")
    H = v.shape[2]
    if H % Hk:
        raise ValueError(f"value heads Hv={H} must be a multiple of key heads Hk={Hk} (each "
                         "q/k head serves Hv // Hk value heads)")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, L, H):
            raise ValueError(f"{name} {x.shape} must be [B, L, Hv] = {(B, L, H)}")
    if g.dtype != jnp.float32:
        raise ValueError(f"g has dtype {g.dtype}; the log decay must be float32 (compute it "
                         "with zoo.ops.gated_delta.gates, or cast)")
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} has dtype {x.dtype}; it must be floating point")
    _check_tokens(segment_ids, positions, (B, L))
    if isinstance(max_pieces, bool) or not isinstance(max_pieces, int) or max_pieces < 1:
        raise ValueError(f"max_pieces={max_pieces!r} must be a positive int (state slots per "
                         "shard and row)")


def _check_tokens(segment_ids, positions, shape):
    for name, x in (("segment_ids", segment_ids), ("positions", positions)):
        if x is None or tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} {None if x is None else x.shape} must be [B, L] = "
                             f"{tuple(shape)} (0 = padding segment)")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} has dtype {x.dtype}; it must be an integer array")


# -- pieces: runs of tokens that follow each other in packing order ---------------------------

def _starts(seg, pos):
    """[B, L] bool: token starts a piece (not the packing successor of the token before it)."""
    follows = (seg[:, 1:] == seg[:, :-1]) & (pos[:, 1:] == pos[:, :-1] + 1)
    return jnp.concatenate([jnp.ones_like(follows[:, :1]), ~follows], axis=1)


def _packing_order(seg, pos):
    """[B, L] permutation into packing order (padding last, segment, position)."""
    return jax.vmap(lambda s, p: jnp.lexsort((p, s, s == 0)))(seg, pos)


def _take_rows(x, idx):
    """``x[b, idx[b]]`` for x [B, L, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def pick_rows(table: jax.Array, idx: jax.Array, valid: jax.Array) -> jax.Array:
    """``table[b, idx[b, t]]`` where ``valid[b, t]``, else 0: table [B, R, D] with few rows R,
    idx and valid [B, L] -> [B, L, D] in table's dtype.

    A one-hot product rather than ``take_along_axis``: a gather's transpose is a scatter-add of
    L rows onto R, which libtpu fuses into one vector-memory scope that does not fit at D =
    12,288 (E1001 CompileTimeScopedVmemOom in Qwen3.5-397B's step); the one-hot product's
    transpose is a matmul as well, and both cost ``L * R * D`` multiply-adds (small R: here
    ``max_pieces * (W - 1)`` context rows). The forward equals the gather exactly (each output
    sums one entry with zeros; ``Precision.HIGHEST`` keeps float32 on TPU); the table's
    gradient sums the same terms as the scatter-add, in another order."""
    onehot = (idx[..., None] == jnp.arange(table.shape[1])) & valid[..., None]
    return jnp.einsum("blr,brd->bld", onehot.astype(table.dtype), table,
                      precision=jax.lax.Precision.HIGHEST)


def _inverse(perm):
    return jax.vmap(lambda p: jnp.zeros_like(p).at[p].set(jnp.arange(p.shape[0])))(perm)


# -- the recurrent reference ------------------------------------------------------------------

def _update(S, qt, kt, vt, gt, bt):
    """One token of the recurrence (module docstring): state S [B, H, K, V], prepared q/k
    [B, H, K], v [B, H, V], g/beta [B, H] -> (new state, output [B, H, V])."""
    S = S * jnp.exp(gt)[..., None, None]
    u = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", S, kt))
    S = S + kt[..., :, None] * u[..., None, :]
    return S, jnp.einsum("bhkv,bhk->bhv", S, qt)


def _recurrent(q, k, v, g, beta, reset, state=None):
    """Token-by-token scan. q, k [B, H, T, K]; v [B, H, T, V]; g, beta, reset [B, H, T];
    ``state`` [B, H, K, V] the incoming state (None: zeros). Returns (o [B, H, T, V], the
    state after the last token)."""
    B, H, _, K = q.shape
    V = v.shape[-1]

    def step(S, x):
        qt, kt, vt, gt, bt, rt = x
        return _update(jnp.where(rt[..., None, None], 0.0, S), qt, kt, vt, gt, bt)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta, reset))
    S0 = jnp.zeros((B, H, K, V), jnp.float32) if state is None else state.astype(jnp.float32)
    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 2), S


def recurrent_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                   beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """T tokens of one document continuing ``state`` (generation's decode step): the
    recurrent form of `gated_delta_rule` from a given incoming state.

    Args:
      state: [B, Hv, Dk, Dv] the state after the tokens before these (float32).
      q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g (float32), beta: [B, T, Hv] -- as
        `gated_delta_rule` takes them (L2-normalised and scaled inside).

    Returns:
      (o [B, T, Hv, Dv] in v's dtype, the state after the T tokens [B, Hv, Dk, Dv] float32).
    """
    B, T = q.shape[:2]
    tokens = jnp.ones((B, T), jnp.int32)
    _check(q, k, v, g, beta, tokens, tokens, "recurrent", 1)
    H, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    if state.shape != (B, H, K, V):
        raise ValueError(f"state {state.shape} must be [B, Hv, Dk, Dv] = {(B, H, K, V)}")
    xs = _prepare(q, k, v, g, beta, tokens)
    o, S = _recurrent(*xs, jnp.zeros(xs[3].shape, bool), state)
    return _finish(o, tokens, v.dtype), S


# -- the chunked form -------------------------------------------------------------------------

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


def _chunked(q, k, v, g, beta, reset, identity=False, chunk=CHUNK, picks=None):
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


# -- preparing inputs -------------------------------------------------------------------------

def _prepare(q, k, v, g, beta, segment_ids):
    """Normalised, scaled, head-repeated float32 inputs in [B, H, L, .] layout; padding tokens
    made identity (beta = 0, g = 0)."""
    H, Hk = v.shape[2], q.shape[2]
    f32 = jnp.float32
    q = l2norm(q.astype(f32)) * (q.shape[-1] ** -0.5)
    k = l2norm(k.astype(f32))
    if H != Hk:
        q, k = (jnp.repeat(x, H // Hk, axis=2) for x in (q, k))
    real = (segment_ids != 0)[..., None]
    g = jnp.where(real, g.astype(f32), 0.0)
    beta = jnp.where(real, beta.astype(f32), 0.0)
    heads_first = functools.partial(jnp.moveaxis, source=2, destination=1)
    return (heads_first(q), heads_first(k), heads_first(v.astype(f32)), heads_first(g),
            heads_first(beta))


def _finish(o, segment_ids, dtype):
    """[B, H, L, V] -> [B, L, H, V], 0 on padding."""
    o = jnp.moveaxis(o, 1, 2)
    return jnp.where((segment_ids != 0)[..., None, None], o, 0.0).astype(dtype)


def _unsharded(q, k, v, g, beta, seg, pos, implementation):
    """Any row order: sort into packing order, run, sort back. Returns (o, the state after
    each row's last real token in packing order [B, H, K, V]).

    Padding sorts last and does not reset the state (it is identity: beta = 0, g = 0), so the
    state after the row's last token is that of its last document."""
    order = _packing_order(seg, pos)
    seg_s, pos_s = _take_rows(seg, order), _take_rows(pos, order)
    xs = [jnp.moveaxis(_take_rows(jnp.moveaxis(x, 1, 2), order), 2, 1)
          for x in (q, k, v, g, beta)]
    starts = _starts(seg_s, pos_s) & (seg_s != 0)
    reset = jnp.broadcast_to(starts[:, None], xs[3].shape).astype(jnp.float32)
    if implementation == "recurrent":
        o, state = _recurrent(*xs, reset > 0)
    else:
        o, state = _chunked(*xs, reset)
        state = state[:, 0]
    return jnp.moveaxis(_take_rows(jnp.moveaxis(o, 1, 2), _inverse(order)), 2, 1), state


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     *, segment_ids: jax.Array, positions: jax.Array,
                     partitioner: Partitioner | None = None, implementation: str = "chunked",
                     max_pieces: int = 4, return_state: bool = False):
    """The gated delta rule over packed rows in any load-balanced order (module docstring).

    Args:
      q, k: [B, L, Hk, Dk] (L2-normalised and scaled inside).
      v: [B, L, Hv, Dv], Hv a multiple of Hk.
      g: [B, L, Hv] float32 log decay (<= 0); beta: [B, L, Hv] write strength.
      segment_ids, positions: [B, L] ints (0 = padding segment).
      partitioner: shards the batch and, when its attention scope shards ``length``, the
        sequence (context parallelism; rows reordered by `zoo.data.load_balance`).
      implementation: ``"chunked"`` (training) or ``"recurrent"`` (the reference).
      max_pieces: state slots per shard and row under context parallelism (module docstring).
      return_state: also return the state after each row's last token in packing order (its
        last document's; zeros for a row of padding), [B, Hv, Dk, Dv] float32 -- what
        generation's prefill leaves for `recurrent_step`. Under context parallelism it comes
        from an unsharded chunked pass (the sequence gathered), not from the shards' summaries.

    Returns:
      [B, L, Hv, Dv] in v's dtype, 0 at padding; with `return_state`, (that, the state).
    """
    _check(q, k, v, g, beta, segment_ids, positions, implementation, max_pieces)
    seg, pos = segment_ids.astype(jnp.int32), positions.astype(jnp.int32)
    xs = _prepare(q, k, v, g, beta, seg)
    cp = 1 if partitioner is None or partitioner.mesh is None else \
        partitioner.context_size("attention")
    with jax.named_scope(f"gated_delta_{implementation}"):
        if cp == 1 or implementation == "recurrent":
            o, state = _unsharded(*xs, seg, pos, implementation)
        else:
            o = _sharded(partitioner, xs, seg, pos, max_pieces)
            state = _unsharded(*xs, seg, pos, "chunked")[1] if return_state else None
    o = _finish(o, seg, v.dtype)
    return (o, state) if return_state else o


# -- context parallelism ----------------------------------------------------------------------

def _gather(x, axes, axis=1):
    """All-gather along ``axis`` over the sequence axes (tiled); identity without axes."""
    return jax.lax.all_gather(x, axes, axis=axis, tiled=True) if axes else x


def _slots(mask, P):
    """Local indices of the first P True entries per row ([B, P], L where absent) and the
    overflow flag (more than P)."""
    L = mask.shape[1]
    idx = jax.vmap(lambda m: jnp.nonzero(m, size=P, fill_value=L)[0])(mask)
    return idx, jnp.sum(mask, axis=1) > P


def _at(x, idx, fill):
    """x[b, idx[b, p]] with ``fill`` where idx is out of range."""
    L = x.shape[1]
    got = jnp.take_along_axis(x, jnp.minimum(idx, L - 1), axis=1)
    return jnp.where(idx < L, got, fill)


def _pieces(seg, pos, axes, max_pieces, exports=True):
    """The local piece structure of one shard's rows [B, L] (see the module docstring):
    dict with ``start`` (token starts a piece), ``first`` (index of its piece's first token),
    importing/exporting slots ``imp``/``exp`` ([B, P] local indices, L where empty) with their
    keys, and ``overflow`` ([B] bool, this shard). With ``exports``, one all-gather of the
    importing keys finds the exporting pieces.

    XLA:CPU may run independent collectives in a different order on each device, which
    deadlocks its rendezvous: every collective here and in the callers depends on the one
    before it (keys and flags travel inside one payload), and the first waits for the data
    inputs (`jax.lax.optimization_barrier`), so it follows the collectives that made them."""
    L = seg.shape[1]
    start = _starts(seg, pos)
    idx = jnp.arange(L)
    first = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    end = jnp.concatenate([start[:, 1:], jnp.ones_like(start[:, :1])], axis=1)
    imp, over_i = _slots(start & (pos > 0) & (seg != 0), max_pieces)
    imp_seg, imp_pos = _at(seg, imp, -1), _at(pos, imp, -1)
    out = dict(start=start, first=first, imp=imp, imp_seg=imp_seg, imp_pos=imp_pos,
               overflow=over_i)
    if not exports:
        return out
    both = _gather(jnp.stack([imp_seg, imp_pos], -1), axes)  # [B, nP, 2]
    all_seg, all_pos = both[..., 0], both[..., 1]
    wanted = jnp.any((seg[:, :, None] == all_seg[:, None, :])
                     & (pos[:, :, None] + 1 == all_pos[:, None, :]), axis=-1)
    exp, over_e = _slots(end & wanted & (seg != 0), max_pieces)
    exp_first = _at(first, exp, 0)
    exp_len = exp - exp_first + 1
    exp_end_pos = _at(pos, exp, -1)
    return dict(out, exp=exp, exp_seg=_at(seg, exp, -1), exp_end=exp_end_pos,
                exp_start=exp_end_pos - exp_len + 1, overflow=over_i | over_e)


def _local_chunk(L):
    """The chunk of a shard's pass: CHUNK, or the power of two >= L for shorter shards (fewer
    identity tokens where pieces are laid out on chunk edges)."""
    return min(CHUNK, 1 << max(L - 1, 1).bit_length())


def _layout(pc, L, P, chunk):
    """New index of every local token [B, L] in a buffer where importing pieces start and
    exporting pieces end on chunk edges, and the buffer length."""
    cuts = jnp.sort(jnp.concatenate([pc["imp"], pc["exp"] + 1], axis=1), axis=1)  # [B, 2P]

    def pads(off, cut):
        pad = jnp.where(cut <= L, -(cut + off) % chunk, 0)
        return off + pad, off + pad

    _, offs = jax.lax.scan(pads, jnp.zeros(cuts.shape[0], jnp.int32), cuts.T)  # [2P, B]
    count = jax.vmap(lambda c: jnp.searchsorted(c, jnp.arange(L), side="right"))(cuts)
    offs = jnp.concatenate([jnp.zeros((cuts.shape[0], 1), jnp.int32), offs.T], axis=1)
    new = jnp.arange(L) + jnp.take_along_axis(offs, count, axis=1)
    size = L + min(2 * P, L + 1) * (chunk - 1)  # a pad per distinct cut, each < chunk
    return new, size + -size % chunk


def _scatter(x, new, size):
    """x [B, H, L, ...] placed at new [B, L] in a zero buffer [B, H, size, ...]."""
    def one(xb, nb):
        return jnp.zeros((xb.shape[0], size, *xb.shape[2:]), xb.dtype).at[:, nb].set(xb)
    return jax.vmap(one)(x, new)


def _incoming(AB, seg, start, end, imp_seg, imp_pos):
    """Incoming state of each importing piece (keys ``imp_seg``, ``imp_pos`` [B, P]) [B, P, H,
    K, V]: the gathered summaries AB [B, E, H, K, K + V] (keys seg, start, end [B, E]; seg < 0
    empty) composed per document in packing order, taken after the piece ending just before
    it. The scan reads AB in place and keeps only the P wanted states (no sorted copies)."""
    K = AB.shape[-2]
    order = jax.vmap(lambda s, p: jnp.lexsort((p, s, s < 0)))(seg, start)
    seg_s, start_s, end_s = (_take_rows(x, order) for x in (seg, start, end))
    prev_ok = jnp.concatenate([jnp.zeros_like(seg_s[:, :1], bool),
                               (seg_s[:, 1:] == seg_s[:, :-1]) & (seg_s[:, 1:] >= 0)
                               & (end_s[:, :-1] + 1 == start_s[:, 1:])], axis=1)
    match = ((seg_s[:, None, :] == imp_seg[:, :, None]) & (seg_s[:, None, :] >= 0)
             & (end_s[:, None, :] + 1 == imp_pos[:, :, None]))  # [B, P, E]

    def step(carry, x):
        S, S_in = carry
        e, ok, hit = x
        ab = jax.vmap(lambda m, i: m[i])(AB, e)  # [B, H, K, K + V]
        S = jnp.einsum("bhkj,bhjv->bhkv", ab[..., :K],
                       jnp.where(ok[:, None, None, None], S, 0.0)) + ab[..., K:]
        return (S, S_in + hit.astype(S.dtype)[..., None, None, None] * S[:, None]), None

    B, _, H, _, KV = AB.shape
    S0 = jnp.zeros((B, H, K, KV - K), AB.dtype)
    S_in0 = jnp.zeros((B, imp_seg.shape[1], H, K, KV - K), AB.dtype)
    (_, S_in), _ = jax.lax.scan(step, (S0, S_in0), (order.T, prev_ok.T,
                                                    jnp.moveaxis(match, 2, 0)))
    return S_in


def _shard(q, k, v, g, beta, seg, pos, *, axes, max_pieces):
    """One shard of `gated_delta_rule` under context parallelism: [B, H, L, .] local inputs."""
    B, H, L, K = q.shape
    P = max_pieces
    # the key exchange waits for the inputs (see `_pieces`): collectives upstream come first
    seg, pos, q, k, v, g, beta = jax.lax.optimization_barrier((seg, pos, q, k, v, g, beta))
    pc = _pieces(seg, pos, axes, P)
    C = _local_chunk(L)
    new, size = _layout(pc, L, P, C)
    reset = jnp.broadcast_to(pc["start"][:, None], g.shape).astype(jnp.float32)
    buf = [_scatter(x, new, size) for x in (q, k, v, g, beta, reset)]
    # summaries of exporting pieces: the state at the end of the chunk holding their last token
    exp_chunk = _at(new, pc["exp"], 0) // C  # [B, P]
    o_aug, AB = _chunked(*buf, identity=True, chunk=C, picks=exp_chunk)  # [B,P,H,K,K+V]
    # one payload: summaries, their keys (bit-cast) and the overflow flag
    keys = jnp.stack([pc["exp_seg"], pc["exp_start"], pc["exp_end"],
                      jnp.broadcast_to(pc["overflow"][:, None], pc["exp"].shape)], -1)
    payload = jnp.concatenate([AB.reshape(B, P, -1),
                               jax.lax.bitcast_convert_type(keys, jnp.float32)], -1)
    payload = _gather(payload, axes)  # [B, nP, H*K*(K+V) + 4]
    keys = jax.lax.bitcast_convert_type(payload[..., -4:], jnp.int32)
    AB = payload[..., :-4].reshape(B, -1, H, K, AB.shape[-1])
    overflow = jnp.any(keys[..., 3] != 0, axis=1)
    S_in = _incoming(AB, keys[..., 0], keys[..., 1], keys[..., 2], pc["imp_seg"],
                     pc["imp_pos"])  # [B, P, H, K, V]
    # each buffer chunk starting an importing piece applies its S_in to that piece's tokens
    imp_chunk = jnp.where(pc["imp"] < L, _at(new, pc["imp"], 0) // C, size)  # [B, P]
    n_chunks = size // C
    chunk_slot = jnp.full((B, n_chunks + 1), -1, jnp.int32)
    chunk_slot = jax.vmap(lambda c, i: c.at[i].set(jnp.arange(P), mode="drop"))(
        chunk_slot, jnp.minimum(imp_chunk, n_chunks))[:, :n_chunks]
    # slot per local token (its piece's), placed in the buffer
    is_imp = jnp.take_along_axis(pc["start"] & (pos > 0) & (seg != 0), pc["first"], axis=1)
    rank = jnp.cumsum(pc["start"] & (pos > 0) & (seg != 0), axis=1) - 1
    tok_slot = jnp.where(is_imp, jnp.take_along_axis(rank, pc["first"], axis=1), -1)
    tok_slot = jnp.where(tok_slot < P, tok_slot, -1)
    in_imp = _scatter((tok_slot >= 0)[:, None], new, size)[:, 0]  # [B, S]
    S_chunk = jnp.take_along_axis(S_in, jnp.maximum(chunk_slot, 0)[..., None, None, None],
                                  axis=1)
    S_chunk = jnp.where((chunk_slot >= 0)[..., None, None, None], S_chunk, 0.0)  # [B,N,H,K,V]
    qt = o_aug[..., :K].reshape(B, H, n_chunks, C, K)
    fix = jnp.einsum("bhnck,bnhkv->bhncv", qt, S_chunk).reshape(B, H, size, -1)
    o = o_aug[..., K:] + jnp.where(in_imp[:, None, :, None], fix, 0.0)
    o = jnp.take_along_axis(o, new[:, None, :, None], axis=2)
    return jnp.where(overflow[:, None, None, None], jnp.nan, o)


def _mesh_layout(p: Partitioner, B: int):
    batch_axes = p.batch_axes("attention")
    while batch_axes and B % p.axis_size(batch_axes):
        batch_axes = batch_axes[:-1]
    return tuple(batch_axes), tuple(p.sequence_axes("attention"))


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _sharded(p: Partitioner, xs, seg, pos, max_pieces):
    from jax.sharding import PartitionSpec as Spec
    batch_axes, seq_axes = _mesh_layout(p, seg.shape[0])
    cp = p.axis_size(seq_axes)
    if seg.shape[1] % cp:
        raise ValueError(f"sequence length {seg.shape[1]} does not split over {cp} context "
                         f"shards (mesh axes {seq_axes}); pad it to a multiple of {cp}")
    b, s = _entry(batch_axes), _entry(seq_axes)
    act, tok = Spec(b, None, s, None), Spec(b, s)
    fn = functools.partial(_shard, axes=seq_axes, max_pieces=max_pieces)
    return jax.shard_map(fn, mesh=p.mesh, in_specs=(act, act, act, Spec(b, None, s),
                                                    Spec(b, None, s), tok, tok),
                         out_specs=act, check_vma=False)(*xs, seg, pos)


# -- the short causal convolution -------------------------------------------------------------

def causal_conv1d(x: jax.Array, weight: jax.Array, *, segment_ids: jax.Array,
                  positions: jax.Array, partitioner: Partitioner | None = None,
                  activation: str | None = "silu", max_pieces: int = 4) -> jax.Array:
    """Depthwise causal convolution over packed documents, in any load-balanced row order.

    ``out[t] = act(sum_j weight[:, W-1-j] * x[token (segment, position - j)])`` over the
    ``W`` taps, a missing token (before the document start, or padding) counting 0: each
    document is convolved on its own, as transformers' ``causal_conv1d_fn`` convolves a
    sequence. x [B, L, D]; weight [D, W] (Hugging Face's ``conv1d.weight[:, 0]``);
    ``activation`` ``"silu"`` or None. Under context parallelism (as `gated_delta_rule`)
    the ``W - 1`` tokens before each piece that starts mid-document are fetched from the shards
    that hold them (requests and answers of ``max_pieces * (W - 1)`` tokens per shard and row).
    Output in x's dtype, 0 at padding.
    """
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"x {x.shape} must be [B, L, D] and weight {weight.shape} [D, W] with "
                         "D the channels")
    if activation not in ("silu", None):
        raise ValueError(f"activation={activation!r} must be 'silu' or None")
    _check_tokens(segment_ids, positions, x.shape[:2])
    if isinstance(max_pieces, bool) or not isinstance(max_pieces, int) or max_pieces < 1:
        raise ValueError(f"max_pieces={max_pieces!r} must be a positive int")
    seg, pos = segment_ids.astype(jnp.int32), positions.astype(jnp.int32)
    cp = 1 if partitioner is None or partitioner.mesh is None else \
        partitioner.context_size("attention")
    if cp == 1:
        order = _packing_order(seg, pos)
        out = _conv_shard(_take_rows(x, order), weight, _take_rows(seg, order),
                          _take_rows(pos, order), axes=(), max_pieces=max_pieces)
        out = _take_rows(out, _inverse(order))
    else:
        from jax.sharding import PartitionSpec as Spec
        batch_axes, seq_axes = _mesh_layout(partitioner, x.shape[0])
        b, s = _entry(batch_axes), _entry(seq_axes)
        fn = functools.partial(_conv_shard, axes=seq_axes, max_pieces=max_pieces)
        out = jax.shard_map(fn, mesh=partitioner.mesh,
                            in_specs=(Spec(b, s, None), Spec(), Spec(b, s), Spec(b, s)),
                            out_specs=Spec(b, s, None), check_vma=False)(x, weight, seg, pos)
    if activation == "silu":
        out = jax.nn.silu(out)
    return jnp.where((seg != 0)[..., None], out, 0).astype(x.dtype)


def conv_tail(x: jax.Array, width: int, *, segment_ids: jax.Array,
              positions: jax.Array) -> jax.Array:
    """The last `width` inputs ``x`` [B, L, D] of each row's last document in packing order
    (rows in any order, padding anywhere), oldest first: [B, width, D], 0 where the document
    has fewer tokens -- the window `causal_conv1d` convolves a next token of that document
    with (generation's convolution cache)."""
    if x.ndim != 3:
        raise ValueError(f"x {x.shape} must be [B, L, D]")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width={width!r} must be an int >= 0 (the kernel size - 1)")
    _check_tokens(segment_ids, positions, x.shape[:2])
    seg, pos = segment_ids.astype(jnp.int32), positions.astype(jnp.int32)
    order = _packing_order(seg, pos)
    x_s, seg_s = _take_rows(x, order), _take_rows(seg, order)
    n = jnp.sum(seg != 0, axis=1, keepdims=True)  # real tokens, first in packing order
    idx = n - width + jnp.arange(width)  # [B, width]
    last = _at(seg_s, n - 1, 0)  # [B, 1]: the last document (0: no token)
    keep = (idx >= 0) & (_at(seg_s, jnp.maximum(idx, 0), -1) == last) & (last != 0)
    tail = _take_rows(x_s, jnp.clip(idx, 0, x.shape[1] - 1))
    return jnp.where(keep[..., None], tail, 0).astype(x.dtype)


def _conv_shard(x, weight, seg, pos, *, axes, max_pieces):
    """One shard of `causal_conv1d` (before the activation), float32."""
    B, L, D = x.shape
    W = weight.shape[1]
    P = max_pieces
    x = x.astype(jnp.float32)
    weight = weight.astype(jnp.float32)
    seg, pos, x = jax.lax.optimization_barrier((seg, pos, x))  # after upstream collectives
    pc = _pieces(seg, pos, axes, P, exports=False)
    overflow = pc["overflow"]
    t = jnp.arange(L)
    back = t - pc["first"]  # tokens of the piece before t
    ctx = jnp.zeros((B, P * max(W - 1, 1), D), jnp.float32)
    if W > 1 and axes:
        # requests: the W-1 tokens before each importing piece, answered by their holders
        taps = jnp.arange(1, W)
        req_seg = jnp.broadcast_to(pc["imp_seg"][..., None], (B, P, W - 1)).reshape(B, -1)
        req_pos = (pc["imp_pos"][..., None] - taps).reshape(B, -1)
        both = _gather(jnp.stack([req_seg, req_pos], -1), axes)  # [B, nP(W-1), 2]
        all_seg, all_pos = both[..., 0], both[..., 1]
        hit = ((seg[:, :, None] == all_seg[:, None, :]) & (pos[:, :, None] == all_pos[:, None, :])
               & (all_seg[:, None, :] > 0))
        where = jnp.argmax(hit, axis=1)  # [B, R]
        found = jnp.any(hit, axis=1)
        answers = jnp.where(found[..., None], _take_rows(x, where), 0.0)
        flag = jnp.broadcast_to(overflow[:, None, None], (*answers.shape[:2], 1))
        answers = jax.lax.psum(jnp.concatenate([answers, flag.astype(jnp.float32)], -1), axes)
        overflow, answers = jnp.any(answers[:, :, -1] > 0, axis=1), answers[..., :-1]
        me = jax.lax.axis_index(axes)
        ctx = jax.lax.dynamic_slice_in_dim(answers, me * P * (W - 1), P * (W - 1), axis=1)
    imp = pc["start"] & (pos > 0) & (seg != 0)
    rank = jnp.cumsum(imp, axis=1) - 1
    slot = jnp.where(jnp.take_along_axis(imp, pc["first"], axis=1),
                     jnp.take_along_axis(rank, pc["first"], axis=1), -1)
    slot = jnp.where((slot < P) & bool(axes), slot, -1)  # one shard: rows in packing order
    out = x * weight[:, W - 1]
    for j in range(1, W):
        local = jnp.where((back >= j)[..., None], jnp.roll(x, j, axis=1), 0.0)
        m = j - back  # 1..W-1: the m-th token before the piece's start
        from_ctx = (back < j) & (slot >= 0)
        idx = jnp.clip(slot * (W - 1) + m - 1, 0, ctx.shape[1] - 1)
        fetched = pick_rows(ctx, idx, from_ctx)
        out = out + (local + fetched) * weight[:, W - 1 - j]
    return jnp.where(overflow[:, None, None], jnp.nan, out) if axes else out
