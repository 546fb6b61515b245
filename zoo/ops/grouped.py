"""The experts' grouped products: a gated MLP (`GLU`) over rows sorted by expert.

No parameters and no mesh; the dispatch schemes (`zoo.ops.moe`, `zoo.ops.moe_rounds`) call
`grouped_swiglu` on the rows each device holds.

* `grouped_swiglu` -- the experts' SwiGLU on rows sorted by expert. What runs where:
  ``"auto"`` picks, when the program is lowered (`jax.lax.platform_dependent`), the blocked
  grouped matmul on CPU (`blocked_matmul`: each expert's rows padded to blocks, a loop of
  dense block matmuls that slices each block's weight in place and skips empty blocks; HLO
  FLOPs within 1.25x of the useful ones once groups average 32 rows) and XLA's ragged dot on
  TPU, ``tokamax.ragged_dot`` on GPU (`tokamax_dot`: Mosaic GPU / Triton kernels, traced for
  the mesh's target device). ``jax.lax.ragged_dot`` stays selectable everywhere: XLA (GPU and
  CPU) expands it into a dense masked matmul over every local expert, ``E_local`` times the
  useful FLOPs; ``"fp8_blockwise"`` runs `zoo.ops.fp8.ragged_dot`. The products run inside the
  ``grouped_matmul`` named scope (profiles and HLO read the experts' matmuls by it).
* `blocked_matmul` -- the block-diagonal grouped matmul, with a loop-only VJP; `block_size` --
  its rows per block.
* `tokamax_dot` -- ``tokamax.ragged_dot``, traced for a target device when that is not the
  process's default platform.
* `GLU` -- the experts' gated activation (a value): ``silu(gate) * up`` by default
  (`SWIGLU`); gpt-oss's clamped form ``GLU(alpha=1.702, limit=7.0, up_offset=1.0)``. The
  expert functions take it as ``activation=`` and optional per-expert ``bias=(gate_bias,
  up_bias)`` ``[E_local, F]`` added before it (gpt-oss); the defaults keep the plain SwiGLU.

Rows move with `zoo.ops.rows.take_rows` (gradients that are gathers). Legend: R rows, D
embed, F mlp, E_local experts on this device, K x N one product's weight.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from zoo.ops import fp8
from zoo.ops.moe_execution import GROUPED_MATMULS
from zoo.ops.rows import as_varying, inverse_permutation, mark_varying, take_rows, varying_axes


@dataclasses.dataclass(frozen=True)
class GLU:
    """``(gate * sigmoid(alpha * gate)) * (up + up_offset)``, with ``gate <= limit`` and ``up``
    in ``[-limit, limit]`` first when `limit` is set. ``GLU()`` is SwiGLU (``silu(gate) * up``);
    gpt-oss: ``GLU(alpha=1.702, limit=7.0, up_offset=1.0)``."""

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    def __post_init__(self):
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"GLU: limit={self.limit!r} must be > 0 (the clamp bound) or None")

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self == SWIGLU:
            return jax.nn.silu(gate) * up
        if self.limit is not None:
            gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
        return gate * jax.nn.sigmoid(self.alpha * gate) * (up + self.up_offset)


SWIGLU = GLU()


def _row_experts(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The local expert of each of `rows` rows sorted by expert (rows past the groups: the
    last expert; callers mask them)."""
    return jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right"),
                       group_sizes.shape[0] - 1)


def block_size(rows: int, num_local: int) -> int:
    """Rows per block of the blocked grouped matmul for about `rows` real rows: the largest
    power of two within 8..128 that is at most a quarter of the mean group size, so padding
    (at most ``E_local * (block - 1)`` rows) stays within 25% of the useful work whenever the
    mean group has 32 rows or more."""
    quarter = max(1.0, rows / max(1, num_local) / 4)
    return int(min(128, max(8, 2 ** math.floor(math.log2(quarter)))))


def _block_mm(x: jax.Array, w: jax.Array, experts: jax.Array, active: jax.Array) -> jax.Array:
    """``x [n, b, K]`` block n times ``w[experts[n]] [K, N]`` -> ``[n, b, N]``; inactive
    blocks give zeros and cost nothing (a `lax.cond` inside a loop). The weight of each block
    is sliced inside the loop, never gathered into an ``[n, K, N]`` temporary."""
    zeros = mark_varying(jnp.zeros((x.shape[1], w.shape[-1]), jnp.result_type(x, w)),
                  varying_axes(x) | varying_axes(w))

    def one(args):
        xb, e, on = args
        return jax.lax.cond(on, lambda: xb @ jax.lax.dynamic_index_in_dim(w, e, 0, False),
                            lambda: zeros)
    return jax.lax.map(one, (x, experts, active))


@jax.custom_vjp
def blocked_matmul(x, w, experts, active):
    """Block-diagonal grouped matmul ``[n, b, K] x [E, K, N] -> [n, b, N]`` (each block of
    rows belongs to one expert), differentiable with loops only: the gradient wrt ``x`` is the
    same loop against ``w^T``, the gradient wrt ``w`` accumulates ``x_n^T dy_n`` into
    ``dw[experts[n]]`` (one ``[E, K, N]`` carry)."""
    return _block_mm(x, w, experts, active)


def _blocked_fwd(x, w, experts, active):
    return _block_mm(x, w, experts, active), (x, w, experts, active)


def _blocked_bwd(res, dy):
    x, w, experts, active = res
    dx = _block_mm(dy, jnp.swapaxes(w, 1, 2), experts, active)
    # dw: an expert's blocks are contiguous, so one float32 [K, N] accumulator runs over them
    # and is written into dw (w's dtype) once per expert -- exact float32 sums without a
    # float32 copy of all the local experts' weights
    vary = lambda v: mark_varying(v, varying_axes(w))

    def flush(dw, acc, e):
        return jax.lax.dynamic_update_index_in_dim(dw, acc.astype(dw.dtype), e, 0)

    def step(n, carry):
        def add(carry):
            dw, acc, cur = carry
            e = experts[n]
            dw, acc = jax.lax.cond(e != cur, lambda: (flush(dw, acc, cur), jnp.zeros_like(acc)),
                                   lambda: (dw, acc))
            g = jnp.dot(x[n].T, dy[n], preferred_element_type=jnp.float32)  # bf16 in, f32 sum
            return dw, acc + g, e
        return jax.lax.cond(active[n], add, lambda c: c, carry)
    init = (vary(jnp.zeros(w.shape, w.dtype)), vary(jnp.zeros(w.shape[1:], jnp.float32)),
            vary(experts[0]))
    dw, acc, cur = jax.lax.fori_loop(0, x.shape[0], step, init)
    dw = flush(dw, acc, cur)
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)
    return dx, dw, zero(experts), zero(active)


blocked_matmul.defvjp(_blocked_fwd, _blocked_bwd)


def _blocked_swiglu(x: jax.Array, wi_gate: jax.Array, wi_up: jax.Array, wo: jax.Array,
                    group_sizes: jax.Array, block: int, order: jax.Array | None = None,
                    activation: GLU = SWIGLU, bias=None) -> jax.Array:
    """Grouped SwiGLU for XLA:CPU: each expert's rows padded to a multiple of `block`, then
    `blocked_matmul` over the blocks that hold rows (the rest are skipped at run time).

    Static sizes: ``blocks = ceil((R + E_local * (block - 1)) / block)`` for an ``R``-row
    buffer, so the program's FLOPs are at most ``1 + E_local * block / R`` times the useful
    work when the buffer is full; rows past ``sum(group_sizes)`` cost nothing.
    """
    rows = x.shape[0]
    num_local = wi_gate.shape[0]
    blocks = -(-(rows + num_local * (block - 1)) // block)
    starts = jnp.cumsum(group_sizes) - group_sizes
    padded = -(-group_sizes // block) * block
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    q = jnp.arange(blocks * block)  # padded row -> (expert, offset) -> sorted row
    expert = jnp.minimum(jnp.searchsorted(padded_ends, q, side="right"), num_local - 1)
    offset = q - padded_starts[expert]
    src = jnp.clip(starts[expert] + offset, 0, rows - 1)
    if order is not None:  # x is unsorted: one gather straight into the padded layout
        src = order[src]
    xp = jnp.where((offset < group_sizes[expert])[:, None], x[src], 0).reshape(blocks, block, -1)
    be = expert.reshape(blocks, block)[:, 0]  # one expert per block
    active = jnp.arange(blocks) * block < padded_ends[-1]
    # one varying type for blocks and weights, so the custom VJP returns each weight's
    # gradient in its own type (the sum over token shards is the transposed pcast's psum)
    axes = frozenset().union(*(varying_axes(v) for v in (xp, be, wi_gate, wi_up, wo)))
    xp, be, active, wi_gate, wi_up, wo = (mark_varying(v, axes)
                                          for v in (xp, be, active, wi_gate, wi_up, wo))
    gate, up = blocked_matmul(xp, wi_gate, be, active), blocked_matmul(xp, wi_up, be, active)
    if bias is not None:  # one expert per block
        gate, up = (h + b[be][:, None, :].astype(h.dtype) for h, b in zip((gate, up), bias))
    h = activation(gate, up)
    out = blocked_matmul(h, wo, be, active).reshape(blocks * block, -1)
    r = jnp.arange(rows)  # sorted row -> its padded row
    e_row = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), r, side="right"),
                        num_local - 1)
    dest = padded_starts[e_row] + r - starts[e_row]
    if order is not None:  # each row of x's own order -> its padded row
        dest = jnp.zeros_like(dest).at[order].set(dest)
    return out[jnp.clip(dest, 0, blocks * block - 1)]  # rows past the groups: masked by caller


def _ragged_swiglu(dot, x, wi_gate, wi_up, wo, group_sizes, activation=SWIGLU, bias=None):
    gate = dot(x, wi_gate, group_sizes)  # MD,EDF->MF
    up = dot(x, wi_up, group_sizes)
    if bias is not None:
        e = _row_experts(group_sizes, x.shape[0])
        gate, up = (h + b[e].astype(h.dtype) for h, b in zip((gate, up), bias))
    return dot(activation(gate, up), wo, group_sizes)  # MF,EFD->MD


def tokamax_dot(x, w, group_sizes, device=None):
    """``tokamax.ragged_dot(x, w, group_sizes)``; `device` (static): a device of the mesh the
    program is compiled for when that is not the process's default platform (a GPU target
    compiled on a CPU host). tokamax picks and admits its kernels by the default device (on a
    CPU default it refuses Mosaic GPU and Triton and falls back to `jax.lax.ragged_dot`), so
    forward and backward are then traced with `device` as the default
    (`zoo.ops.moe_execution.MoEExecution.device` carries it from the mesh; being a static
    value, it reaches the backward pass too)."""
    import tokamax  # imported on use: an accelerator kernel library, not needed on CPU
    from absl import flags
    # tokamax 0.0.12 reads its options through absl flags and, if nobody parsed them, parses
    # sys.argv -- which fails on any program's own flags (pytest's, the recipes'); take the
    # defaults instead
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    if device is None:
        return tokamax.ragged_dot(x, w, group_sizes)
    return _ragged_dot_for(device)(x, w, group_sizes, varying_axes(x), varying_axes(w))


@functools.cache
def _ragged_dot_for(device):
    """``tokamax.ragged_dot`` traced with `device` as the default device, its backward too
    (tokamax's own VJP runs when the backward is traced, after the forward's scope ended)."""
    import tokamax

    dims = jax.lax.RaggedDotDimensionNumbers

    # vx, vw: the shard_map axes x and w vary over; a kernel's outputs do not say, so its
    # result and gradients are marked as the inputs vary. The backward calls the kernels
    # itself (tokamax's own VJP would check its kernels' outputs against those axes and fail)
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def dot(x, w, group_sizes, vx, vw):
        with jax.default_device(device):
            return mark_varying(tokamax.ragged_dot(x, w, group_sizes), vx | vw)

    def fwd(x, w, group_sizes, vx, vw):
        return dot(x, w, group_sizes, vx, vw), (x, w, group_sizes)

    def bwd(vx, vw, res, g):  # g [M, N]: dx = g w_e^T per row, dw_e = x_e^T g_e per group
        x, w, group_sizes = res
        with jax.default_device(device):
            dx = tokamax.ragged_dot_general(
                g, w, group_sizes, dims((([1], [2]), ([], [])), [0], [0]),
                preferred_element_type=x.dtype)
            dw = tokamax.ragged_dot_general(
                x, g, group_sizes, dims((([0], [0]), ([], [])), [0], []),
                preferred_element_type=w.dtype)
        return as_varying(dx, vx), as_varying(dw, vw), None

    dot.defvjp(fwd, bwd)
    return dot


def grouped_swiglu(x: jax.Array, wi_gate: jax.Array, wi_up: jax.Array, wo: jax.Array,
                   group_sizes: jax.Array, impl: str = "auto", *,
                   expected_rows: int | None = None, order: jax.Array | None = None,
                   inverse: jax.Array | None = None, activation: GLU = SWIGLU,
                   bias=None, device=None) -> jax.Array:
    """SwiGLU of rows sorted by expert: ``[R, D] -> [R, D]``; rows past ``sum(group_sizes)``
    are undefined (callers mask them).

    ``impl``:
      * ``"blocked"``: `_blocked_swiglu`, loops of dense block matmuls; the CPU path.
      * ``"tokamax"``: ``tokamax.ragged_dot`` (Mosaic GPU kernels on Hopper/Blackwell, Triton,
        Mosaic TPU; its XLA fallback elsewhere).
      * ``"ragged_dot"``: `jax.lax.ragged_dot`. XLA:TPU has its own ragged-dot kernel, forward
        and both transposes; XLA:GPU and XLA:CPU expand it to a dense masked matmul over every
        local expert (``E_local`` times the useful FLOPs).
      * ``"auto"``: chosen by the platform the program is lowered for
        (`jax.lax.platform_dependent`; `zoo.layers.MoE` settles it from its mesh instead,
        `choose_grouped_matmul`): ``"blocked"`` on CPU, ``"ragged_dot"`` on TPU,
        ``"tokamax"`` on GPU. Not tokamax on TPU: its Mosaic TPU kernel cannot state its
        output's `jax.shard_map` axes (a ``check_vma`` error inside the MoE's shard_map, seen
        on a TPU v5e), its XLA fallback's backward builds a masked copy of every row per
        local expert for the weight gradients (``[E_local, R, D]``: 1.6 GiB more temporaries
        than XLA's ragged dot for one ``[65536, 7168] x [4, 7168, 2048]`` product on v5p),
        and on a v5e chip XLA's ragged dot ran a SwiGLU's forward and backward about 10x
        faster than the Mosaic kernel at its default tiles (docs/benchmarks.md).
      * ``"fp8_blockwise"``: `zoo.ops.fp8.ragged_dot`, blockwise-scaled FP8 operands (XLA's
        ragged dot per 128-block of D or F), forward and backward (docs/fp8.md). ``x`` may
        then be `zoo.ops.fp8.Tiles` (rows quantised already, e.g. by the FP8 dispatch): the
        gate and up products take its tiles as they are; and the weights their FP8 copies
        (`zoo.ops.fp8.QuantizedWeight`, made once per step: `zoo.layers.MoE.fp8_weights`).
    ``expected_rows``: the real rows expected (sets the block size; default ``R``).
    ``order``: when given, ``x`` is unsorted and ``x[order]`` is sorted by expert; the result
    then comes back in ``x``'s own order (the blocked form folds both permutations into its
    own gathers, saving two ``[R, D]`` temporaries). ``inverse``: ``order``'s inverse
    permutation when the caller has it (else computed); the sorted forms move rows with
    `take_rows`, whose gradients are gathers too.
    ``activation``: a `GLU`; ``bias``: None or ``(gate_bias, up_bias)`` ``[E_local, F]``.
    ``device``: the target device tokamax's kernels are traced for (`tokamax_dot`).
    """
    if impl not in GROUPED_MATMULS:
        raise ValueError(f"grouped matmul {impl!r} is not one of {GROUPED_MATMULS}")
    if isinstance(x, fp8.Tiles) and impl != "fp8_blockwise":
        raise ValueError(f"grouped_swiglu: x is FP8 tiles (zoo.ops.fp8.Tiles), which only "
                         f"impl='fp8_blockwise' takes, not {impl!r}")
    if impl != "fp8_blockwise" and any(isinstance(w, fp8.QuantizedWeight)
                                       for w in (wi_gate, wi_up, wo)):
        raise ValueError(f"grouped_swiglu: an expert weight is an FP8 copy "
                         f"(zoo.ops.fp8.QuantizedWeight), which only impl='fp8_blockwise' "
                         f"takes, not {impl!r}; pass the weights themselves")
    with jax.named_scope("grouped_matmul"):  # profiles and HLO read the experts' matmuls by it
        return _grouped_swiglu(x, wi_gate, wi_up, wo, group_sizes, impl, expected_rows, order,
                               inverse, activation, bias, device)


def _fp8_ragged_dot(x, w, group_sizes):
    return fp8.ragged_dot(x, w, group_sizes).astype(x.dtype)


def _grouped_swiglu(x, wi_gate, wi_up, wo, group_sizes, impl, expected_rows, order, inverse,
                    activation, bias, device):
    block = block_size(expected_rows or x.shape[0], wi_gate.shape[0])
    args = (x, wi_gate, wi_up, wo, group_sizes)
    blocked = lambda *a: _blocked_swiglu(*a, block, order, activation, bias)

    def sorted_rows(dot):
        def run(x, *rest):
            if order is None:
                return _ragged_swiglu(dot, x, *rest, activation, bias)
            inv = inverse_permutation(order) if inverse is None else inverse
            move = lambda v: take_rows(v, order, inv)
            x = x.take(order, move) if isinstance(x, fp8.Tiles) else move(x)
            out = _ragged_swiglu(dot, x, *rest, activation, bias)
            return take_rows(out, inv, order)
        return run
    if impl == "blocked":
        return blocked(*args)
    if impl == "ragged_dot":
        return sorted_rows(jax.lax.ragged_dot)(*args)
    if impl == "fp8_blockwise":
        return sorted_rows(_fp8_ragged_dot)(*args)
    tok = sorted_rows(functools.partial(tokamax_dot, device=device))
    if impl == "tokamax":
        return tok(*args)
    return jax.lax.platform_dependent(*args, cpu=blocked, tpu=sorted_rows(jax.lax.ragged_dot),
                                      default=tok)
