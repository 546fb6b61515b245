"""`Linear`: a projection with named (logical) axes on its kernel, sharded at creation.

Contracts the trailing ``len(in_features)`` dimensions of the input with a kernel of shape
``in_features + out_features``; multi-dimensional features let attention project straight to
``[..., heads, head_dim]`` without reshapes. Logical axes of the kernel are
``in_axes + out_axes`` and go to the partitioner.

``fp8="blockwise"`` runs the product as `zoo.ops.fp8.dot` (1x128 activation tiles, 128x128
weight blocks, an FP8 backward) on the flattened ``[..., prod(in)] @ [prod(in), prod(out)]``;
the kernel stays in ``param_dtype`` and is quantised where it is used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import hf_keys as hfk
from zoo.ops import fp8 as fp8_ops
from zoo.partitioning import Partitioner, resolve

default_kernel_init = nnx.initializers.lecun_normal()


def _tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return (int(x),) if isinstance(x, int) else tuple(int(v) for v in x)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with kernel ``[*in_features, *out_features]``.

    Args:
      in_features, out_features: int or tuple of ints.
      in_axes, out_axes: logical axis names of the kernel's input and output dimensions.
      partitioner: shards the kernel (None: unsharded); ``scope`` picks its override table.
      use_bias: add a bias of shape ``out_features`` (logical axes ``out_axes``).
      dtype: computation dtype (None: the input's); param_dtype: storage dtype.
      fp8: None/"off" or "blockwise" (see the module docstring; `zoo.ops.fp8.check_mode`).
    """

    def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
                 in_axes: Sequence[str | None], out_axes: Sequence[str | None],
                 partitioner: Partitioner | None = None, scope: str | None = None,
                 use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
                 kernel_init=default_kernel_init, bias_init=nnx.initializers.zeros_init(),
                 fp8: str | None = None, rngs: nnx.Rngs):
        self.fp8 = fp8_ops.check_mode(fp8, what="Linear(fp8=)")
        self.in_features = _tuple(in_features)
        self.out_features = _tuple(out_features)
        if len(in_axes) != len(self.in_features) or len(out_axes) != len(self.out_features):
            raise ValueError(f"in_axes {tuple(in_axes)} / out_axes {tuple(out_axes)} must name "
                             f"each of in_features {self.in_features} / out_features "
                             f"{self.out_features}")
        self.in_axes, self.out_axes = tuple(in_axes), tuple(out_axes)
        self.dtype, self.param_dtype = dtype, param_dtype
        p = resolve(partitioner)
        shape = self.in_features + self.out_features
        flat = (math.prod(self.in_features), math.prod(self.out_features))

        def init(key, shape, dtype):  # fan-in/fan-out scaled inits see the flattened kernel
            return kernel_init(key, flat, dtype).reshape(shape)

        self.kernel = nnx.Param(p.param(init, self.in_axes + self.out_axes, scope)(
            rngs.params(), shape, param_dtype))
        self.bias = (nnx.Param(p.param(bias_init, self.out_axes, scope)(
            rngs.params(), self.out_features, param_dtype)) if use_bias else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        n_in = len(self.in_features)
        if x.shape[x.ndim - n_in:] != self.in_features:
            raise ValueError(f"input trailing dims {x.shape[x.ndim - n_in:]} do not match "
                             f"in_features {self.in_features}")
        dtype = self.dtype or x.dtype
        if self.fp8 == "blockwise":
            y = self.fp8_product(x.astype(dtype), self.kernel[...]).astype(dtype)
            return y if self.bias is None else y + self.bias[...].astype(dtype)
        kernel = self.kernel[...].astype(dtype)
        y = jax.lax.dot_general(
            x.astype(dtype), kernel,
            ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y

    def fp8_product(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        """float32 `zoo.ops.fp8.dot` of ``x [..., *in]`` and the kernel, ``[..., *out]``."""
        k, n = math.prod(self.in_features), math.prod(self.out_features)
        lead = x.shape[:x.ndim - len(self.in_features)]
        y = fp8_ops.dot(x.reshape(*lead, k), kernel.reshape(k, n))
        return y.reshape(*lead, *self.out_features)

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """``prefix.weight`` (``nn.Linear`` layout ``[out, in]``) and ``prefix.bias``."""
        rows = [hfk.linear(("kernel",), f"{prefix}.weight", in_ndim=len(self.in_features))]
        if self.bias is not None:
            rows.append(hfk.copy(("bias",), f"{prefix}.bias", flat=len(self.out_features) > 1))
        return rows
