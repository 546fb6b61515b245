"""Context parallelism for the gated delta rule and its short convolution
(`zoo.ops.gated_delta`): running them over a ``partitioner`` whose attention scope shards
``length`` (under ``ep_as_cp`` that includes the expert axis), by `jax.shard_map` over the
sequence axes. Each shard cuts its rows into *pieces*, maximal runs of tokens that follow each
other in packing order (`piece_starts`).

1. A piece that starts at position > 0 *imports* a state; its key (segment, start) is
   all-gathered (``max_pieces`` slots per shard and row). A piece whose successor token is
   imported somewhere *exports*.
2. One chunked pass with values ``[0 | v]`` (the zeros implicit) and reset state ``[I | 0]``
   gives, for every token, its output with a zero incoming state and its query carried back
   to the start of its piece (``q~ = P^T q``), and for every exporting piece its summary
   ``S -> A S + B`` (``[A | B]`` = the state after the piece). Pieces that import or export
   are laid out on chunk boundaries (at most ``2 * max_pieces * (C - 1)`` identity tokens per
   shard) so these are chunk-edge quantities. The pass hands out only those ``max_pieces``
   chunk-edge states (`zoo.ops.gated_delta_chunked.chunked`'s ``picks``) and takes their
   cotangents back into its reverse scan at their chunks: no per-chunk ``[Dk, Dk + Dv]``
   state array besides the backward's saved one.
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

The convolution (`conv_shard`, `conv_sharded`) fetches the ``W - 1`` tokens before each piece
that starts mid-document from the shards that hold them: requests and answers of
``max_pieces * (W - 1)`` tokens per shard and row, looked up by a one-hot product
(`pick_rows`).

Legend: B batch, L length, H value heads, K Dk, V Dv, N chunks, C chunk size, P max_pieces,
n context shards, D channels, W kernel size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zoo.ops.gated_delta_chunked import CHUNK, chunked
from zoo.partitioning import Partitioner

__all__ = ["conv_shard", "conv_sharded", "pick_rows", "piece_starts", "shard", "sharded",
           "take_at", "take_rows"]


# -- pieces: runs of tokens that follow each other in packing order ---------------------------

def piece_starts(seg, pos):
    """[B, L] bool: token starts a piece (not the packing successor of the token before it)."""
    follows = (seg[:, 1:] == seg[:, :-1]) & (pos[:, 1:] == pos[:, :-1] + 1)
    return jnp.concatenate([jnp.ones_like(follows[:, :1]), ~follows], axis=1)


def take_rows(x, idx):
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


def take_at(x, idx, fill):
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
    start = piece_starts(seg, pos)
    idx = jnp.arange(L)
    first = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    end = jnp.concatenate([start[:, 1:], jnp.ones_like(start[:, :1])], axis=1)
    imp, over_i = _slots(start & (pos > 0) & (seg != 0), max_pieces)
    imp_seg, imp_pos = take_at(seg, imp, -1), take_at(pos, imp, -1)
    out = dict(start=start, first=first, imp=imp, imp_seg=imp_seg, imp_pos=imp_pos,
               overflow=over_i)
    if not exports:
        return out
    both = _gather(jnp.stack([imp_seg, imp_pos], -1), axes)  # [B, nP, 2]
    all_seg, all_pos = both[..., 0], both[..., 1]
    wanted = jnp.any((seg[:, :, None] == all_seg[:, None, :])
                     & (pos[:, :, None] + 1 == all_pos[:, None, :]), axis=-1)
    exp, over_e = _slots(end & wanted & (seg != 0), max_pieces)
    exp_first = take_at(first, exp, 0)
    exp_len = exp - exp_first + 1
    exp_end_pos = take_at(pos, exp, -1)
    return dict(out, exp=exp, exp_seg=take_at(seg, exp, -1), exp_end=exp_end_pos,
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
    seg_s, start_s, end_s = (take_rows(x, order) for x in (seg, start, end))
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


def shard(q, k, v, g, beta, seg, pos, *, axes, max_pieces):
    """One shard of `zoo.ops.gated_delta.gated_delta_rule` under context parallelism: the
    prepared inputs (`zoo.ops.gated_delta`) [B, H, L, .] local, seg and pos [B, L]; with
    ``axes=()`` the same algorithm on one device."""
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
    exp_chunk = take_at(new, pc["exp"], 0) // C  # [B, P]
    o_aug, AB = chunked(*buf, identity=True, chunk=C, picks=exp_chunk)  # [B,P,H,K,K+V]
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
    imp_chunk = jnp.where(pc["imp"] < L, take_at(new, pc["imp"], 0) // C, size)  # [B, P]
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


def sharded(p: Partitioner, xs, seg, pos, max_pieces):
    """`shard` over the partitioner's context shards: xs the prepared (q, k, v, g, beta)
    [B, H, L, .] (`zoo.ops.gated_delta`), seg and pos [B, L]; returns o [B, H, L, V]."""
    from jax.sharding import PartitionSpec as Spec
    batch_axes, seq_axes = _mesh_layout(p, seg.shape[0])
    cp = p.axis_size(seq_axes)
    if seg.shape[1] % cp:
        raise ValueError(f"sequence length {seg.shape[1]} does not split over {cp} context "
                         f"shards (mesh axes {seq_axes}); pad it to a multiple of {cp}")
    b, s = _entry(batch_axes), _entry(seq_axes)
    act, tok = Spec(b, None, s, None), Spec(b, s)
    fn = functools.partial(shard, axes=seq_axes, max_pieces=max_pieces)
    return jax.shard_map(fn, mesh=p.mesh, in_specs=(act, act, act, Spec(b, None, s),
                                                    Spec(b, None, s), tok, tok),
                         out_specs=act, check_vma=False)(*xs, seg, pos)


# -- the short causal convolution's context ---------------------------------------------------

def conv_shard(x, weight, seg, pos, *, axes, max_pieces):
    """One shard of `zoo.ops.gated_delta.causal_conv1d` (before the activation), float32."""
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
        answers = jnp.where(found[..., None], take_rows(x, where), 0.0)
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


def conv_sharded(p: Partitioner, x, weight, seg, pos, max_pieces):
    """`conv_shard` over the partitioner's context shards: x [B, L, D], weight [D, W], seg and
    pos [B, L] in their global layout."""
    from jax.sharding import PartitionSpec as Spec
    batch_axes, seq_axes = _mesh_layout(p, x.shape[0])
    b, s = _entry(batch_axes), _entry(seq_axes)
    fn = functools.partial(conv_shard, axes=seq_axes, max_pieces=max_pieces)
    return jax.shard_map(fn, mesh=p.mesh,
                         in_specs=(Spec(b, s, None), Spec(), Spec(b, s), Spec(b, s)),
                         out_specs=Spec(b, s, None), check_vma=False)(x, weight, seg, pos)
