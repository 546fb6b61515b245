"""`SharedExpertMoE`: an `MoE` plus one shared expert scaled by a learned sigmoid gate.

``y = moe(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``: the sparse block of
Qwen2-MoE, Qwen3-Next and Qwen3.5 (``shared_expert_gate``: ``Linear(D, 1)``, one gate value per
token). A composition: the routed experts are any `MoE` (``moe_cls``) built with the
remaining keyword arguments, so every execution option of `MoE` applies.

Hugging Face names: the `MoE`'s own under the same prefix (router ``gate``, experts
``experts.{e}.*``), ``shared_expert.{gate,up,down}_proj``, ``shared_expert_gate``.

Legend: B batch, L length, D embed, F the shared expert's width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.layers.linear import Linear
from zoo.layers.mlp import MLP
from zoo.layers.moe import MoE
from zoo.partitioning import Partitioner, resolve

ACT = ("batch", "length", "act_embed")


class SharedExpertMoE(nnx.Module):
    """Routed experts (``moe``) + a sigmoid-gated shared SwiGLU expert; see the module docstring.

    Args:
      shared_mlp_dim: F, the shared expert's width (``shared_expert_intermediate_size``).
      inputs_shape, partitioner, dtype, param_dtype, fp8, rngs: as `MoE`'s (and passed to it).
      moe_cls: the routed experts' class (default `MoE`); ``**moe_kwargs``: its other
        arguments (``num_experts``, ``num_experts_per_tok``, ``mlp_dim``, ``scoring`` ...).

    ``y, aux = layer(x)`` with the `MoE`'s aux dict.
    """

    def __init__(self, *, shared_mlp_dim: int, inputs_shape: Sequence[int],
                 partitioner: Partitioner | None, dtype=jnp.float32, param_dtype=jnp.float32,
                 fp8: str | None = None, moe_cls: type[MoE] = MoE, rngs: nnx.Rngs,
                 **moe_kwargs):
        if isinstance(shared_mlp_dim, bool) or not isinstance(shared_mlp_dim, int) or \
                shared_mlp_dim < 1:
            raise ValueError(f"SharedExpertMoE: shared_mlp_dim={shared_mlp_dim!r} must be a "
                             f"positive int (shared_expert_intermediate_size)")
        p = resolve(partitioner)
        self.partitioner = p
        self.moe = moe_cls(inputs_shape=inputs_shape, partitioner=p, dtype=dtype,
                           param_dtype=param_dtype, fp8=fp8, rngs=rngs, **moe_kwargs)
        D = self.moe.embed_dim
        self.embed_dim = D
        # dense: default scope, so the tokens stay sharded over `expert` too (as MoE's shared)
        self.shared_expert = MLP(embed_dim=D, mlp_dim=shared_mlp_dim, partitioner=p,
                                 dtype=dtype, param_dtype=param_dtype, fp8=fp8, rngs=rngs)
        self.shared_expert_gate = Linear(D, 1, in_axes=("embed",), out_axes=(None,),
                                         partitioner=p, dtype=dtype, param_dtype=param_dtype,
                                         rngs=rngs)

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts

    def shared(self, x: jax.Array) -> jax.Array:
        """``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` [B, L, D]."""
        return jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        y, aux = self.moe(x)
        with jax.named_scope("shared_expert"):
            s = self.shared(x)
        return self.partitioner.constrain(y + s.astype(y.dtype), ACT), aux

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        rows = [dataclasses.replace(r, path=("moe", *r.path))
                for r in hfk.keys_of(self.moe, prefix)]
        return rows + hfk.children(self, prefix, ("shared_expert", "shared_expert_gate"))
