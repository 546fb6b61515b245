"""`MLP`: the gated (SwiGLU) feed-forward block of Llama, Mixtral and DeepSeek.

``down(silu(gate(x)) * up(x))``; with ``limit`` (DeepSeek-V4's ``swiglu_limit``) the gate is
clamped to ``<= limit`` and ``up`` to ``[-limit, limit]`` first.

Legend: B batch, L length, D embed, F mlp.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.layers.linear import Linear, default_kernel_init
from zoo.partitioning import Partitioner, resolve


class MLP(nnx.Module):
    """SwiGLU MLP with kernels ``gate``/``up`` ``[D, F]`` and ``down`` ``[F, D]``.

    Override `activation` in a subclass to change the non-linearity. Hugging Face names:
    ``gate_proj``/``up_proj``/``down_proj`` (``hf_names``). ``fp8="blockwise"``: the three
    products in blockwise-scaled FP8 (`zoo.layers.Linear`). ``limit``: the clamp before the
    activation (None: none).
    """

    hf_names: ClassVar[dict[str, str]] = {"gate": "gate_proj", "up": "up_proj",
                                          "down": "down_proj"}

    def __init__(self, *, embed_dim: int, mlp_dim: int, partitioner: Partitioner | None = None,
                 scope: str | None = None, dtype=None, param_dtype=jnp.float32,
                 kernel_init=default_kernel_init, fp8: str | None = None,
                 limit: float | None = None, rngs: nnx.Rngs):
        if limit is not None and not limit > 0:
            raise ValueError(f"MLP: limit={limit!r} must be > 0 (the SwiGLU clamp bound, "
                             f"DeepSeek-V4: 10.0) or None")
        self.embed_dim, self.mlp_dim, self.limit = embed_dim, mlp_dim, limit
        self.partitioner, self.scope = resolve(partitioner), scope
        kw = dict(partitioner=partitioner, scope=scope, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=kernel_init, fp8=fp8, rngs=rngs)
        self.gate = Linear(embed_dim, mlp_dim, in_axes=("embed",), out_axes=("mlp",), **kw)
        self.up = Linear(embed_dim, mlp_dim, in_axes=("embed",), out_axes=("mlp",), **kw)
        self.down = Linear(mlp_dim, embed_dim, in_axes=("mlp",), out_axes=("embed",), **kw)

    def activation(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("mlp"):
            gate, up = self.gate(x), self.up(x)
            if self.limit is not None:
                gate = jnp.minimum(gate, self.limit)
                up = jnp.clip(up, -self.limit, self.limit)
            h = self.activation(gate) * up
            if x.ndim == 3:  # [B, L, D] activations; other ranks (e.g. inside shard_map) as-is
                h = self.partitioner.constrain(h, ("batch", "length", "act_mlp"), self.scope)
            y = self.down(h)
            if x.ndim == 3:
                y = self.partitioner.constrain(y, ("batch", "length", "act_embed"), self.scope)
            return y

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        return hfk.children(self, prefix, ("gate", "up", "down"))
