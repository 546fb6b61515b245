"""`Embed`: token embedding with an `attend` that turns hidden states into logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

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
        # Each device looks up its own slice of the feature axis for every token (the token
        # ids, a few bytes each, are what is gathered), then one all-to-all moves the rows to
        # the batch sharding. Gathering the table instead costs a whole [vocab, embed] copy per
        # device and, backwards, a whole fp32 scatter-add target: 5 GiB at DeepSeek-V3's
        # vocabulary, against [tokens, embed / devices] here.
        tokens = self.partitioner.constrain(tokens, (None, None))
        x = jnp.take(table, tokens, axis=0)
        x = self.partitioner.constrain(x, (None, None, "embed"))
        return self.partitioner.constrain(x, ("batch", "length", "act_embed"))

    def attend(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        logits = jnp.einsum("bld,vd->blv", x.astype(dtype), self.embedding[...].astype(dtype))
        return self.partitioner.constrain(logits, ("batch", "length", "act_vocab"))

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return [hfk.copy(("embedding",), f"{prefix}.weight")]
