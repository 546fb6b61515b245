"""DeepSeek-V4's compression: every ``rate`` tokens of a document become one entry.

* `Compressor` (Hugging Face ``DeepseekV4Attention.compressor``): ``kv_proj`` / ``gate_proj``
  per token, a softmax-gated mix per channel over each window (with ``position_bias``), CSA's
  overlapping windows of ``2*rate`` (stride ``rate``) or HCA's of ``rate``, ``kv_norm`` and
  RoPE at the window's first position. Windows follow each document from its first token
  (positions and segment ids; `zoo.ops.compressed_attention`), never mix two documents, and
  padding never enters one. For generation it keeps a state: the entries written as windows
  close, the open window's projections and CSA's carried overlap (`state_shape`,
  `prefill_state`, `decode_state`).
* `CompressedIndexer`: CSA's lightning indexer, `zoo.layers.Indexer`'s scoring and top-k over
  its own `Compressor`'s entries.
* `rotate_trailing`, `v4_rope`: V4's RoPE on the trailing dims of a head (interleaved pairs);
  `left_aligned`: left-padded prompts shifted to start at column 0.

`zoo.layers.compressed_attention.CompressedAttention` attends to these entries (CSA, HCA)
beside its sliding window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.layers.indexer import Indexer
from zoo.layers.linear import Linear
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import RoPE
from zoo.ops import compressed_attention as ca
from zoo.ops.masks import Causal, Document
from zoo.partitioning import Partitioner, resolve

__all__ = ["F32", "SCOPE", "CompressedIndexer", "Compressor", "check_positive", "left_aligned",
           "rotate_trailing", "v4_rope"]

SCOPE = "attention"
F32 = jnp.float32


def rotate_trailing(rope: RoPE, x: jax.Array, positions: jax.Array, rope_head_dim: int,
                    *, inverse: bool = False) -> jax.Array:
    """RoPE (interleaved pairs) on the trailing ``rope_head_dim`` dims of ``x [B, L, N, H]``;
    ``inverse``: the conjugate rotation (angle ``-positions``)."""
    r = rope_head_dim
    pos = -positions if inverse else positions
    return jnp.concatenate([x[..., :-r], rope.apply(x[..., -r:], pos)], axis=-1)


def v4_rope(rope: RoPE | None) -> RoPE:
    base = RoPE(theta=10000.0) if rope is None else rope
    return dataclasses.replace(base, interleaved=True, partial_rotary_factor=1.0)


def check_positive(what: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what}: {name}={value!r} must be a positive int")


def left_aligned(x: jax.Array, segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Left-padded rows ``x [B, P, ...]`` (padding where ``segment_ids [B, P]`` is 0, before
    the tokens; None: none) shifted left so each row's tokens start at column 0 -> (shifted x,
    each row's token count ``[B, 1]``). Columns past a row's count repeat its last token."""
    B, P = x.shape[:2]
    if segment_ids is None:
        return x, jnp.full((B, 1), P, jnp.int32)
    n = jnp.sum(segment_ids != 0, axis=1, keepdims=True).astype(jnp.int32)
    cols = jnp.minimum(jnp.arange(P) + (P - n), P - 1)  # [B, P]
    return jnp.take_along_axis(x, cols.reshape(B, P, *(1,) * (x.ndim - 2)), axis=1), n


class Compressor(nnx.Module):
    """Compresses every ``rate`` tokens of a document into one entry (module docstring;
    `zoo.ops.compressed_attention`): ``kv_proj`` / ``gate_proj`` D -> cH, ``position_bias``
    [rate, cH], the gated mix per channel, ``kv_norm`` (RMSNorm over H), RoPE at the window's
    first position. ``overlap`` (CSA): c = 2, windows of ``2*rate`` with stride ``rate``; else
    c = 1 (HCA). ``indexer``: CSA's `CompressedIndexer`, a submodule here as in transformers.

    ``compressor(x, positions=..., segment_ids=...)`` -> (entries [B, E, H], entry_start [B, E],
    entry_segment_ids [B, E]) of whole rows.
    """

    def __init__(self, *, rate: int, head_dim: int, rope_head_dim: int, overlap: bool,
                 inputs_shape: Sequence[int], partitioner: Partitioner | None,
                 rope: RoPE | None = None, rms_norm_eps: float = 1e-6,
                 indexer: CompressedIndexer | None = None, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        p = resolve(partitioner)
        check_positive("Compressor", rate=rate, head_dim=head_dim)
        if not isinstance(rope_head_dim, int) or rope_head_dim < 2 or rope_head_dim % 2 \
                or rope_head_dim > head_dim:
            raise ValueError(f"Compressor: rope_head_dim={rope_head_dim!r} must be an even int "
                             f"in 2..head_dim={head_dim} (RoPE rotates pairs of trailing dims)")
        _, _, embed = p.check_inputs_shape(inputs_shape, what="Compressor")
        self.rate, self.head_dim, self.rope_head_dim = rate, head_dim, rope_head_dim
        self.overlap = bool(overlap)
        self.rope = v4_rope(rope)
        width = (2 if self.overlap else 1) * head_dim
        kw = dict(partitioner=p, scope=SCOPE, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.kv_proj = Linear(embed, width, in_axes=("embed",), out_axes=(None,), **kw)
        self.gate_proj = Linear(embed, width, in_axes=("embed",), out_axes=(None,), **kw)
        self.position_bias = nnx.Param(p.param(nnx.initializers.zeros_init(), (None, None))(
            rngs.params(), (rate, width), jnp.float32))
        self.kv_norm = RMSNorm(head_dim, eps=rms_norm_eps, partitioner=p,
                               param_dtype=param_dtype, rngs=rngs)
        self.indexer = indexer

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, L, D] -> (kv, gate) [B, L, cH] per token."""
        return self.kv_proj(x), self.gate_proj(x)

    def pool(self, kv, gate, positions, slots, next_slots, *, bias, num_entries, axes=()):
        """`zoo.ops.compressed_attention.compress` with this compressor's overlap."""
        return ca.compress(kv, gate, bias, positions, slots,
                           next_slots if self.overlap else None, num_entries=num_entries,
                           axes=axes)

    def finish(self, pooled: jax.Array, entry_start: jax.Array, norm_scale: jax.Array,
               dtype) -> jax.Array:
        """``kv_norm`` (with ``norm_scale``, its weight) and RoPE at each entry's first
        position: pooled [B, E, H] float32 -> entries [B, E, H] in ``dtype``."""
        y = (norm_scale.astype(F32) * self.kv_norm.normalise(pooled)).astype(dtype)
        return rotate_trailing(self.rope, y[:, :, None], entry_start, self.rope_head_dim)[:, :, 0]

    def __call__(self, x: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None):
        return self.compress(*self.project(x), positions=positions, segment_ids=segment_ids)

    def compress(self, kv: jax.Array, gate: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None):
        """`__call__` from the tokens' projections (`project`): (entries, entry_start,
        entry_segment_ids)."""
        B, L = kv.shape[:2]
        seg = jnp.ones((B, L), jnp.int32) if segment_ids is None else segment_ids
        table = ca.window_table(positions, seg, self.rate)
        slots, nxt = ca.window_slots(table, positions, seg, self.rate)
        pooled = self.pool(kv, gate, positions, slots, nxt, bias=self.position_bias[...],
                           num_entries=L // self.rate)
        entries = self.finish(pooled, table.entry_start, self.kv_norm.scale[...], kv.dtype)
        return entries, table.entry_start, table.entry_segment_ids

    # -- generation: the compressor's state (one document per row, from position 0) ----------
    # ``entries`` [B, E, H] (E = max_length // rate: slot e holds window e once complete),
    # ``buffer_kv`` / ``buffer_gate`` [B, rate, cH] (the open window's tokens at slot
    # ``position % rate``, gates with their position bias, float32) and, with overlap, the last
    # complete window's ``Ca`` half ``prev_kv`` / ``prev_gate`` [B, rate, H] (gate -inf: none)
    def state_shape(self, batch: int, max_length: int) -> dict[str, tuple[int, ...]]:
        m, H = self.rate, self.head_dim
        c = (2 if self.overlap else 1) * H
        shapes = {"entries": (batch, max_length // m, H), "buffer_kv": (batch, m, c),
                  "buffer_gate": (batch, m, c)}
        if self.overlap:
            shapes |= {"prev_kv": (batch, m, H), "prev_gate": (batch, m, H)}
        return shapes

    def prefill_state(self, x: jax.Array, max_length: int,
                      segment_ids: jax.Array | None = None) -> dict[str, jax.Array]:
        """The state after each row's prompt: ``x [B, P, D]``, left-padded where
        ``segment_ids`` is 0 (None: no padding), the prompt's tokens at positions 0, 1, ...
        Each row is first shifted left by its padding (`left_aligned`), so its windows start
        at its first token whatever the padding."""
        B, P, _ = x.shape
        m, H = self.rate, self.head_dim
        shapes = self.state_shape(B, max_length)
        x, n_tokens = left_aligned(x, segment_ids)
        j = jnp.arange(P, dtype=jnp.int32)
        pos = jnp.broadcast_to(j, (B, P))
        kv, gate = self.project(x)
        entries, _, _ = self.compress(kv, gate, positions=pos,
                                      segment_ids=(j < n_tokens).astype(jnp.int32))
        complete = (j[:P // m, None] + 1) * m <= n_tokens[:, :, None]  # [B, E, 1]
        entries = jnp.where(complete, entries, 0)
        g = gate.astype(F32) + jnp.take(self.position_bias[...], pos % m, axis=0)
        n = n_tokens[:, 0] // m  # each row's complete windows
        window = lambda a, first: jnp.take_along_axis(  # tokens first .. first + m - 1
            a, jnp.clip(first[:, None] + jnp.arange(m), 0, P - 1)[:, :, None], axis=1)
        state = {"entries": jnp.zeros(shapes["entries"], kv.dtype).at[:, :P // m].set(entries),
                 "buffer_kv": window(kv, n * m), "buffer_gate": window(g, n * m)}
        if self.overlap:
            none = (n == 0)[:, None, None]
            state["prev_kv"] = jnp.where(none, 0, window(kv, (n - 1) * m)[..., :H])
            state["prev_gate"] = jnp.where(none, -jnp.inf, window(g, (n - 1) * m)[..., :H])
        return state

    def decode_state(self, state: dict[str, jax.Array], x: jax.Array,
                     positions: jax.Array) -> dict[str, jax.Array]:
        """The state after one more token per row: ``x [B, 1, D]`` at ``positions [B, 1]``; a
        token that closes its window writes the window's entry."""
        m, H = self.rate, self.head_dim
        t = positions[:, 0].astype(jnp.int32)
        rows = jnp.arange(x.shape[0])
        kv, gate = self.project(x)
        g = gate[:, 0].astype(F32) + jnp.take(self.position_bias[...], t % m, axis=0)
        buf_kv = state["buffer_kv"].at[rows, t % m].set(kv[:, 0].astype(state["buffer_kv"].dtype))
        buf_g = state["buffer_gate"].at[rows, t % m].set(g)
        if self.overlap:
            pooled = ca.pool_window(buf_kv[..., H:], buf_g[..., H:], state["prev_kv"],
                                    state["prev_gate"])
        else:
            pooled = ca.pool_window(buf_kv, buf_g)
        start = (t // m) * m
        entry = self.finish(pooled[:, None], start[:, None], self.kv_norm.scale[...],
                            state["entries"].dtype)[:, 0]
        closes = t % m == m - 1
        E = state["entries"].shape[1]
        out = dict(state, buffer_kv=buf_kv, buffer_gate=buf_g)
        out["entries"] = state["entries"].at[rows, jnp.where(closes, t // m, E)].set(
            entry, mode="drop")
        if self.overlap:
            c = closes[:, None, None]
            out["prev_kv"] = jnp.where(c, buf_kv[..., :H], state["prev_kv"])
            out["prev_gate"] = jnp.where(c, buf_g[..., :H], state["prev_gate"])
        return out

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm`` (+ ``indexer.*``)."""
        bias = hfk.copy(("position_bias",), hfk.join(prefix, "position_bias"))
        return [*hfk.children(self, prefix, ("kv_proj", "gate_proj")), bias,
                *hfk.children(self, prefix, ("kv_norm", "indexer"))]


class CompressedIndexer(Indexer):
    """DeepSeek-V4's lightning indexer: `zoo.layers.Indexer`'s scoring and top-k (the same
    ``sum_n w_n * relu(Hi**-0.5 * q_n . k)`` and tie rule) over *compressed* keys.

    Where it differs from DeepSeek-V3.2's (which `Indexer` keeps exactly): the keys are its own
    CSA `Compressor`'s entries at ``head_dim`` (``kv_proj``, ``gate_proj``, ``position_bias``,
    ``kv_norm``: Hugging Face keys directly under ``indexer``), not one key per token; queries
    ``q_b_proj`` Rq -> (Ni, Hi) rotate their trailing ``rope_head_dim`` dims (interleaved, the
    compressed branches' RoPE) with no norm; the head weights are ``scorer.weights_proj``. A
    query sees an entry of its document once the entry's window is complete.

    ``indexer(x, q_latent, positions=..., segment_ids=...)`` -> scores [B, L, E];
    ``select(...)`` -> indices [B, L, min(k, E)] into the row's entries (unsharded;
    `CompressedAttention` selects under context parallelism).
    """

    hf_names: ClassVar[dict[str, str]] = {"weights_proj": "scorer.weights_proj"}

    def __init__(self, *, num_heads: int, head_dim: int, rope_head_dim: int, q_lora_rank: int,
                 rate: int, inputs_shape: Sequence[int], partitioner: Partitioner | None,
                 rope: RoPE | None = None, rms_norm_eps: float = 1e-6, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        p = resolve(partitioner)
        check_positive("CompressedIndexer", num_heads=num_heads, head_dim=head_dim,
                        q_lora_rank=q_lora_rank)
        _, _, embed = p.check_inputs_shape(inputs_shape, what="CompressedIndexer")
        self.num_heads, self.head_dim, self.rope_head_dim = num_heads, head_dim, rope_head_dim
        self.q_lora_rank, self.rate = q_lora_rank, rate
        self.inputs_shape = tuple(inputs_shape)
        self.partitioner = p
        self.rope = v4_rope(rope)
        self.mask = Causal() & Document()
        self.softmax_scale = head_dim ** -0.5
        kw = dict(partitioner=p, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.compressor = Compressor(rate=rate, head_dim=head_dim, rope_head_dim=rope_head_dim,
                                     overlap=True, inputs_shape=inputs_shape, rope=rope,
                                     rms_norm_eps=rms_norm_eps, **kw)
        self.q_b_proj = Linear(q_lora_rank, (num_heads, head_dim), in_axes=("q_lora",),
                               out_axes=(None, None), **kw)
        self.weights_proj = Linear(embed, num_heads, in_axes=("embed",), out_axes=(None,),
                                   **{**kw, "dtype": jnp.float32})

    def rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return rotate_trailing(self.rope, x, positions, self.rope_head_dim)

    def queries(self, x: jax.Array, q_latent: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, L, D], q_latent [B, L, Rq] -> rotated q [B, L, Ni, Hi], float32 weights
        [B, L, Ni]."""
        q = self.rotate(self.q_b_proj(q_latent), positions)
        return q, self.weights_proj(x).astype(F32) * self.num_heads ** -0.5

    def keys(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None):
        """The row's compressed index keys: (entries [B, E, Hi], entry_start, entry_segment_ids)."""
        return self.compressor(x, positions=positions, segment_ids=segment_ids)

    def entry_last(self, entry_start: jax.Array, entry_segment_ids: jax.Array) -> jax.Array:
        """[B, E] the position of each entry's last token (0 for an unused slot): a query sees
        the entry from there on (`Indexer.score`'s causal mask on these key positions)."""
        return jnp.where(entry_segment_ids > 0, entry_start + self.rate - 1, 0)

    def entry_scores(self, q, w, entries, entry_start, entry_segment_ids, *, positions,
                     segment_ids):
        """Scores [B, L, E] of queries against entries, ``-inf`` where not visible."""
        return self.score(q, w, entries, q_positions=positions,
                          kv_positions=self.entry_last(entry_start, entry_segment_ids),
                          q_segment_ids=segment_ids, kv_segment_ids=entry_segment_ids)

    def select_entries(self, q, w, entries, entry_start, entry_segment_ids, k: int, *,
                       positions, segment_ids, query_chunk: int | str | None = "auto",
                       key_block: int | str = "auto") -> jax.Array:
        """``topk(entry_scores(...), k, entry_start)`` -- the same indices [B, L, min(k, E)]
        -- in bounded memory, through `Indexer.select_keys` (queries in chunks, entries in
        blocks, blocks no query of a chunk sees not scored); under ``stop_gradient``."""
        return jax.lax.stop_gradient(self.select_keys(
            q, w, entries, k, q_positions=positions,
            kv_positions=self.entry_last(entry_start, entry_segment_ids),
            q_segment_ids=segment_ids, kv_segment_ids=entry_segment_ids,
            query_chunk=query_chunk, key_block=key_block))

    def __call__(self, x: jax.Array, q_latent: jax.Array, *, positions: jax.Array,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        seg = jnp.ones(positions.shape, jnp.int32) if segment_ids is None else segment_ids
        with jax.named_scope("compressed_indexer"):
            q, w = self.queries(x, q_latent, positions)
            entries, start, eseg = self.keys(x, positions, seg)
            return self.entry_scores(q, w, entries, start, eseg, positions=positions,
                                     segment_ids=seg)

    def select(self, x: jax.Array, q_latent: jax.Array, k: int, *, positions: jax.Array,
               segment_ids: jax.Array | None = None) -> jax.Array:
        """Each query's top ``k`` entries: int32 indices [B, L, min(k, E)] (``-1`` empty),
        under ``stop_gradient``; ties: the later entry first."""
        x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
        seg = jnp.ones(positions.shape, jnp.int32) if segment_ids is None else segment_ids
        with jax.named_scope("compressed_indexer"):
            q, w = self.queries(x, q_latent, positions)
            entries, start, eseg = self.keys(x, positions, seg)
            return self.select_entries(q, w, entries, start, eseg, k, positions=positions,
                                       segment_ids=seg)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """The compressor's keys directly under ``prefix``, ``q_b_proj``,
        ``scorer.weights_proj``."""
        return ([dataclasses.replace(r, path=("compressor", *r.path))
                 for r in self.compressor.hf_keys(prefix)]
                + hfk.children(self, prefix, ("q_b_proj", "weights_proj")))
