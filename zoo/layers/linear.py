"""`Linear`: a projection with named (logical) axes on its kernel, sharded at creation.

Contracts the trailing ``len(in_features)`` dimensions of the input with a kernel of shape
``in_features + out_features``; multi-dimensional features let attention project straight to
``[..., heads, head_dim]`` without reshapes. Logical axes of the kernel are
``in_axes + out_axes`` and go to the partitioner.

``fp8="blockwise"`` runs the product as `zoo.ops.fp8.dot` (1x128 activation tiles, 128x128
weight blocks, an FP8 backward) on the flattened ``[..., prod(in)] @ [prod(in), prod(out)]``;
the kernel stays in ``param_dtype`` and is quantised where it is used, or once per step
(below). Each call then also
records what quantising its operands did (`record_fp8_stats`: an `Fp8Stats` the train step
pops into its ``fp8/`` metrics).

Weights quantised once per step: inside `prequantized_weights(model)` (the train step's
`zoo.train.step.loss_fn` enters it) every FP8 layer holds the FP8 copies of its weights
(`zoo.ops.fp8.prequantize`, as an `Fp8Copies` variable), made once before the forward pass,
and its products take those copies (a scanned stack slices them with its parameters; a
rematerialised layer takes them as inputs and never quantises again). Gradients reach the
parameters through the copies' ``w``. Any module with an ``fp8_weights()`` method takes part:
`Linear` for its kernel, `zoo.layers.MoE` for its routed experts' weights (read with
`prequantized`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import errors as flax_errors
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.layers import hf_keys as hfk
from zoo.ops import fp8 as fp8_ops
from zoo.partitioning import Partitioner, resolve

default_kernel_init = nnx.initializers.lecun_normal()


class Fp8Stats(nnx.Intermediate):
    """`zoo.ops.fp8.quantize_stats` counts (float32 ``[..., 4]``) of an FP8 layer's last
    forward pass, its operands' together; `zoo.train.step.loss_fn` pops and sums them."""


def record_fp8_stats(module: nnx.Module, *stats: jax.Array) -> None:
    """Set ``module.fp8_stats`` to the sum of `stats` (each `zoo.ops.fp8.quantize_stats`'
    ``[4]``): the counts of the module's last call (it overwrites, so a module called again,
    e.g. in decoding, holds one call's). A module that a jax transform closes over
    (``jax.jit(lambda x: layer(x))``) cannot take state set inside it: it records nothing."""
    try:
        module.fp8_stats = Fp8Stats(sum(stats[1:], stats[0]))
    except flax_errors.TraceContextError:
        pass


class Fp8Copies(nnx.Variable):
    """``{name: zoo.ops.fp8.QuantizedWeight}``: the FP8 copies of a module's weights for one
    forward pass, set by `prequantized_weights` and removed when it exits (never saved)."""


def prequantized(module: nnx.Module, name: str) -> fp8_ops.QuantizedWeight | None:
    """The FP8 copy of `module`'s weight `name` that `prequantized_weights` made, or None
    (outside it, or a weight it does not quantise)."""
    copies = getattr(module, "fp8_copies", None)
    return None if copies is None else copies.get_value().get(name)


@contextlib.contextmanager
def prequantized_weights(model: nnx.Module) -> Iterator[nnx.Module]:
    """Within: each module of `model` that has an ``fp8_weights()`` method (`Linear`,
    `zoo.layers.MoE`) holds
    what it returns, ``{weight name: zoo.ops.fp8.QuantizedWeight}``, as ``module.fp8_copies``
    (`prequantized` reads it): every FP8 weight is quantised once, here, instead of where
    each product uses it. Stacked layers quantise their whole stack (leading dims are batch
    dims). On exit the copies are removed. A model that a jax transform closes over cannot
    take state set inside it: it then holds no copies (each product quantises its weight)."""
    held = []
    try:
        for _, m in nnx.iter_modules(model):
            make = getattr(m, "fp8_weights", None)
            copies = make() if callable(make) else None
            if copies:
                m.fp8_copies = Fp8Copies(copies)
                held.append(m)
    except flax_errors.TraceContextError:
        pass
    try:
        yield model
    finally:
        for m in held:
            del m.fp8_copies


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
        fp8_ops.check_target(self.fp8, p.mesh)  # a TPU without FP8 units: warn, emulate
        self.partitioner, self.scope = p, scope  # FP8 on a mesh runs per shard (`fp8_specs`)
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
            kernel = prequantized(self, "kernel")  # the weight's copy: gathered, quantised
            kernel = self.kernel[...].astype(dtype) if kernel is None else kernel  # in dtype
            y = self.fp8_product(x.astype(dtype), kernel).astype(dtype)
            return y if self.bias is None else y + self.bias[...].astype(dtype)
        kernel = self.kernel[...].astype(dtype)
        y = jax.lax.dot_general(
            x.astype(dtype), kernel,
            ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y

    def fp8_product(self, x: jax.Array,
                    kernel: jax.Array | fp8_ops.QuantizedWeight) -> jax.Array:
        """float32 `zoo.ops.fp8.dot` of ``x [..., *in]`` and the kernel (or its FP8 copy,
        `fp8_weights`), ``[..., *out]``."""
        k, n = math.prod(self.in_features), math.prod(self.out_features)
        lead = x.shape[:x.ndim - len(self.in_features)]
        if not isinstance(kernel, fp8_ops.QuantizedWeight):
            kernel = kernel.reshape(k, n)
            w_stats = fp8_ops.quantize_stats(kernel, block=fp8_ops.WEIGHT_BLOCK)
        else:
            w_stats = kernel.stats
        record_fp8_stats(self, fp8_ops.quantize_stats(x.reshape(-1, k)), w_stats)
        specs = self.fp8_specs(lead)
        if specs is None:
            y = fp8_ops.dot(x.reshape(*lead, k), kernel)
        else:
            y = fp8_ops.sharded_dot(x.reshape(*lead, k), kernel, mesh=self.partitioner.mesh,
                                    x_spec=specs[0], w_spec=specs[1])
        return y.reshape(*lead, *self.out_features)

    def fp8_specs(self, lead: tuple[int, ...]) -> tuple[P, P] | None:
        """The specs `zoo.ops.fp8.sharded_dot` runs the FP8 product with on this layer's mesh:
        ``x [B, L, K]`` as ``("batch", "length")`` in the layer's scope and the kernel as
        ``[K, N]`` (its leading in- and out-dimension's mesh axes); None where the product runs
        as a plain `zoo.ops.fp8.dot` (no mesh or one device, inputs not ``[B, L, ...]``, a
        length or batch that does not split, a sharded inner kernel dimension, a kernel
        sharded over an axis the tokens are not: tensor parallelism). Left to XLA,
        the product's loops over 128-blocks slice sharded axes and all-gather whole operands
        in every iteration."""
        p = self.partitioner
        if p.mesh is None or p.mesh.size == 1 or len(lead) != 2:
            return None
        n_in = len(self.in_features)
        w = tuple(p.spec(self.in_axes + self.out_axes, self.scope))
        w += (None,) * (n_in + len(self.out_features) - len(w))
        if any(e is not None for e in w[1:n_in] + w[n_in + 1:]):
            return None
        x = tuple(p.spec(("batch", "length"), self.scope))
        x += (None,) * (2 - len(x))
        if any(dim % p.axis_size(e) for dim, e in zip(lead, x)):
            return None
        names = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
        if not {a for e in (w[0], w[n_in]) for a in names(e)} <= {a for e in x
                                                                   for a in names(e)}:
            return None  # a tensor-parallel kernel: its gathers would not be replicated
        return P(*x, None), P(w[0], w[n_in])

    def fp8_weights(self) -> dict[str, fp8_ops.QuantizedWeight]:
        """``{"kernel": prequantize(kernel as [*lead, K, N])}`` with FP8 (leading dims: a
        stack's layers; the kernel in the compute dtype, as the product takes it), else ``{}``
        (`prequantized_weights`)."""
        if self.fp8 != "blockwise":
            return {}
        kernel = self.kernel[...]
        if self.dtype is not None:  # as the product would cast it: gathered and its gradient
            kernel = kernel.astype(self.dtype)  # reduce-scattered in the compute dtype
        lead = kernel.shape[:kernel.ndim - len(self.in_features) - len(self.out_features)]
        k, n = math.prod(self.in_features), math.prod(self.out_features)
        return {"kernel": fp8_ops.prequantize(kernel.reshape(*lead, k, n))}

    def hf_keys(self, prefix: str) -> list[hfk.Tensor]:
        """``prefix.weight`` (``nn.Linear`` layout ``[out, in]``) and ``prefix.bias``."""
        rows = [hfk.linear(("kernel",), f"{prefix}.weight", in_ndim=len(self.in_features))]
        if self.bias is not None:
            rows.append(hfk.copy(("bias",), f"{prefix}.bias", flat=len(self.out_features) > 1))
        return rows
