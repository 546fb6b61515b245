"""`Embed`: token embedding with an `attend` that turns hidden states into logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zoo.layers import hf_keys as hfk
from zoo.partitioning import Partitioner, resolve


class Embed(nnx.Module):
    """Embedding table ``[vocab, embed]`` (logical axes ``("vocab", "embed")``).

    ``__call__(tokens [B, L]) -> [B, L, D]``; ``attend(x [B, L, D]) -> [B, L, V]`` computes
    ``x @ table.T`` (tied output head). Subclass and override `__call__` (calling ``super()``)
    for variants such as scaled embeddings.
    """

    def __init__(self, num_embeddings: int, features: int, *,
                 partitioner: Partitioner | None = None, dtype=None, param_dtype=jnp.float32,
                 embedding_init=nnx.initializers.normal(stddev=1.0), rngs: nnx.Rngs):
        self.num_embeddings, self.features = num_embeddings, features
        self.dtype = dtype
        self.partitioner = resolve(partitioner)
        self.embedding = nnx.Param(self.partitioner.param(embedding_init, ("vocab", "embed"))(
            rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"Embed expects integer token ids, got dtype {tokens.dtype}")
        # Cast first, so the all-gather below and the gathered rows are in the compute dtype
        # (bf16: half the bytes), never fp32 rows cast afterwards.
        table = self.embedding[...]
        if self.dtype is not None:
            table = table.astype(self.dtype)
        plan = self._local_lookup()
        if plan is None:
            # all-gather the table's embed dimension before the lookup: a gather from a table
            # sharded along the rows' own feature axis makes XLA replicate everything
            table = self.partitioner.constrain(table, ("vocab", None))
            x = jnp.take(table, tokens, axis=0)
        else:
            x = self._lookup_slices(table, tokens, *plan)
        return self.partitioner.constrain(x, ("batch", "length", "act_embed"))

    def _local_lookup(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """``(batch mesh axes, length mesh axes)`` when the table's embed dimension is sharded
        over exactly those axes in that order, only one of the two is sharded, and vocabulary
        and output features are not: the case `_lookup_slices` serves; None otherwise. (With
        both batch and length sharded, XLA moves the backward's rows into the table's feature
        sharding in one step, which it can only do by replicating them.)"""
        p = self.partitioner
        if p.mesh is None or isinstance(p.mesh, jax.sharding.AbstractMesh):
            return None
        sizes = dict(p.mesh.shape)

        def axes(entry) -> tuple[str, ...]:
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            return tuple(a for a in names if sizes[a] > 1)

        vocab, emb = (*p.spec(("vocab", "embed")), None, None)[:2]
        rows, cols, feats = (*p.spec(("batch", "length", "act_embed")), None, None, None)[:3]
        if (axes(vocab) or axes(feats) or not axes(emb) or (axes(rows) and axes(cols))
                or axes(emb) != axes(rows) + axes(cols)):
            return None
        return axes(rows), axes(cols)

    def _lookup_slices(self, table, tokens, rows: tuple[str, ...], cols: tuple[str, ...]):
        """Each device looks up its own slice of the feature axis for every token (the token
        ids, a few bytes each, are what is gathered), then an all-to-all moves the rows to
        the batch (or length) sharding. Gathering the table instead costs a whole [vocab,
        embed] copy per device and, backwards, a whole fp32 scatter-add target: 5 GiB at
        DeepSeek-V3's vocabulary, against [tokens, embed / devices] here."""
        mesh = self.partitioner.mesh

        def put(x, *spec):
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

        x = jnp.take(table, put(tokens, None, None), axis=0)
        x = put(x, None, None, rows + cols)
        return put(x, rows or None, cols or None, None)

    def attend(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        logits = jnp.einsum("bld,vd->blv", x.astype(dtype), self.embedding[...].astype(dtype))
        return self.partitioner.constrain(logits, ("batch", "length", "act_vocab"))

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return [hfk.copy(("embedding",), f"{prefix}.weight")]
