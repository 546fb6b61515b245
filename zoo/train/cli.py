"""The recipes' shared command line: flags, devices, processes, mesh, model config, data, run.

A recipe is a flat script: a model config, a `TrainConfig` of its training defaults, a `Recipe`
naming the model class (and optionally a ``decoder_layer_cls``), and ``main(recipe, argv)``,
which

1. parses the flags (`make_parser`): one per `TrainConfig` field, generated from the fields
   (`zoo.train.config.add_flags`), plus ``--set FIELD=VALUE`` for any model config field and
   ``--debug``;
2. sets the number of virtual CPU devices (``--devices N``, default 8 unless the environment
   names a count) through ``jax_num_cpu_devices`` (`zoo.train.launch.set_cpu_devices`) --
   importing jax starts no backend, so this works as long as nothing has touched a device yet
   (checked: a clear error otherwise);
3. joins a multi-process job when asked (``--coordinator/--num-processes/--process-id`` or
   ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``; ``--distributed`` lets
   `jax.distributed.initialize` detect SLURM/Open MPI/TPU): gloo collectives on CPU;
4. builds the mesh (``--mesh``, default: on CPU ``fsdp=2,expert=2,context=2`` for 8 devices;
   on accelerators ``fsdp=<all>``) and the `Partitioner` (``--strategy``, default ``ep_as_cp``
   on CPU, ``fsdp`` on accelerators);
5. builds the data pipeline, the optimizer and train step (`setup` returns all of it as a
   `Setup`, e.g. for a benchmark) and runs ``zoo.train.loop.train(setup.train, setup)``.
   The `TrainConfig` it trains with has the derived defaults filled in (strategy, mesh, run
   dir, warmup, aux-loss weight); ``run.json`` records its ``asdict`` under ``config.train``.

Compiled programs are cached on disk (`zoo.train.launch.enable_compile_cache`).

Before anything is compiled or restored, the inputs are checked (`zoo.train.validate`): the
run dir is created and probed for writing first, then locked for this run (`zoo.train.lock`,
process 0 only: a second run on the same dir stops at once naming the holder), then ``--data``
must hold text and ``--tokenizer`` must load; ``--lr``, ``--warmup`` and the other numbers are
checked when the `TrainConfig` is built. A refused input is one line naming the flag, the value
and the fix, never a traceback (``--debug`` adds it). With several processes they agree before
going on, so either all start or all stop.

Exit codes: 0 finished or stopped by SIGTERM/SIGINT with a checkpoint saved (rerun to resume);
2 bad flags or inputs, a run dir in use by another run, or one whose checkpoint holds a model
of other shapes or a data-pipeline state saved under other data arguments (seq_len, load
balance, corpus, ...); 3 the loss (or the gradient/parameter norm) became NaN/Inf, or the loss
diverged (above ``--divergence-factor`` x the best of the last 100 steps for 10 steps): the
last good checkpoint is kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from zoo.train import config as config_lib
from zoo.train.config import TrainConfig, apply_overrides, config_to_json, config_to_python
from zoo.train.launch import DEFAULT_CPU_DEVICES, default_mesh, set_cpu_devices
from zoo.train.loop import Pieces

__all__ = ["Recipe", "Setup", "make_parser", "parse", "setup", "main", "apply_overrides",
           "config_to_json", "config_to_python", "set_cpu_devices", "default_mesh",
           "DEFAULT_CPU_DEVICES", "EXIT_DIVERGED"]

EXIT_DIVERGED = 3


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a recipe script declares: the model, its preset config and the training defaults."""

    name: str                          # default run dir: runs/<name>
    model_cls: type                    # model_cls(config, inputs_shape=, partitioner=, rngs=)
    config: Any                        # the preset (a frozen dataclass), e.g. MixtralConfig.mini()
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)  # the flags' defaults
    decoder_layer_cls: type | None = None  # passed to model_cls (and its from_hf) when set
    description: str = ""

    def make_model(self, config, **kwargs):
        """``model_cls(config, **kwargs)`` with this recipe's ``decoder_layer_cls``."""
        if self.decoder_layer_cls is not None:
            kwargs["decoder_layer_cls"] = self.decoder_layer_cls
        return self.model_cls(config, **kwargs)


# -- flags -------------------------------------------------------------------------------------

def make_parser(recipe: Recipe) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python recipes/{recipe.name}.py", description=recipe.description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    config_lib.add_flags(p, recipe.train)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                   help=f"override a field of the model config ({type(recipe.config).__name__}; "
                        f"repeatable), e.g. --set hidden_size=256")
    p.add_argument("--debug", action="store_true",
                   help="show Python tracebacks of refused flags and inputs")
    return p


def _refuse(parser, debug: bool, error: BaseException, message: str | None = None):
    """Exit 2 through argparse with one line; the traceback only with --debug."""
    if debug:
        traceback.print_exception(error)
    parser.error(message or str(error))


def parse(recipe: Recipe, argv: Sequence[str] | None = None
          ) -> tuple[argparse.ArgumentParser, argparse.Namespace, TrainConfig, Any]:
    """``(parser, args, train config, model config after --set)``; bad flags exit 2."""
    parser = make_parser(recipe)
    args = parser.parse_args(argv)
    try:
        train = config_lib.from_args(args)
        model_config = apply_overrides(recipe.config, args.overrides)
    except ValueError as e:
        _refuse(parser, args.debug, e)
    return parser, args, train, model_config


# -- setup -------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class Setup(Pieces):
    """Everything `main` builds before training (a benchmark can time `train_step` from it):
    the `zoo.train.loop.Pieces` plus what they were built from."""

    train: TrainConfig               # with strategy, mesh, run_dir, warmup, aux weight resolved
    config: Any                      # the model config after --set/--attention/--dtype/--from-hf
    partitioner: Any                 # zoo.Partitioner
    schedule: Callable[[int], float]
    lock: Any = None                 # zoo.train.lock.RunLock held by main (process 0)

    def create_sharded(self):
        """``(model, optimizer)`` as a fresh run starts them (created sharded)."""
        from zoo.train import step as step_lib
        return self.create() if self.create else step_lib.create_sharded(self.make_model, self.tx)


def setup(recipe: Recipe, argv: Sequence[str] | None = None, *, lock: bool = False) -> Setup:
    """Parse `argv`, check the inputs and build devices, processes, mesh, config, data,
    optimizer and step. With ``lock=True`` process 0 locks the run dir (`Setup.lock`; the
    caller releases it).

    Bad flags and inputs exit through argparse (`SystemExit` 2, one line naming the flag, the
    value and the fix).
    """
    parser, args, train, config = parse(recipe, argv)
    try:
        set_cpu_devices(train.devices)
        from zoo.train.launch import init_distributed
        init_distributed(coordinator=train.coordinator, num_processes=train.num_processes,
                         process_id=train.process_id, distributed=train.distributed)
    except ValueError as e:
        _refuse(parser, args.debug, e)

    import jax

    from zoo.train import validate
    from zoo.train.lock import RunDirLocked, RunLock

    # The run dir first (before any restore or compile), then the lock, then the inputs.
    run_lock, problem = None, None
    try:
        run_dir = train.run_dir or os.path.join("runs", recipe.name)  # kept as given
        writable = validate.check_run_dir(run_dir)
        if lock and jax.process_index() == 0:
            run_lock = RunLock(writable).acquire()
        validate.check_data(train.data)
        tokenizer = validate.load_tokenizer(train.tokenizer)
    except (ValueError, RunDirLocked) as e:
        problem = e
    agreed = problem is None
    if jax.process_count() > 1:
        from zoo.train.checkpoint import all_processes_agree
        agreed = all_processes_agree(agreed)
    if not agreed:
        if run_lock is not None:
            run_lock.release()
        if problem is None:
            problem = ValueError("another process of this job refused its inputs (see its "
                                 "message)")
        _refuse(parser, args.debug, problem)
    try:
        return _build(recipe, parser, args, train, config, tokenizer, run_dir, run_lock)
    except BaseException:
        if run_lock is not None:
            run_lock.release()
        raise


# --load-balance -> the token layout on the context shards (`zoo.ops.attention(layout=)`): "row"
# deals each row's 2*cp chunks as r, 2cp-1-r; "auto"/"document" permute per row, so no static
# layout holds.
LOAD_BALANCE_LAYOUT = {"none": "contiguous", "row": "balanced", "auto": None, "document": None}


def _model_config(recipe, train: TrainConfig, config, set_fields, tokenizer, backend: str):
    """The model config after --attention/--dtype/--param-dtype/--remat, the tokenizer's
    vocabulary and --from-hf (whose config.json gives the fields not --set)."""
    import jax.numpy as jnp
    changes: dict[str, Any] = {}
    if train.attention:
        changes["attention_implementation"] = train.attention
    if "attention_layout" not in set_fields:  # the order the data pipeline gives the shards
        changes["attention_layout"] = LOAD_BALANCE_LAYOUT[train.load_balance]
    # accelerators (and their rehearsal) compute in bf16 over fp32 parameters by default
    dtype = train.dtype or ("bfloat16" if backend != "cpu" or train.rehearse else None)
    for field, name in (("dtype", dtype), ("param_dtype", train.param_dtype)):
        if name:
            changes[field] = jnp.dtype(name).type
    if train.remat:
        changes["remat_policy"] = None if train.remat == "none" else train.remat
    if tokenizer.vocab_size > config.vocab_size and "vocab_size" not in set_fields:
        changes["vocab_size"] = -(-tokenizer.vocab_size // 128) * 128
    elif tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"--set vocab_size={config.vocab_size} is smaller than the "
                         f"tokenizer's {tokenizer.vocab_size} ids")
    if train.from_hf:
        if not hasattr(recipe.model_cls, "from_hf"):
            raise ValueError(f"--from-hf: {recipe.model_cls.__name__} cannot load checkpoints")
        from zoo.models import hf
        raw = hf.read_config(train.from_hf, recipe.model_cls.hf_model_types, loader=recipe.name)
        overrides = {k: getattr(config, k) for k in set_fields} | changes
        return recipe.model_cls.config_cls.from_hf_config(raw, **overrides)
    return dataclasses.replace(config, **changes) if changes else config


def _build(recipe, parser, args, train, config, tokenizer, run_dir, run_lock) -> Setup:
    import jax
    from flax import nnx

    from zoo import data as data_lib
    from zoo.partitioning import MeshShape, Partitioner
    from zoo.train import step as step_lib
    from zoo.train.launch import enable_compile_cache

    enable_compile_cache()
    backend, n = jax.default_backend(), jax.device_count()
    train = dataclasses.replace(train, run_dir=run_dir,
                                mesh=train.mesh or default_mesh(n, backend),
                                strategy=train.strategy or ("ep_as_cp" if backend == "cpu"
                                                            else "fsdp"),
                                warmup=(step_lib.default_warmup(train.steps)
                                        if train.warmup is None else train.warmup))
    try:
        shape = MeshShape.parse(train.mesh)
        try:
            mesh = shape.make()
        except ValueError as e:
            raise ValueError(f"--mesh {train.mesh}: {e}") from None
        partitioner = Partitioner(mesh, train.strategy)
        set_fields = {o.partition("=")[0].strip() for o in args.overrides}
        config = _model_config(recipe, train, config, set_fields, tokenizer, backend)
        schedule = step_lib.lr_schedule(train.lr, train.steps, warmup=train.warmup,
                                        final_fraction=train.final_lr_fraction)
    except ValueError as e:
        _refuse(parser, args.debug, e)

    B, L = train.batch_size, train.seq_len
    if B % jax.process_count():
        parser.error(f"--batch-size {B} must be divisible by the {jax.process_count()} processes")
    batch_sharding = partitioner.sharding(("batch", "length"))
    try:
        step_lib.check_process_layout(batch_sharding, (B, L))
        # Build once abstractly now so shape/mesh errors surface here as flag errors.
        abstract = nnx.eval_shape(lambda: recipe.make_model(
            config, inputs_shape=(B, L), partitioner=partitioner, rngs=nnx.Rngs(0)))
    except ValueError as e:
        _refuse(parser, args.debug, e, f"{e} (mesh {train.mesh}, strategy {train.strategy}, "
                                       f"batch {B}, seq_len {L})")

    def make_model():
        return recipe.make_model(config, inputs_shape=(B, L), partitioner=partitioner,
                                 rngs=nnx.Rngs(train.seed))

    tx = step_lib.make_tx(weight_decay=train.weight_decay, b1=train.adam_b1, b2=train.adam_b2,
                          eps=train.adam_eps, clip=train.clip)
    if train.aux_loss_weight is None:
        train = dataclasses.replace(train, aux_loss_weight=float(
            getattr(config, train.aux_loss_field) if train.aux_loss_field else 0.0))
    train_step = step_lib.make_train_step(aux_loss_weight=train.aux_loss_weight,
                                          expert_bias_rate=train.expert_bias_rate)
    create = None
    if train.from_hf:
        def create():
            fields = {k: v for k, v in config_to_python(config).items()
                      if k not in ("dtype", "param_dtype")}
            extra = ({"decoder_layer_cls": recipe.decoder_layer_cls}
                     if recipe.decoder_layer_cls is not None else {})
            model = recipe.model_cls.from_hf(
                train.from_hf, partitioner=partitioner, inputs_shape=(B, L), dtype=config.dtype,
                param_dtype=config.param_dtype, config_overrides=fields, **extra)
            return model, jax.jit(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param))(model)

    cp = partitioner.context_size("attention")
    try:
        data = data_lib.text_dataset(list(train.data) if train.data else None, seq_len=L,
                                     batch_size=B, context_parallel=cp,
                                     balance=train.load_balance,
                                     rows_per_device=batch_sharding.shard_shape((B, L))[0],
                                     corpus_docs=train.corpus_docs, tokenizer=tokenizer,
                                     seed=train.seed)
    except ValueError as e:
        _refuse(parser, args.debug, e)
    from zoo.layers.moe import moe_modules  # the MoE kernels as resolved for this mesh
    moe = next((dict(dispatch=m.dispatch, requested=m.dispatch_requested,
                     grouped_matmul=m.grouped_matmul, buffer_factor=m.buffer_factor)
                for m in moe_modules(abstract, with_bias=False)), None)
    record = dict(recipe=recipe.name, model_cls=recipe.model_cls.__qualname__,
                  decoder_layer_cls=getattr(recipe.decoder_layer_cls, "__qualname__", None),
                  model=config_to_json(config), context_parallel=cp, moe=moe)
    return Setup(make_model=make_model, tx=tx, train_step=train_step, data=data,
                 batch_sharding=batch_sharding, record=record, create=create,
                 flops_per_token=(config.flops_per_token(L)
                                  if hasattr(config, "flops_per_token") else None),
                 train=train, config=config, partitioner=partitioner, schedule=schedule,
                 lock=run_lock)


# -- main --------------------------------------------------------------------------------------

def main(recipe: Recipe, argv: Sequence[str] | None = None, *,
         on_step: Callable[[int, dict], None] | None = None) -> int:
    """Run a recipe with command-line flags `argv` (default ``sys.argv[1:]``); returns the exit
    code (see the module docstring; bad flags raise argparse's `SystemExit` 2)."""
    s = setup(recipe, argv, lock=True)
    try:
        return _run(recipe, s, on_step)
    finally:
        if s.lock is not None:
            s.lock.release()


def _run(recipe: Recipe, s: Setup, on_step) -> int:
    import jax

    t = s.train
    if t.rehearse:
        from zoo.train.rehearse import rehearse_step
        print(rehearse_step(make_model=s.make_model, tx=s.tx, partitioner=s.partitioner,
                            batch_size=t.batch_size, seq_len=t.seq_len,
                            aux_loss_weight=t.aux_loss_weight,
                            expert_bias_rate=t.expert_bias_rate,
                            flops_per_token=s.flops_per_token, label=recipe.name,
                            mesh_text=t.mesh, remat=s.config.remat_policy,
                            dtype=s.config.dtype, param_dtype=s.config.param_dtype))
        return 0
    from zoo.data import PipelineStateMismatch
    from zoo.train import loop

    if jax.process_index() == 0:
        print(f"{recipe.name}: {jax.device_count()} {jax.default_backend()} devices in "
              f"{jax.process_count()} process(es), mesh {t.mesh}, strategy {t.strategy}; "
              f"batch {t.batch_size} x {t.seq_len} tokens; run dir {t.run_dir}",
              file=sys.stderr, flush=True)
    try:
        loop.train(t, s, name=recipe.name, on_step=on_step)
    except loop.TrainingDiverged as e:
        print(f"{recipe.name}: {e}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except (loop.IncompatibleCheckpoint, PipelineStateMismatch) as e:
        print(f"{recipe.name}: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        getattr(s.data, "close", lambda: None)()
    return 0
