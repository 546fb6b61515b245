"""Sparse attention: each query attends only to its selected keys (DeepSeek sparse attention).

The selection is ``indices [B, L, k]``: for each query, the array indices of its ``k`` keys in
the key arrays as passed (the lightning indexer's `zoo.layers.Indexer.topk` gives them); ``-1``
marks an empty slot. Indices of one query must be distinct (a top-k is).

* `TopK` -- the selection as a mask value. It names each selected key by its (segment id,
  position), never by array index, so it stays exact after any reordering of the keys
  (`zoo.data.load_balance`). ``TopK.from_indices(indices, kv_positions, kv_segment_ids)`` builds
  it. It composes as ``Causal() & Document() & TopK(...)``.
* `sparse_attention(q, k, v, indices, ...)`: attention under ``mask & TopK``.
  - MQA / MLA-absorbed form: ``k [B, S, Hk]``, one key head shared by all query heads (MLA's
    latent concatenated with the rotary key); ``v=None`` means the values are
    ``k[..., :v_head_dim]`` (MLA's latent), gathered once with the keys.
  - GQA form: ``k [B, S, K, H]``, ``v [B, S, K, Hv]``, N divisible by K.
* Implementations (``implementation=``):
  - ``"dense"`` -- the reference: dense scores [B, N, L, S] under ``mask`` and the top-k
    membership (scattered from ``indices``); O(L·S) work and memory.
  - ``"gather"`` -- gathers only the ``k`` selected keys/values of each query: O(L·k) work.
    ``mask`` is evaluated on the gathered keys' (position, segment id), so any elementwise mask
    works. Its gradient with respect to k and v is the scatter-add of the [B, L, k, ...] gathered
    cotangents (no dense [B, L, S, ...] array). ``query_chunk`` bounds the gathered memory to
    [B, query_chunk, k, ...] at a time (a `jax.lax.map` over query chunks).
  - ``"auto"`` -- `choose_sparse_implementation`: ``"dense"`` when ``k`` is at least the number
    of keys a query sees on average (S/2 when the mask is causal, S otherwise: then the top-k
    barely prunes and dense is cheaper), else ``"gather"``.

* `sparse_mla_attention(q, latent, k_pe, kv_up, indices, ...)`: multi-head latent attention
  (`zoo.layers.MLA`) over the selected keys in the absorbed form: each query's no-position part
  goes through ``kv_up``'s key half into latent space, `sparse_attention` runs one shared key
  head ``[latent; k_pe]`` (R + Hr wide, values ``latent``), and ``kv_up``'s value half maps the
  result back -- the per-head K/V are never built. Under context parallelism (a partitioner
  whose attention sequence axes are > 1) it runs under `jax.shard_map`: each shard holds its
  queries and their ``indices`` (array indices into the whole row, as `zoo.layers.Indexer`
  selects them; shard s of n holds places [s*S, (s+1)*S) of the row as laid out), fetches the
  latent and ``k_pe`` (R + Hr values per token) with their positions and segment ids from the
  shards that own them, and attends locally. Exact for any token order
  (`zoo.data.load_balance`): the indices name places in the row, and the mask is evaluated on
  the fetched positions and segment ids.

* Fetching the keys under context parallelism (``fetch=``):
  - ``"all_gather"``: all-gather the whole row's latent and ``k_pe`` over the sequence axes;
    backward, their gradient is reduce-scattered back (the all-gather's transpose).
  - ``"hops"``: only the blocks of shards that hold selected keys move. Each shard marks the
    source shards its indices name (an [n] bool), all-gathers it into the need matrix
    [n, n] (`fetch_plan` computes the same from the whole row's indices) and reduces it over
    the other mesh axes, so every device agrees on it. For each distance d = 1..n-1 one
    static `jax.lax.ppermute` brings every shard the block of shard (r - d) mod n, inside a
    `jax.lax.cond` on "some shard needs distance d" (uniform, so every device takes the same
    branch); a distance no shard needs moves nothing, forward or backward (its gradient goes
    home by the inverse permutation under the same condition). The local block always counts.
    The fetched blocks are laid side by side by distance and the indices remapped to them, so
    the attention is the all-gather's, over the same selected keys: no extra work per block.
  - ``"auto"`` (default): by bytes per call, decided at run time from the agreed need matrix
    (`choose_fetch`): hops move (needed distances) x S x (R + Hr) x itemsize per device, the
    all-gather (n - 1) x the same (positions and segment ids add 8 bytes per token to both);
    hops when they move fewer bytes, else the all-gather (one collective for the same bytes).
    Rows of short documents kept whole on their shards (the ``"auto"`` layout's greedy
    placement, or no reordering) need few distances; ``"document"`` cuts every document over
    all shards, so every distance is needed and the all-gather is taken.

`choose_query_chunk` and `map_query_chunks` bound the per-step arrays of a computation over
queries (this op's ``"gather"``, `zoo.layers.Indexer`'s selection, `zoo.ops.compressed_attention`).

Where `TopK` works: as a mask of `zoo.ops.masks.attention_mask` and
`zoo.ops.attention.dot_product_attention` (the dense reference paths, where the mask sees
whole query rows), and (as ``indices``) in both implementations here. Block kernels and the
context-parallel strategies see tiles of queries, not whole rows: `TopK` raises there.

Legend: B batch, L queries, S keys, N query heads, K key heads, H key width, Hv value width,
k selected keys per query.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zoo.ops.masks import Causal, Document, Mask, evaluate
from zoo.ops.ring import ring_perm
from zoo.partitioning import Partitioner, resolve

IMPLEMENTATIONS = ("auto", "dense", "gather")
FETCHES = ("auto", "all_gather", "hops")  # how the selected latents reach a shard (docstring)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class TopK(Mask):
    """Each query sees only its selected keys, named by (segment id, position).

    ``positions``, ``segment_ids``: [B, L, k] of the selected keys of each of the L queries
    (segment id 0: an empty slot, which matches nothing). Elementwise, ``TopK`` is True where the
    key's (segment id, position) is among the query's selected ones. The query is identified by
    its place along the query axis, so the mask must be evaluated over whole rows of queries in
    the order of the selection (`attention_mask`, `dot_product_attention`); it costs O(L·S·k)
    there (a reference, not a kernel). A pytree: it passes through `jax.jit` as an argument.
    """

    positions: jax.Array
    segment_ids: jax.Array

    def __post_init__(self):
        shapes = [getattr(a, "shape", None) for a in (self.positions, self.segment_ids)]
        if None in shapes:  # a pytree unflattened with placeholders (jax internals)
            return
        if shapes[0] != shapes[1] or len(shapes[0]) != 3:
            raise ValueError(f"TopK: positions {self.positions.shape} and segment_ids "
                             f"{self.segment_ids.shape} must both be [B, L, k] (the selected "
                             f"keys of each query)")

    @classmethod
    def from_indices(cls, indices: jax.Array, kv_positions: jax.Array,
                     kv_segment_ids: jax.Array | None = None) -> TopK:
        """From array indices [B, L, k] into keys with positions/segment ids [B, S] (``-1``:
        an empty slot; ``kv_segment_ids=None``: one document, no padding)."""
        if kv_segment_ids is None:
            kv_segment_ids = jnp.ones(kv_positions.shape, jnp.int32)
        pos, seg = gather_keys(indices, kv_positions, kv_segment_ids)
        return cls(pos, seg)

    def __call__(self, q_pos, kv_pos, q_seg, kv_seg):
        q_pos, kv_pos = jnp.asarray(q_pos), jnp.asarray(kv_pos)
        B, L, k = self.positions.shape
        shape = jnp.broadcast_shapes(q_pos.shape, kv_pos.shape)
        axis = _query_axis(q_pos.shape, kv_pos.shape, L)
        if axis is None or shape[0] not in (1, B):
            raise ValueError(f"TopK selects keys per query for {L} queries in rows of {B}, but "
                             f"the mask was evaluated on query positions {q_pos.shape} and key "
                             f"positions {kv_pos.shape} (no axis of {L} whole query rows); use "
                             f"it with attention_mask / dot_product_attention, or pass the "
                             f"selection as indices to zoo.ops.sparse_attention")
        sel = [1] * len(shape)
        sel[0], sel[axis] = B, L

        def place(a):  # [B, L, k] -> broadcastable to shape + (k,)
            return a.reshape(*sel, k)

        hit = (place(self.positions) == jnp.asarray(kv_pos)[..., None]) & (
            place(self.segment_ids) == jnp.asarray(kv_seg)[..., None]) & (
            place(self.segment_ids) != 0)
        return jnp.any(hit, axis=-1)


def _query_axis(q_shape, kv_shape, L: int) -> int | None:
    """The axis (after broadcasting) along which ``q_pos`` runs over the L queries."""
    n = max(len(q_shape), len(kv_shape))
    q = (1,) * (n - len(q_shape)) + tuple(q_shape)
    kv = (1,) * (n - len(kv_shape)) + tuple(kv_shape)
    for a in range(1, n):
        if q[a] == L and kv[a] == 1:
            return a
    return None


def gather_keys(indices: jax.Array, *per_key: jax.Array) -> tuple[jax.Array, ...]:
    """``a[b, indices[b, l, j]]`` for each ``a [B, S, ...]`` -> [B, L, k, ...]; an empty slot
    (index -1) gives segment-id-like zeros (for positions and segment ids: an empty key)."""
    B, L, k = indices.shape
    valid = indices >= 0
    flat = jnp.where(valid, indices, 0).reshape(B, L * k)
    out = []
    for a in per_key:
        g = jnp.take_along_axis(a, flat.reshape(B, L * k, *(1,) * (a.ndim - 2)), axis=1)
        g = g.reshape(B, L, k, *a.shape[2:])
        out.append(jnp.where(valid.reshape(B, L, k, *(1,) * (a.ndim - 2)), g, 0))
    return tuple(out)


def choose_sparse_implementation(k: int, num_keys: int, mask: Mask | None = None) -> str:
    """``"dense"`` when ``k`` >= the keys a query sees on average (``num_keys / 2`` when the
    mask is causal, i.e. ``mask.reach().ahead == 0``, else ``num_keys``), else ``"gather"``."""
    mask = Causal() & Document() if mask is None else mask
    visible = num_keys / 2 if mask.reach().ahead == 0 else num_keys
    return "dense" if k >= visible else "gather"


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array | None, indices: jax.Array, *,
                     q_positions: jax.Array, kv_positions: jax.Array,
                     q_segment_ids: jax.Array | None = None,
                     kv_segment_ids: jax.Array | None = None, mask: Mask | None = None,
                     scale: float | None = None, v_head_dim: int | None = None,
                     implementation: str = "auto", query_chunk: int | None = None) -> jax.Array:
    """Attention of each query over its selected keys, under ``mask & TopK`` -> [B, L, N, Hv].

    Args:
      q: [B, L, N, H].
      k: [B, S, H] (one key head shared by all query heads: MQA / absorbed MLA) or
        [B, S, K, H] (GQA).
      v: [B, S, Hv] / [B, S, K, Hv], or None: the values are ``k[..., :v_head_dim]`` (MLA's
        latent; ``v_head_dim`` required then).
      indices: [B, L, k] int, array indices into the S keys (``-1``: empty slot), distinct per
        query.
      q_positions, kv_positions: [B, L] / [B, S]; ``*_segment_ids``: [B, L] / [B, S] (None: one
        document, no padding; 0 is padding).
      mask: the elementwise mask besides the selection (default ``Causal() & Document()``).
      scale: softmax scale (default H**-0.5).
      implementation: ``"dense"``, ``"gather"`` or ``"auto"`` (module docstring).
      query_chunk: ``"gather"`` processes this many queries at a time (None: all); must
        divide L.

    Scores and softmax in float32; a query with no visible selected key gives exact zeros.
    """
    B, L, N, H = q.shape
    mask = Causal() & Document() if mask is None else mask
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"sparse_attention: implementation={implementation!r} must be one of "
                         f"{IMPLEMENTATIONS}")
    if k.ndim not in (3, 4) or k.shape[0] != B or k.shape[-1] != H:
        raise ValueError(f"sparse_attention: k {k.shape} must be [B, S, H] or [B, S, K, H] with "
                         f"B={B}, H={H} as q {q.shape}")
    if v is None:
        if v_head_dim is None or not 0 < v_head_dim <= H:
            raise ValueError(f"sparse_attention: v=None takes the values from k[..., "
                             f":v_head_dim]; v_head_dim={v_head_dim!r} must be in 1..{H}")
    elif v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"sparse_attention: v {v.shape} must match k {k.shape} but in the "
                         f"last dim")
    if k.ndim == 4 and N % k.shape[2]:
        raise ValueError(f"sparse_attention: {N} query heads are not divisible by "
                         f"{k.shape[2]} key heads")
    if indices.ndim != 3 or indices.shape[:2] != (B, L):
        raise ValueError(f"sparse_attention: indices {indices.shape} must be [B, L, k] = "
                         f"[{B}, {L}, k]")
    S, topk = k.shape[1], indices.shape[2]
    if q_segment_ids is None:
        q_segment_ids = jnp.ones((B, L), jnp.int32)
    if kv_segment_ids is None:
        kv_segment_ids = jnp.ones((B, S), jnp.int32)
    scale = H ** -0.5 if scale is None else float(scale)
    if implementation == "auto":
        implementation = choose_sparse_implementation(topk, S, mask)
    args = (q, k, v, indices, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    with jax.named_scope(f"sparse_attention_{implementation}"):
        if implementation == "dense":
            return _dense(*args, mask=mask, scale=scale, v_head_dim=v_head_dim)
        def one(xs):
            qc, ic, pc, sc = xs
            return _gather(qc, k, v, ic, pc, kv_positions, sc, kv_segment_ids, mask=mask,
                           scale=scale, v_head_dim=v_head_dim)

        return map_query_chunks(one, query_chunk, (q, indices, q_positions, q_segment_ids),
                                what="sparse_attention")


def _softmax_out(s: jax.Array, visible: jax.Array) -> jax.Array:
    """Masked softmax over the last axis; rows with nothing visible are zeros (no NaN)."""
    s = jnp.where(visible, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(den > 0, den, 1.0)


def _heads(q, k):
    """q [B, L, N, H] -> [B, L, K, G, H] with K key heads (1 for a shared key)."""
    B, L, N, H = q.shape
    K = 1 if k.ndim == 3 else k.shape[2]
    return q.astype(jnp.float32).reshape(B, L, K, N // K, H)


def _dense(q, k, v, indices, q_pos, kv_pos, q_seg, kv_seg, *, mask, scale, v_head_dim):
    B, L, N, _ = q.shape
    S = k.shape[1]
    k4 = (k[:, :, None] if k.ndim == 3 else k).astype(jnp.float32)  # [B, S, K, H]
    v4 = k4[..., :v_head_dim] if v is None else (
        v[:, :, None] if v.ndim == 3 else v).astype(jnp.float32)
    # the top-k membership, scattered from the indices (the same keys `TopK` names)
    rows, queries = jnp.arange(B)[:, None, None], jnp.arange(L)[None, :, None]
    slots = jnp.where(indices >= 0, indices, S)  # an empty slot lands in a dropped column
    chosen = jnp.zeros((B, L, S + 1), bool).at[rows, queries, slots].set(True)[..., :S]
    visible = evaluate(mask, q_pos[:, :, None], kv_pos[:, None, :], q_seg[:, :, None],
                       kv_seg[:, None, :]) & chosen  # [B, L, S]
    s = jnp.einsum("blkgh,bskh->blkgs", _heads(q, k), k4) * scale
    p = _softmax_out(s, visible[:, :, None, None, :])
    return jnp.einsum("blkgs,bskv->blkgv", p, v4).reshape(B, L, N, -1).astype(q.dtype)


def _gather(q, k, v, indices, q_pos, kv_pos, q_seg, kv_seg, *, mask, scale, v_head_dim):
    B, L, N, _ = q.shape
    kpos, kseg = gather_keys(indices, kv_pos, kv_seg)  # [B, L, k]
    visible = evaluate(mask, q_pos[:, :, None], kpos, q_seg[:, :, None], kseg)
    visible = visible & (indices >= 0)
    if v is None:
        (kg,) = gather_keys(indices, k)  # [B, L, k, H]: keys and values gathered once
        kg = kg.astype(jnp.float32)
        vg = kg[..., :v_head_dim]
    else:
        kg, vg = (a.astype(jnp.float32) for a in gather_keys(indices, k, v))
    if k.ndim == 3:
        kg, vg = kg[:, :, :, None], vg[:, :, :, None]  # [B, L, k, 1, H]
    s = jnp.einsum("blKgh,bljKh->blKgj", _heads(q, k), kg) * scale
    p = _softmax_out(s, visible[:, :, None, None, :])
    return jnp.einsum("blKgj,bljKv->blKgv", p, vg).reshape(B, L, N, -1).astype(q.dtype)


# -- MLA over the selected keys, context-parallel -----------------------------------------------

def sparse_mla_attention(q: jax.Array, latent: jax.Array, k_pe: jax.Array, kv_up: jax.Array,
                         indices: jax.Array, *, qk_nope_head_dim: int, positions: jax.Array,
                         segment_ids: jax.Array | None = None, mask: Mask | None = None,
                         scale: float | None = None, partitioner: Partitioner | None = None,
                         implementation: str = "auto",
                         query_chunk: int | str | None = "auto",
                         fetch: str = "auto") -> jax.Array:
    """MLA self-attention of each query over its selected keys (module docstring) -> [B, L, N, Hv].

    Args:
      q: [B, L, N, Hn + Hr] (rotated); latent: [B, L, R] (normalised); k_pe: [B, L, Hr]
        (rotated, shared by every head); kv_up: [R, N, Hn + Hv] (``kv_b_proj``'s kernel).
      indices: [B, L, k] int, each query's selected keys as array indices into the row
        (``-1``: empty slot).
      positions, segment_ids: [B, L] of the tokens (queries = keys; None: one document).
      mask: the elementwise mask besides the selection (default ``Causal() & Document()``).
      scale: softmax scale (default (Hn + Hr)**-0.5).
      partitioner: under context parallelism the keys are fetched from their shards
        (module docstring).
      implementation, query_chunk: `sparse_attention`'s, on each shard's queries;
        ``query_chunk="auto"``: `choose_query_chunk` (bounds the gathered keys per step).
      fetch: ``"auto"``, ``"all_gather"`` or ``"hops"``: how the keys reach each shard under
        context parallelism (module docstring); no effect without it.

    What crosses the wire per token fetched under context parallelism: the latent and ``k_pe``
    (R + Hr values) forward and their gradients backward, plus the positions and segment ids
    (int32).
    """
    B, L, N, Hqk = q.shape
    R, Hn = latent.shape[-1], qk_nope_head_dim
    check_fetch(fetch)
    if (latent.ndim != 3 or k_pe.ndim != 3 or latent.shape[:2] != (B, L)
            or k_pe.shape[:2] != (B, L) or Hn + k_pe.shape[-1] != Hqk
            or kv_up.shape[:2] != (R, N) or kv_up.shape[2] <= Hn):
        raise ValueError(f"sparse_mla_attention expects q [B,L,N,Hn+Hr], latent [B,L,R], k_pe "
                         f"[B,L,Hr], kv_up [R,N,Hn+Hv] with Hn=qk_nope_head_dim={Hn}; got "
                         f"{q.shape}, {latent.shape}, {k_pe.shape}, {kv_up.shape}")
    if segment_ids is None:
        segment_ids = jnp.ones((B, L), jnp.int32)
    positions, segment_ids = positions.astype(jnp.int32), segment_ids.astype(jnp.int32)
    scale = Hqk ** -0.5 if scale is None else float(scale)
    p = resolve(partitioner)
    seq_axes = p.sequence_axes("attention") if p.mesh is not None else ()
    local = functools.partial(_absorbed, Hn=Hn, mask=mask, scale=scale,
                              implementation=implementation, query_chunk=query_chunk,
                              seq_axes=tuple(seq_axes), fetch=fetch,
                              mesh_axes=tuple(p.mesh.axis_names) if seq_axes else ())
    args = (q, latent, k_pe, kv_up, indices, positions, segment_ids)
    if not seq_axes:  # no sequence shards: the plain program (XLA partitions batch and heads)
        return local(*args)
    batch_axes = p.batch_axes("attention")
    while batch_axes and B % p.axis_size(batch_axes):  # the largest prefix that divides B
        batch_axes = batch_axes[:-1]
    head_axes = p.mesh_axes("act_heads", "attention")
    if N % p.axis_size(head_axes):
        head_axes = ()
    b, s = _entry(batch_axes), _entry(seq_axes)
    h = _entry(head_axes)
    tok = P(b, s)
    specs = (P(b, s, h, None), P(b, s, None), P(b, s, None), P(None, h, None), P(b, s, None),
             tok, tok)
    with jax.named_scope("sparse_mla_attention_cp"):
        return jax.shard_map(local, mesh=p.mesh, in_specs=specs, out_specs=P(b, s, h, None),
                             check_vma=False)(*args)


GATHERED_KEYS = 1 << 18  # keys one step of the "gather" implementation holds per row (auto)


def choose_query_chunk(num_queries: int, keys_per_query: int,
                       budget: int = GATHERED_KEYS) -> int:
    """The largest divisor of `num_queries` whose chunk holds at most `budget` key slots per row
    (``chunk * keys_per_query``): all queries at once at short lengths. ``query_chunk="auto"``
    here gathers at most `GATHERED_KEYS` keys a step (at DeepSeek-V3.2's k = 2048 a chunk of
    128 queries, [128, 2048, 576] values a row); `zoo.layers.Indexer` and
    `zoo.ops.compressed_attention` bound their per-step arrays with it too."""
    best = 1
    for c in range(1, num_queries + 1):
        if num_queries % c == 0 and c * keys_per_query <= budget:
            best = c
    return best


def map_query_chunks(fn, query_chunk: int | None, per_query: tuple, *,
                     what: str = "map_query_chunks"):
    """``fn(per_query)`` over chunks of ``query_chunk`` queries (a `jax.lax.map`, so only one
    chunk's intermediates live at a time; None: one call): each array of ``per_query`` is
    [B, L, ...] (None passes through), and so is ``fn``'s result, reassembled. ``what`` names
    the caller in the error for a chunk that does not divide L.

    Each chunk is rematerialised (`jax.checkpoint`): differentiated, the map keeps only its
    inputs and the backward recomputes one chunk's intermediates at a time, rather than
    stacking every chunk's (gathered keys, scores, masks) for the backward."""
    B, L = next(a for a in per_query if a is not None).shape[:2]
    if query_chunk is None or query_chunk >= L:
        return fn(per_query)
    if L % query_chunk:
        raise ValueError(f"{what}: query_chunk={query_chunk} must divide the {L} queries; "
                         f"pass a divisor of {L} or None")
    c = L // query_chunk

    def split(a):  # [B, L, ...] -> [c, B, query_chunk, ...]
        return None if a is None else jnp.moveaxis(a.reshape(B, c, query_chunk, *a.shape[2:]),
                                                   1, 0)

    out = jax.lax.map(jax.checkpoint(fn, prevent_cse=False), tuple(split(a) for a in per_query))
    return jnp.moveaxis(out, 0, 1).reshape(B, L, *out.shape[3:])


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _absorbed(q, latent, k_pe, kv_up, indices, positions, segment_ids, *, Hn, mask, scale,
              implementation, query_chunk, seq_axes, fetch, mesh_axes):
    """One shard's (or the whole row's) absorbed MLA over the selected keys."""
    kv = jnp.concatenate([latent, k_pe.astype(latent.dtype)], axis=-1)  # [B, S_local, R + Hr]
    kv_pos, kv_seg = positions, segment_ids
    if seq_axes:  # the keys the indices name, from their shards
        kv, kv_pos, kv_seg, indices = _fetch_keys(kv, kv_pos, kv_seg, indices, fetch=fetch,
                                                  seq_axes=seq_axes, mesh_axes=mesh_axes)
    dtype = kv.dtype
    w = kv_up.astype(dtype)
    w_uk, w_uv = w[..., :Hn], w[..., Hn:]
    q_lat = jnp.einsum("blnh,rnh->blnr", q[..., :Hn].astype(dtype), w_uk)
    q_abs = jnp.concatenate([q_lat, q[..., Hn:].astype(dtype)], axis=-1)  # [B, L, N, R + Hr]
    if query_chunk == "auto":
        query_chunk = choose_query_chunk(q.shape[1], indices.shape[2])
    o_lat = sparse_attention(q_abs, kv, None, indices, q_positions=positions,
                             kv_positions=kv_pos, q_segment_ids=segment_ids,
                             kv_segment_ids=kv_seg, mask=mask, scale=scale,
                             v_head_dim=latent.shape[-1], implementation=implementation,
                             query_chunk=query_chunk)  # [B, L, N, R]
    return jnp.einsum("blnr,rnv->blnv", o_lat, w_uv).astype(q.dtype)


# -- fetching the selected keys under context parallelism --------------------------------------

def check_fetch(fetch, what: str = "sparse_mla_attention: fetch") -> None:
    """Raise a `ValueError` naming the value and the choices unless ``fetch`` is one of
    `FETCHES`; ``what`` names the argument (``"MLA: index_fetch"``)."""
    if fetch not in FETCHES:
        raise ValueError(f"{what}={fetch!r} must be one of {FETCHES} (how the selected keys "
                         f"reach each context shard; 'auto' picks by bytes)")


def _need_row(indices: jax.Array, cp: int, tokens_per_shard: int) -> jax.Array:
    """[cp] bool: which shards own some key that ``indices`` [..., k] names (-1: none)."""
    owner = jnp.where(indices >= 0, indices // tokens_per_shard, cp).reshape(-1)
    return jnp.zeros(cp + 1, bool).at[owner].set(True)[:cp]


def hop_distances(need: jax.Array) -> jax.Array:
    """need [n, n] (row r: the source shards shard r needs) -> [n] bool: distance d is needed
    when some shard r needs shard (r - d) mod n; d = 0 (the local block) always is."""
    n = need.shape[0]
    r = jnp.arange(n)
    by_distance = need[r[:, None], (r[:, None] - r[None, :]) % n]  # [r, d]
    return jnp.any(by_distance, axis=0).at[0].set(True)


def fetch_plan(indices: jax.Array, cp: int) -> tuple[jax.Array, jax.Array]:
    """The whole row's selection ``indices`` [B, L, k] (places in the row as laid out, -1
    empty) over ``cp`` shards of L/cp tokens -> (need [cp, cp] bool: some query of shard r
    selects a key of shard s, over every row; distances [cp] bool: `hop_distances`). The same
    plan ``fetch="hops"`` makes inside the shard_map from each shard's own indices."""
    B, L, k = indices.shape
    if L % cp:
        raise ValueError(f"fetch_plan: {L} tokens do not split over cp={cp} shards; pass a "
                         f"length divisible by {cp}")
    per_shard = jnp.moveaxis(jnp.asarray(indices).reshape(B, cp, L // cp, k), 1, 0)
    need = jax.vmap(lambda a: _need_row(a, cp, L // cp))(per_shard)
    return need, hop_distances(need)


def fetch_bytes(distances, tokens_per_shard: int, bytes_per_token: int) -> dict[str, int]:
    """Bytes each device receives per call: ``{"hops": needed distances (d >= 1) x S x bytes,
    "all_gather": (n - 1) x S x bytes}`` (``bytes_per_token``: (R + Hr) x itemsize, plus 8 for
    positions and segment ids)."""
    n, hops = len(distances), int(sum(bool(d) for d in list(distances)[1:]))
    block = tokens_per_shard * bytes_per_token
    return {"hops": hops * block, "all_gather": (n - 1) * block}


def choose_fetch(num_hops, cp: int):
    """``fetch="auto"``'s rule: hops (True) when the needed distances ``num_hops`` (d >= 1)
    move fewer bytes than the all-gather's ``cp - 1`` blocks, else the all-gather (one
    collective for the same bytes). Works on ints and on traced values."""
    return num_hops < cp - 1


def _fetch_keys(kv, pos, seg, indices, *, fetch, seq_axes, mesh_axes):
    """Inside the shard_map: the keys ``indices`` (places in the whole row) name, with their
    positions and segment ids -> (kv, pos, seg, indices into them)."""
    def gather(_):
        return (*(jax.lax.all_gather(a, seq_axes, axis=1, tiled=True) for a in (kv, pos, seg)),
                indices)

    if fetch == "all_gather":
        return gather(None)
    n, S = jax.lax.axis_size(seq_axes), kv.shape[1]
    need = jax.lax.all_gather(_need_row(indices, n, S).astype(jnp.int32), seq_axes)  # [n, n]
    need = jax.lax.pmax(need, mesh_axes) > 0  # every device of the mesh agrees
    distances = hop_distances(need)

    def hops(_):
        blocks = [(kv, pos, seg)]  # blocks[d]: shard (me - d) mod n's
        for d in range(1, n):
            axes, perm = ring_perm(seq_axes, d)
            blocks.append(jax.lax.cond(
                distances[d],
                lambda xs, axes=axes, perm=perm: tuple(jax.lax.ppermute(x, axes, perm)
                                                       for x in xs),
                lambda xs: tuple(jnp.zeros_like(x) for x in xs), blocks[0]))
        # one attention over the blocks side by side, indices renamed to them (attending
        # block by block and merging by log-sum-exp would gather all k slots per block)
        me = jax.lax.axis_index(seq_axes)
        owner = indices // S
        d_of = jnp.where(indices >= 0, (me - owner) % n * S + indices % S, -1)
        return (*(jnp.concatenate(parts, axis=1) for parts in zip(*blocks)), d_of)

    if fetch == "hops":
        return hops(None)
    return jax.lax.cond(choose_fetch(jnp.sum(distances[1:]), n), hops, gather, None)
