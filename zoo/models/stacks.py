"""Scanned decoder layers: how `zoo.models.decoder.CausalLM` stacks and runs its layers.

* `layer_cycles` -- the layers as spans: runs of one kind (`DecoderLayer.layer_kind`) or whole
  cycles of kinds repeating with a period (gpt-oss's sliding, full, ...); `layer_groups` --
  entries of ``model.layers`` as they run (a stack alone, or a cycle's stacks together).
* `build_stack` -- identical layers as one module whose variables have a leading ``"layers"``
  axis (`STACK_METADATA`), every ``stride``-th layer from its first in a cycle.
* `run_layers` / `run_cycle` -- a stack, or a cycle's stacks, under `jax.lax.scan` and the
  `remat_policy`; state a layer's forward changes comes out per layer and is written back;
  `interleave_aux` puts a cycle's aux rows in layer order.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import spmd

from zoo.models.config import REMAT_POLICIES
from zoo.partitioning import COMPUTE_DTYPE, Partitioner, mesh_platform

# A decoder layer (`zoo.models.decoder.DecoderLayer`, which builds on this module): any
# nnx.Module with its `layer_kind` and `__call__`; named here without importing it.
DecoderLayer = nnx.Module

__all__ = ["LAYER_OUTPUT_NAMES", "MAX_CYCLE", "STACK_METADATA", "build_stack",
           "cast_before_scan", "interleave_aux", "layer_cycles", "layer_groups", "remat_policy",
           "run_cycle", "run_layers"]

# `remat_policy` names -> what the backward pass may keep of a layer (the rest is recomputed).
# "save_layer_outputs" keeps the attention and MLP/MoE outputs the layer tags with
# `checkpoint_name` (so the backward recomputes inside one block, never the whole layer);
# "offload_layer_outputs" moves the same tensors to pinned host memory (GPU/TPU only).
LAYER_OUTPUT_NAMES = ("attention_out", "mlp_out")


def remat_policy(name: str | None, platform: str | None = None):
    """``(remat?, jax.checkpoint policy)`` for a `remat_policy` name (ValueError if unknown) on
    `platform` (the mesh's, `zoo.partitioning.mesh_platform`; None: the default device's)."""
    if name is None or name == "none":
        return False, None
    if name == "full":
        return True, None  # jax.checkpoint's default: save nothing but the layer's inputs
    if name in ("dots_saveable", "dots_with_no_batch_dims_saveable"):
        return True, getattr(jax.checkpoint_policies, name)
    if name == "save_layer_outputs":
        return True, jax.checkpoint_policies.save_only_these_names(*LAYER_OUTPUT_NAMES)
    if name == "offload_layer_outputs":
        if (platform or mesh_platform(None)) == "cpu":
            raise ValueError("remat_policy='offload_layer_outputs' moves layer outputs to "
                             "pinned host memory, which XLA:CPU lacks; use it on GPU/TPU, or "
                             "'save_layer_outputs' here")
        return True, jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=LAYER_OUTPUT_NAMES,
            offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"remat_policy={name!r} is not known; valid values are None or "
                     f"{', '.join(map(repr, REMAT_POLICIES))}")


MAX_CYCLE = 4  # the longest cycle of layer kinds `layer_cycles` scans as one step


def layer_cycles(layer_cls: type[DecoderLayer], config, scan: bool
                 ) -> list[tuple[int, int, int]]:
    """``[(first layer, count, period), ...]`` covering the layers in order. Unrolled: single
    layers, ``(i, 1, 1)``. Scanned, from each layer on, the span its kinds
    (`DecoderLayer.layer_kind`: dense or MoE by default) repeat over with the period (1 to
    `MAX_CYCLE`) that covers the most layers in whole cycles, two at least for a period over
    1; ties go to the shorter period. Period 1 is a run of one kind (DeepSeek-V3: 3 dense,
    then 58 MoE); gpt-oss's alternating sliding and full layers are one span of period 2,
    built as two stacks scanned together (`run_cycle`)."""
    kinds = [layer_cls.layer_kind(config, i) for i in range(config.num_hidden_layers)]
    out, i = [], 0
    while i < len(kinds):
        best = (1, 1)  # (layers covered, period)
        for period in range(1, MAX_CYCLE + 1) if scan else ():
            end = i + period
            while end < len(kinds) and kinds[end] == kinds[end - period]:
                end += 1
            covered = min(end, len(kinds)) - i
            covered -= covered % period
            if (period == 1 or covered >= 2 * period) and covered > best[0]:
                best = (covered, period)
        out.append((i, *best))
        i += best[0]
    return out


def layer_groups(layers: Sequence[DecoderLayer]) -> list[tuple[DecoderLayer, ...]]:
    """Entries of ``model.layers`` as they run: a stack alone, or the ``stack_stride`` stacks
    of one cycle together (`layer_cycles`)."""
    groups, i = [], 0
    while i < len(layers):
        n = layers[i].stack_stride
        groups.append(tuple(layers[i:i + n]))
        i += n
    return groups


# metadata a stacked variable gains: an unsharded leading mesh entry, logical axis "layers"
STACK_METADATA = {nnx.PARTITION_NAME: None, "logical_axes": "layers"}


def build_stack(layer_cls: type[DecoderLayer], config, *, first: int, count: int,
                inputs_shape, partitioner: Partitioner, rngs: nnx.Rngs,
                stride: int = 1) -> DecoderLayer:
    """`count` identical layers (`first`, `first` + `stride`, ...) as one `layer_cls` instance
    whose variables have a leading ``"layers"`` axis (built with `nnx.vmap`, each layer from
    its own split of `rngs`)."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=STACK_METADATA)
    def build(rngs):
        return layer_cls(config, layer_idx=first, inputs_shape=inputs_shape,
                         partitioner=partitioner, rngs=rngs)

    stack = build(rngs)
    stack.stack_size, stack.stack_stride = count, stride
    return stack


def _snapshot(variable: nnx.Variable):
    """A variable's value as ``(leaves, treedef)``: compared by identity after a call."""
    return jax.tree.flatten(variable.get_value())


def _changed(before, variable: nnx.Variable) -> bool:
    leaves, treedef = _snapshot(variable)
    return before is None or treedef != before[1] or any(
        a is not b for a, b in zip(leaves, before[0], strict=True))


def _call_split(graphdef, body, x, params, state, record: list, *, stacked: bool):
    """``body(x, layer)`` on the layer merged from `params` and `state` (its non-Param
    variables), as a function of arrays: ``(body's output, [new value of each variable the
    call changed or created])``. The changed ``(path, variable)`` pairs go into `record` while
    tracing, so the caller knows what the values are (nothing when the layer updates nothing:
    the program is the plain call). A stack's parameters are the scan's inputs only, so a
    forward pass that writes one is refused there."""
    params_before = {path: _snapshot(v) for path, v in nnx.to_flat_state(params)}
    before = {path: _snapshot(v) for path, v in nnx.to_flat_state(state)}
    layer = nnx.merge(graphdef, params, state)
    out = body(x, layer)
    _, params_after, state_after = nnx.split(layer, nnx.Param, ...)
    written = [(path, v) for path, v in nnx.to_flat_state(params_after)
               if _changed(params_before.get(path), v)]
    if written and stacked:
        raise ValueError(
            f"{type(layer).__name__} sets the nnx.Param at {'.'.join(map(str, written[0][0]))} "
            f"in its forward pass, but scanned layers take their parameters as scan inputs and "
            f"never write them back; keep state the forward updates in a non-Param "
            f"nnx.Variable (nnx.BatchStat, nnx.Intermediate or a subclass of nnx.Variable), "
            f"which comes out per layer, or set scan_layers=False")
    record[:] = written + [(path, v) for path, v in nnx.to_flat_state(state_after)
                           if _changed(before.get(path), v)]
    return out, [v.get_value() for _, v in record]


def cast_before_scan(platform: str) -> bool:
    """Whether a stack on `platform` casts its `COMPUTE_DTYPE` parameters before the scan
    (`_cast_for_compute`): on TPU and GPU, whose compilers otherwise keep a copy of the whole
    stack for the loop anyway (XLA:TPU hoists the per-layer cast out of it, XLA:GPU a layout
    change in the parameter's dtype); XLA:CPU casts each layer's slice inside the loop, where
    a cast stack would be memory it does not otherwise spend (cpu-256 goal row: 38.23 against
    42.99 GiB)."""
    return platform != "cpu"


def _cast_for_compute(params: nnx.State) -> nnx.State:
    """`params` with each parameter that carries `COMPUTE_DTYPE` metadata cast to that dtype:
    one cast of the whole stack before the scan instead of one per layer inside it. The loop
    then slices the compute-dtype stack and the backward's stacked gradients are in that
    dtype too (cast back to the parameter's dtype after the loop: the same values, as the
    gradient of a cast is the cotangent cast back). XLA:GPU otherwise lays out a
    parameter-dtype copy of each expert stack for the loop (the FSDP all-gather's dimension
    major), which on DeepSeek-V3's goal row held three fp32 copies of 3.2 GiB through the
    step."""
    out = []
    for path, variable in nnx.to_flat_state(params):
        dtype = variable.get_metadata().get(COMPUTE_DTYPE)
        value = variable.get_value()
        if dtype is not None and value.dtype != jnp.dtype(dtype):
            variable = variable.copy(value.astype(dtype))
        out.append((path, variable))
    return nnx.from_flat_state(out)


def _write_back(layer: DecoderLayer, record, values, *, stacked: bool) -> None:
    """Set the variables `record` names to `values` in `layer`, creating the ones the call
    created (sown intermediates); in a stack they gain the leading ``"layers"`` axis."""
    if not record:
        return
    existing = {path for path, _ in nnx.to_flat_state(nnx.state(layer))}
    out = []
    for (path, variable), value in zip(record, values, strict=True):
        new = variable.copy(value)
        if stacked and path not in existing:
            new = spmd.add_axis(new, 0, STACK_METADATA)
        out.append((path, new))
    nnx.update(layer, nnx.from_flat_state(out))


def run_layers(layer: DecoderLayer, x: jax.Array, *, positions: jax.Array,
               segment_ids: jax.Array | None = None, remat: str | None = None,
               layer_kwargs: dict | None = None):
    """A layer, or a stack (``stack_size``) scanned with `jax.lax.scan`, each layer
    rematerialised as `remat` (a `remat_policy` name) says. Returns ``(x, aux)`` with aux
    entries stacked per layer (``[n, ...]``), or None for dense layers.

    The state a layer's forward pass changes or creates outside its parameters (RNG counts,
    counters, batch statistics, sown `nnx.Intermediate` values) comes out of the scan or the
    remat as per-layer values and is written back: a stack holds each layer's value along its
    leading axis, as the unrolled model holds it in each layer (sown values: stacked per
    layer like the parameters, ``model.layer(i)`` gives layer ``i``'s). Parameters are scan
    inputs only (a forward pass that writes one is refused when scanned); state the forward
    leaves alone is not returned. ``layer_kwargs`` go to every layer's call as they are
    (arrays the whole stack reads, e.g. DeepSeek-V4's token ids for its hash routing).
    """
    x, (aux,) = run_cycle((layer,), x, positions=positions, segment_ids=segment_ids,
                          remat=remat, layer_kwargs=layer_kwargs)
    return x, aux


def run_cycle(layers: Sequence[DecoderLayer], x: jax.Array, *, positions: jax.Array,
              segment_ids: jax.Array | None = None, remat: str | None = None,
              layer_kwargs: dict | None = None):
    """`run_layers` over the stacks of one cycle (`layer_groups`), scanned together: each step
    of the scan runs one layer of every stack in turn (layer ``first``, ``first + 1``, ...,
    then the next cycle), each rematerialised on its own. Returns ``(x, [aux of each
    stack])``."""
    use_remat, policy = remat_policy(remat, layers[0].partitioner.platform)
    stacked = layers[0].stack_size is not None

    extra = dict(layer_kwargs or {})

    def body(x, layer):
        return layer(x, positions=positions, segment_ids=segment_ids, **extra)

    def one_layer(aux):  # a single layer's aux entries as [1, ...]
        return None if aux is None else jax.tree.map(lambda a: a[None], aux)

    if not stacked and not use_remat:
        outs = []
        for layer in layers:
            x, aux = body(x, layer)
            outs.append(one_layer(aux))
        return x, outs

    # Each layer as a function of its split state (what nnx.scan / nnx.remat do in tree mode),
    # with the remat policy on that function: the backward pass recomputes one layer at a time.
    splits = [nnx.split(layer, nnx.Param, ...) for layer in layers]
    if stacked and cast_before_scan(layers[0].partitioner.platform):
        splits = [(graphdef, _cast_for_compute(params), state)
                  for graphdef, params, state in splits]
    records: list[list] = [[] for _ in layers]

    def make_call(graphdef, record):
        def call(x, params_and_state):
            (x, aux), values = _call_split(graphdef, body, x, *params_and_state, record,
                                           stacked=stacked)
            return x, (aux, values)
        return jax.checkpoint(call, policy=policy, prevent_cse=not stacked) if use_remat \
            else call

    calls = [make_call(graphdef, record) for (graphdef, *_), record in zip(splits, records)]

    def cycle(x, inputs):
        outs = []
        for call, params_and_state in zip(calls, inputs, strict=True):
            x, out = call(x, params_and_state)
            outs.append(out)
        return x, tuple(outs)

    inputs = tuple((params, state) for _, params, state in splits)
    if stacked:
        first = layers[0].layer_idx
        last = first + layers[0].stack_stride * layers[0].stack_size - 1
        with jax.named_scope(f"layers_{first}_to_{last}"):
            x, outs = jax.lax.scan(cycle, x, inputs)
    else:
        x, outs = cycle(x, inputs)
    for layer, record, (_, values) in zip(layers, records, outs, strict=True):
        _write_back(layer, record, values, stacked=stacked)
    return x, [aux if stacked else one_layer(aux) for aux, _ in outs]


def interleave_aux(auxes: Sequence[dict[str, jax.Array] | None]) -> dict[str, jax.Array] | None:
    """The aux dicts of one cycle's stacks (None for dense ones) as one, rows in layer order:
    stack ``j``'s row ``i`` is the cycle's ``i``-th layer of that kind."""
    moe = [a for a in auxes if a is not None]
    if len(moe) < 2:
        return moe[0] if moe else None
    return jax.tree.map(lambda *a: jnp.stack(a, 1).reshape(-1, *a[0].shape[1:]), *moe)
