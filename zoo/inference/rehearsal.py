"""The scale rehearsal of one decode step: `rehearse_decode` compiles `zoo.inference`'s decode
step (a token per row against a donated KV cache) ahead of time for a mesh, as
`zoo.train.rehearse.rehearse` compiles a train step, into the same `Rehearsal`.

It builds the model as the training floor does (`zoo.train.rehearse.build_for_rehearsal`), so
this module sits on top of both floors and neither imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zoo.inference.cache import KVCache, constrain_cache
from zoo.inference.engine import decode_jit, inference_split
from zoo.train.rehearse import (Rehearsal, build_for_rehearsal, dtype_name, measure,
                                sharded_bytes)

__all__ = ["rehearse_decode"]


class _ShardingOf:
    """Stands in for a partitioner where code constrains arrays: ``constrain`` gives the
    `jax.ShapeDtypeStruct` with the sharding the constraint would impose, so the cache's
    shardings are read from `zoo.inference`'s own constraint rather than restated here."""

    def __init__(self, partitioner):
        self.partitioner = partitioner

    def constrain(self, x, logical_axes, scope=None):
        import jax
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=self.partitioner.sharding(logical_axes, scope))

    def __getattr__(self, name):
        return getattr(self.partitioner, name)


def _cache_abstract(model, partitioner, batch_size: int, context: int):
    """The decode cache of `context` slots as `jax.ShapeDtypeStruct`s on the shardings
    `zoo.inference` constrains it to (the slot counter, unconstrained there, replicated)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cache = constrain_cache(KVCache.shapes(model, batch_size, context), _ShardingOf(partitioner))
    replicated = NamedSharding(partitioner.mesh, P())
    return jax.tree.map(lambda x: x if x.sharding is not None else
                        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), cache)


def _check_decode(batch_size: Any, context: Any) -> None:
    for name, v in (("batch_size", batch_size), ("context", context)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"rehearse_decode: {name}={v!r} must be an int >= 1 (the cache "
                             f"holds batch_size rows of context slots)")


def rehearse_decode(model: str | Any, *, mesh: str | Mapping[str, int] | None = None,
                    strategy: str = "fsdp", batch_size: int, context: int,
                    dtype: Any = "bfloat16", param_dtype: Any = "bfloat16",
                    overrides: Mapping[str, Any] | Sequence[str] | None = None,
                    target: str = "cpu") -> Rehearsal:
    """One decode step (`zoo.inference.decode`: a token per row against a KV cache of `context`
    slots) compiled ahead of time for a mesh, as `rehearse` compiles a train step.

    The model is `rehearse`'s (`zoo.train.build`, abstract, the partitioner's parameter
    shardings); the cache is `zoo.inference.KVCache.shapes` in the compute dtype, sharded as
    `zoo.inference` constrains it (rows over the partitioner's batch axes, layers and slots
    whole) and donated, as `zoo.inference.Decoder` runs it; the tokens ``[batch_size]`` int32
    over the batch axes. The program is `zoo.inference`'s compiled decode step: the layers'
    unsharded code on the sharded parameters, MoE dropless, XLA partitioning from the
    arguments' shardings.

    Returns a `Rehearsal` with ``step="decode"``: ``seq_len`` is the cache's slots,
    ``param_bytes``/``cache_bytes`` the per-device shards from the shardings, arguments /
    temporaries / outputs / aliased (the donated cache) from XLA's memory analysis,
    ``model_flops`` the model's forward FLOPs for one token per row with every slot a key
    (``flops_per_token(context, causal=False) / 3``), per device.

    Args:
      model, mesh, strategy, overrides, target: as for `rehearse`.
      batch_size: rows decoded together; a multiple of the mesh's batch shards.
      context: the cache's slots per row (the prompt plus the tokens to generate); the model
        is built for prompts of this length (``inputs_shape=(batch_size, context)``, as
        prefill runs), so `build` checks both against the mesh before compiling.
      dtype: compute dtype, also the cache's.
      param_dtype: the parameters' dtype; bfloat16 by default, as served (no optimizer, no
        fp32 master weights).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    _check_decode(batch_size, context)
    label, built = build_for_rehearsal(model, mesh=mesh, strategy=strategy,
                                       batch_size=batch_size, seq_len=context, dtype=dtype,
                                       param_dtype=param_dtype, overrides=overrides,
                                       target=target)
    p = built.partitioner  # `build` refused a batch the batch shards do not divide
    abstract, _ = built.abstract_state()
    graphdef, state = inference_split(abstract, unsharded=True)
    cache = _cache_abstract(abstract, p, batch_size, context)
    tokens = jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=p.sharding(("batch",)))
    param_b, cache_b = sharded_bytes(nnx.state(abstract)), sharded_bytes(cache)
    cfg = built.model_config
    return measure(
        lambda: decode_jit.lower(state, cache, tokens, graphdef=graphdef, p=p), p,
        state_bytes=param_b + cache_b, label=label, mesh=built.config.mesh,
        strategy=p.strategy, batch_size=batch_size, seq_len=context,
        dtype=dtype_name(cfg.dtype), param_dtype=dtype_name(cfg.param_dtype), remat=None,
        param_bytes=param_b, optimizer_bytes=0, cache_bytes=cache_b, step="decode",
        model_flops=cfg.flops_per_token(context, causal=False) / 3 * batch_size
        / p.mesh.devices.size)

