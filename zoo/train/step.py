"""One training step, the optimizer and its schedule, and sharded creation of both.

* `lr_schedule` -- linear warmup to ``lr`` then cosine decay to ``final_fraction * lr`` at
  ``steps``; warmup defaults to ``min(100, steps // 10)`` so short runs learn too. Evaluated on
  the host and passed to the step, so another ``--lr``/``--steps`` needs no recompilation.
* `make_tx` -- ``clip_by_global_norm -> adamw`` (weight decay only on matrices), the learning
  rate an argument of each update.
* `loss_fn` -- cross-entropy weighted by ``loss_weights`` and divided by the *global* weight sum
  (the batch is one global array, so ``sum`` is global), plus ``aux_loss_weight`` times the
  model's ``load_balance_loss`` (and ``index_loss_weight`` times its ``indexer_loss``, when
  the model returns one: DeepSeek-V3.2's indexer training stages).
* `make_train_step` -- a `jax.jit` of ``(model, optimizer, batch, lr) -> (model, optimizer,
  metrics)`` with the model and optimizer donated (not on CPU: see there). Any optax
  transformation works; ``metrics["lr"]`` is the rate it applied (the ``lr`` argument for
  `make_tx`, a schedule's or `optax.inject_hyperparams`' value otherwise). An after-step hook
  (the family's, e.g. DeepSeek-V3's expert-bias update) runs after the optimizer update,
  outside the gradient.
* `create_sharded` / `abstract_state` -- model and optimizer built inside `jax.jit` (every
  parameter and optimizer moment is created on its shards, never whole on one device) or under
  `nnx.eval_shape` (shapes and shardings only: the target of a checkpoint restore).
* `make_global_batch` -- this process's rows -> global arrays on the batch sharding.

A model is anything called as ``logits, aux = model(tokens, positions=..., segment_ids=...)``
with ``aux`` optionally holding ``load_balance_loss`` (scalar) and ``expert_counts``
(``[num_moe_layers, E]``).

Legend: B batch, L length, V vocabulary, E experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zoo.models.decoder import Fp8Stats, prequantized_weights
from zoo.models import registry
from zoo.ops.fp8 import STATS
from zoo.ops.loss import cross_entropy

__all__ = ["default_warmup", "lr_schedule", "make_tx", "loss_fn", "make_train_step",
           "create_sharded", "abstract_state", "make_global_batch", "check_process_layout",
           "nonfinite_state", "pop_fp8_stats", "fp8_metrics",
           "BATCH_KEYS"]

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_weights")


# -- schedule and optimizer --------------------------------------------------------------------

def default_warmup(steps: int) -> int:
    """Warmup steps for a run of `steps`: a tenth of the run, at most 100."""
    return min(100, steps // 10)


def lr_schedule(lr: float, steps: int, *, warmup: int | None = None,
                final_fraction: float = 0.1) -> Callable[[int], float]:
    """Learning rate of update ``t`` (0-based): ``lr*(t+1)/warmup`` for ``t < warmup``, then a
    cosine from ``lr`` at ``t = warmup`` to ``final_fraction*lr`` at ``t = steps``.

    A host-side function of the step: the rate reaches the compiled step as an argument, so
    runs with another ``--lr``/``--steps`` reuse the same compiled program. `steps` is the
    planned total, so a run resumed with the same `steps` continues the same curve; the rate
    stays at the floor past the end.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1 (the planned number of updates)")
    warmup = default_warmup(steps) if warmup is None else warmup
    if not 0 <= warmup <= steps:
        raise ValueError(f"warmup={warmup} must be in [0, steps={steps}]")
    floor = final_fraction * lr
    decay = max(steps - warmup, 1)

    def schedule(t: int) -> float:
        if t < warmup:
            return lr * (t + 1) / warmup
        progress = min(max((t - warmup) / decay, 0.0), 1.0)
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


def _decay_mask(params):
    # No weight decay on vectors (norm scales, biases): only matrices shrink.
    return jax.tree.map(lambda x: x.ndim > 1, params)


class ScaleByLrState(NamedTuple):
    """`scale_by_lr`'s (empty) state: in an optimizer's state it marks a transformation that
    applies the ``lr`` argument of the train step."""


def scale_by_lr() -> optax.GradientTransformationExtraArgs:
    """``updates * -lr`` with ``lr`` passed to ``update`` (``optimizer.update(..., lr=lr)``)."""

    def update(updates, state, params=None, *, lr, **extra):
        del params, extra
        return jax.tree.map(lambda u: (-lr * u).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: ScaleByLrState(), update)


def make_tx(*, weight_decay: float = 0.1, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
            clip: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """AdamW (decoupled weight decay, matrices only) after global-norm clipping (``clip <= 0``:
    none), the learning rate given at each update: ``optimizer.update(model, grads, lr=lr)``.
    Same arithmetic as ``optax.adamw``."""
    parts = [optax.clip_by_global_norm(clip)] if clip > 0 else []
    parts += [optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
              optax.add_decayed_weights(weight_decay, mask=_decay_mask), scale_by_lr()]
    return optax.chain(*parts)


# -- loss and step -----------------------------------------------------------------------------

def _weighted_ce(logits, targets, w):
    ce_tok = cross_entropy(logits, targets)  # fp32 values; the gradient in the logits' dtype
    return jnp.sum(ce_tok * w) / jnp.maximum(jnp.sum(w), 1.0)


def successors(positions: jax.Array, segment_ids: jax.Array | None):
    """``(index [B, L], exists [B, L])``: where in its row the token one position later in the
    same document lies, whatever the row's order (packed, load-balanced, reordered)."""
    B, L = positions.shape
    seg = jnp.ones_like(positions) if segment_ids is None else segment_ids
    iota = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    _, _, order = jax.lax.sort((seg, positions, iota), dimension=1, num_keys=2)
    rank = jnp.zeros_like(order).at[jnp.arange(B)[:, None], order].set(iota)
    nxt = jnp.take_along_axis(order, jnp.minimum(rank + 1, L - 1), axis=1)
    take = lambda a: jnp.take_along_axis(a, nxt, axis=1)
    exists = (rank + 1 < L) & (take(seg) == seg) & (take(positions) == positions + 1)
    return nxt, exists


def mtp_targets(batch: Mapping[str, jax.Array], depth: int):
    """Multi-token prediction's ``(tokens, targets, weights)``, each ``[depth, B, L]``: module
    ``d`` (1-based) sees at position ``i`` the token ``d`` ahead (the ``targets`` of the token
    ``d - 1`` ahead) and predicts the one ``d + 1`` ahead, weighted where every token of that
    chain is in the document and carries a loss weight."""
    nxt, exists = successors(batch["positions"], batch.get("segment_ids"))
    w = batch["loss_weights"].astype(jnp.float32)
    idx = jnp.broadcast_to(jnp.arange(nxt.shape[1], dtype=jnp.int32), nxt.shape)
    ok = w
    tokens, targets, weights = [], [], []
    for _ in range(depth):
        tokens.append(jnp.take_along_axis(batch["targets"], idx, axis=1))
        ok = ok * jnp.take_along_axis(exists, idx, axis=1)
        idx = jnp.take_along_axis(nxt, idx, axis=1)
        ok = ok * jnp.take_along_axis(w, idx, axis=1)
        targets.append(jnp.take_along_axis(batch["targets"], idx, axis=1))
        weights.append(ok)
    return jnp.stack(tokens), jnp.stack(targets), jnp.stack(weights)


def loss_fn(model, batch: Mapping[str, jax.Array], *, aux_loss_weight: float = 0.0,
            mtp_loss_weight: float | None = None):
    """``(objective, (ce, aux_loss, aux))`` of one global batch.

    ``ce = sum(ce_token * w) / max(sum(w), 1)`` with the sums over the whole global batch, so
    the value does not depend on how the batch is cut over devices or processes. A model with
    multi-token-prediction modules (``model.mtp``, e.g. DeepSeek-V3's) gets their targets
    (`mtp_targets`); the objective adds ``mtp_loss_weight`` (default the model config's) times
    the mean over depths of their cross-entropy, returned as ``aux["mtp_loss"]``. A model
    that returns ``aux["indexer_loss"]`` (DeepSeek-V3.2's indexer training) adds its config's
    ``index_loss_weight`` times it. FP8 layers' statistics (`pop_fp8_stats`) are
    ``aux["fp8_stats"]``; their weights are quantised once, before the forward pass
    (`zoo.models.decoder.prequantized_weights`).
    """
    depth = len(getattr(model, "mtp", None) or ())
    kw = dict(positions=batch["positions"], segment_ids=batch["segment_ids"])
    if depth:
        with jax.named_scope("mtp_targets"):
            mtp_tokens, mtp_tgt, mtp_w = mtp_targets(batch, depth)
        kw["mtp_tokens"] = mtp_tokens
    with prequantized_weights(model):  # FP8 weight copies: made once here, used by every layer
        logits, aux = model(batch["inputs"], **kw)  # [B, L, V]
    stats = pop_fp8_stats(model)
    with jax.named_scope("loss"):
        w = batch["loss_weights"].astype(jnp.float32)
        ce = _weighted_ce(logits, batch["targets"], w)
        aux = dict(aux or {})
        if stats is not None:
            aux["fp8_stats"] = stats
        aux_loss = jnp.asarray(aux.get("load_balance_loss", 0.0), jnp.float32)
        objective = ce + aux_loss_weight * aux_loss
        if depth:
            mtp_logits = aux.pop("mtp_logits")
            aux["mtp_loss"] = sum(_weighted_ce(mtp_logits[d], mtp_tgt[d], mtp_w[d])
                                  for d in range(depth)) / depth
            if mtp_loss_weight is None:
                mtp_loss_weight = getattr(model.config, "mtp_loss_weight", 0.0)
            objective = objective + mtp_loss_weight * aux["mtp_loss"]
        if aux.get("indexer_loss") is not None:
            weight = getattr(model.config, "index_loss_weight", 1.0)
            objective = objective + weight * aux["indexer_loss"]
        return objective, (ce, aux_loss, aux)


def pop_fp8_stats(model) -> jax.Array | None:
    """The `zoo.models.decoder.Fp8Stats` the model's FP8 layers recorded in its last call,
    summed to one float32 ``[4]`` (`zoo.ops.fp8.STATS`) and removed from the model; None when
    it holds none (no layer runs in FP8)."""
    leaves = jax.tree.leaves(nnx.pop(model, Fp8Stats))
    if not leaves:
        return None
    return sum(jnp.sum(jnp.reshape(v, (-1, len(STATS))), axis=0) for v in leaves)


def fp8_metrics(stats: jax.Array) -> dict[str, jax.Array]:
    """``fp8/saturated_blocks`` (the fraction of quantised blocks whose scale hit an extreme)
    and ``fp8/underflow`` (the fraction of nonzero values that became zero in FP8) of
    `pop_fp8_stats`' counts: the forward pass's FP8 operands, activations and weights."""
    blocks, saturated, nonzero, underflow = (stats[i] for i in range(len(STATS)))
    return {"fp8/saturated_blocks": saturated / jnp.maximum(blocks, 1.0),
            "fp8/underflow": underflow / jnp.maximum(nonzero, 1.0)}


def _find(tree, match: Callable[[Any], bool]) -> list[Any]:
    """The nodes of `tree` (an optimizer state) for which `match` holds, in tree order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=match) if match(x)]


def _takes_lr(opt_state) -> bool:
    return bool(_find(opt_state, lambda x: isinstance(x, ScaleByLrState)))


def _injected_lr(opt_state) -> jax.Array | None:
    """The ``learning_rate`` an `optax.inject_hyperparams` state holds (None: no such state,
    or several, which would make "the" rate ambiguous)."""
    found = _find(opt_state, lambda x: isinstance(getattr(x, "hyperparams", None), Mapping)
                  and "learning_rate" in x.hyperparams)
    if len(found) != 1:
        return None
    return jnp.asarray(found[0].hyperparams["learning_rate"][...], jnp.float32)


def _apply_update(optimizer, model, grads, lr, schedule) -> jax.Array | None:
    """Run the optimizer's update; return the learning rate it applied, when known."""
    if _takes_lr(optimizer.opt_state):  # make_tx: the step's lr argument is the rate
        if lr is None:
            raise ValueError("the optimizer applies the train step's lr argument (zoo.train."
                             "step.scale_by_lr, e.g. make_tx()), but lr=None; pass this "
                             "update's rate: step(model, optimizer, batch, lr)")
        if schedule is not None:
            raise ValueError(
                f"make_train_step(schedule={getattr(schedule, '__name__', schedule)}) would log "
                f"a rate the optimizer does not apply: it applies the lr argument (zoo.train."
                f"step.scale_by_lr, e.g. make_tx()); drop schedule= and pass schedule(t) as lr, "
                f"or build the optimizer on the schedule (e.g. optax.adamw(schedule))")
        with jax.named_scope("optimizer"):
            optimizer.update(model, grads, lr=lr)
        return jnp.asarray(lr, jnp.float32)
    applied = None if schedule is None else jnp.asarray(schedule(optimizer.step[...]),
                                                        jnp.float32)
    with jax.named_scope("optimizer"):
        optimizer.update(model, grads)
    return applied if applied is not None else _injected_lr(optimizer.opt_state)


def _after_step_hook(model, after_step, expert_bias_rate: float):
    """`after_step`, else the model's family's registered hook when ``expert_bias_rate > 0``
    (DeepSeek-V3's expert-bias update), else None."""
    if after_step is not None or not expert_bias_rate:
        return after_step
    family = registry.family_of(model)
    if family.after_step is None:
        raise ValueError(f"expert_bias_rate={expert_bias_rate} needs an after-step hook, but "
                         f"family {family.name!r} registers none (its routers keep no bias to "
                         f"update); pass expert_bias_rate=0.0, or after_step=")
    return family.after_step


def nonfinite_state(model) -> dict[str, jax.Array]:
    """``{path: count}`` of NaN/Inf values in each floating-point variable of `model` that is
    not an `nnx.Param` (the state an after-step hook updates, e.g. DeepSeek-V3's expert bias;
    the NaN guard reads it, as it reads the loss and the norms). Empty: no such variable."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param)))
    return {".".join(map(str, path)): jnp.sum(~jnp.isfinite(v[...])).astype(jnp.int32)
            for path, v in flat if jnp.issubdtype(jnp.result_type(v[...]), jnp.floating)}


def make_train_step(*, aux_loss_weight: float = 0.0, expert_bias_rate: float = 0.0,
                    after_step: Callable[..., None] | None = None,
                    schedule: Callable[[jax.Array], jax.Array] | None = None,
                    donate: bool | None = None, platform: str | None = None
                    ) -> Callable[..., tuple[Any, Any, dict[str, jax.Array]]]:
    """A jitted ``train_step(model, optimizer, batch, lr=None) -> (model, optimizer, metrics)``.

    The update is whatever the optimizer's optax transformation does:

    * `make_tx` (any chain with `scale_by_lr`): ``lr``, a float32 scalar, is this update's rate
      (see `lr_schedule`); it is required, and logged.
    * any other transformation ignores ``lr``. The logged ``lr`` is the rate it applied:
      ``schedule(optimizer.step)`` when ``schedule=`` is given (the optax schedule the
      transformation was built with, e.g. ``optax.adamw(schedule)``; a jax function of the
      update count), else the ``learning_rate`` of its `optax.inject_hyperparams` state. When
      neither tells the rate, ``metrics`` has no ``lr`` (never a value that was not applied).

    Use the returned model and optimizer: with donation the ones passed in are
    consumed (their buffers hold the new state). ``donate=None`` donates except when
    `platform` (the mesh's, `zoo.partitioning.mesh_platform`; None: the default device's) is
    the CPU: there, an executable loaded from the persistent compilation cache intermittently
    deadlocks in its collectives (jax 0.10.2, 8 virtual devices; donated or not, which is why
    the cache is now off on several CPU devices, `zoo.train.launch.cache_is_safe`), and CPU
    memory is rarely what limits a CPU run.

    ``after_step(model, aux, *, expert_bias_rate)`` runs inside the step after the optimizer
    update, outside the gradient (``aux``: the model's aux dict, `jax.lax.stop_gradient`-ed).
    Without one, ``expert_bias_rate > 0`` runs the model family's registered hook
    (`zoo.models.registry.family_of(model).after_step`; DeepSeek-V3's moves the sigmoid
    routers' selection bias by ``rate * sign(mean - counts)``).

    ``metrics`` holds scalars ``loss`` (the weighted cross-entropy), ``aux_loss`` (the
    load-balance loss, before its weight), ``objective``, ``grad_norm`` (before clipping),
    ``param_norm`` (after the update), ``lr`` (when known, see above), ``weight_sum`` (tokens
    with a target), for MoE models ``expert_counts`` ``[num_moe_layers, E]``, and
    ``nonfinite_state`` (`nonfinite_state`, after the after-step hook) when the model holds
    floating-point state besides its parameters, ``indexer_loss`` when the model returns
    one, and ``fp8/saturated_blocks`` and ``fp8/underflow`` (`fp8_metrics`) when layers run
    in FP8 (``fp8="blockwise"``; nothing is computed otherwise). A model with a
    ``frozen_state`` filter (DeepSeek-V3.2's indexer warm-up) keeps those variables exactly as
    they were: the update (weight decay included) and the after-step hook are undone for
    them.
    """

    def train_step(model, optimizer, batch, lr=None):
        grad_fn = nnx.value_and_grad(
            lambda m: loss_fn(m, batch, aux_loss_weight=aux_loss_weight),
            argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
        (objective, (ce, aux_loss, aux)), grads = grad_fn(model)
        grad_norm = optax.tree.norm(grads)
        frozen = getattr(model, "frozen_state", None)
        kept = None if frozen is None else nnx.as_pure(nnx.state(model, frozen))
        applied_lr = _apply_update(optimizer, model, grads, lr, schedule)
        if kept is not None:  # before param_norm; again after the hook
            nnx.update(model, kept)
        metrics = dict(loss=ce, aux_loss=aux_loss, objective=objective, grad_norm=grad_norm,
                       param_norm=optax.tree.norm(nnx.state(model, nnx.Param)),
                       weight_sum=jnp.sum(batch["loss_weights"].astype(jnp.float32)))
        if applied_lr is not None:
            metrics["lr"] = applied_lr
        if aux.get("dropped_tokens") is not None:  # MoE copies over an all-to-all buffer
            metrics["dropped_tokens"] = jnp.sum(aux["dropped_tokens"])
        if aux.get("mtp_loss") is not None:  # multi-token prediction's mean cross-entropy
            metrics["mtp_loss"] = aux["mtp_loss"]
        if aux.get("indexer_loss") is not None:  # DSA indexer training (index_stage)
            metrics["indexer_loss"] = aux["indexer_loss"]
        if aux.get("fp8_stats") is not None:  # FP8 layers: what quantisation did
            metrics.update(fp8_metrics(aux["fp8_stats"]))
        if aux.get("moe_rounds") is not None:  # exact overflow: the most rounds any layer ran
            metrics["moe_rounds"] = jnp.max(aux["moe_rounds"])
        counts = aux.get("expert_counts")
        if counts is not None and jnp.size(counts):
            metrics["expert_counts"] = jnp.asarray(counts)
        hook = _after_step_hook(model, after_step, expert_bias_rate)
        if hook is not None:
            with jax.named_scope("after_step"):
                hook(model, jax.lax.stop_gradient(aux), expert_bias_rate=expert_bias_rate)
        if kept is not None:  # the model's frozen variables: the update and hook undone
            nnx.update(model, kept)
        nonfinite = nonfinite_state(model)
        if nonfinite:
            metrics["nonfinite_state"] = nonfinite
        return model, optimizer, metrics

    if donate is None:
        from zoo.partitioning import mesh_platform
        donate = (platform or mesh_platform(None)) != "cpu"
    return jax.jit(train_step, donate_argnums=(0, 1) if donate else ())


# -- creation ----------------------------------------------------------------------------------

def _create_fn(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation):
    def create():
        model = make_model()
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
    return create


def create_sharded(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation
                   ) -> tuple[nnx.Module, nnx.Optimizer]:
    """Model and optimizer created inside `jax.jit`: each parameter and moment on its shards.

    `make_model` builds the model (its own `nnx.Rngs` inside, so creation is deterministic);
    its parameters carry ``out_sharding`` metadata (`zoo.Partitioner.param`), which the jit
    turns into output shardings -- no array is ever whole on one device.
    """
    return jax.jit(_create_fn(make_model, tx))()


def abstract_state(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation,
                   mesh=None) -> tuple[nnx.Module, nnx.Optimizer]:
    """Like `create_sharded` under `nnx.eval_shape`: `jax.ShapeDtypeStruct` leaves that carry
    their shardings (leaves without sharding metadata, e.g. step counters, are replicated on
    `mesh`). Nothing is allocated; this is the target a checkpoint is restored into."""
    model, optimizer = nnx.eval_shape(_create_fn(make_model, tx))
    if mesh is not None:
        replicated = NamedSharding(mesh, P())

        def fill(x):
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
            return x

        for module in (model, optimizer):
            nnx.update(module, jax.tree.map(fill, nnx.state(module)))
    return model, optimizer


# -- batches -----------------------------------------------------------------------------------

def check_process_layout(sharding: NamedSharding, global_shape: tuple[int, ...]) -> None:
    """The pipeline hands process ``i`` rows ``[i*b, (i+1)*b)`` (all columns) of the global
    batch, so the devices of process ``i`` must together hold exactly that block. Raise a
    `ValueError` naming the fix otherwise (e.g. a sequence axis spanning processes)."""
    n = jax.process_count()
    if n == 1:
        return
    rows = global_shape[0] // n
    regions: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(global_shape).items():
        box = tuple(s.indices(d)[:2] for s, d in zip(index, global_shape))
        regions.setdefault(device.process_index, set()).add(box)
    for proc, boxes in sorted(regions.items()):
        want = ((proc * rows, (proc + 1) * rows), *((0, d) for d in global_shape[1:]))
        lo = tuple(min(b[k][0] for b in boxes) for k in range(len(global_shape)))
        hi = tuple(max(b[k][1] for b in boxes) for k in range(len(global_shape)))
        area = sum(math.prod(e - s for s, e in b) for b in boxes)
        if tuple(zip(lo, hi)) != want or area != math.prod(e - s for s, e in want):
            raise ValueError(
                f"with {n} processes, process {proc} feeds rows {want[0][0]}:{want[0][1]} of the "
                f"global batch {tuple(global_shape)}, but the batch sharding {sharding.spec} "
                f"gives its devices the blocks {sorted(boxes)}; put the process count into the "
                f"batch axes (data or fsdp, e.g. --mesh data={n},...) so the sequence axes "
                f"stay within a process")


def make_global_batch(local: Mapping[str, np.ndarray], sharding: NamedSharding | None
                      ) -> dict[str, jax.Array]:
    """This process's ``[B // process_count, L]`` arrays -> global ``[B, L]`` arrays."""
    if sharding is None:
        return {k: jnp.asarray(local[k]) for k in BATCH_KEYS}
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(local[k]))
            for k in BATCH_KEYS}
