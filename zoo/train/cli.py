"""The recipes' shared command line: flags, devices, processes, mesh, model config, data, run.

A recipe is a flat script that describes itself with a `Recipe` (model class, preset config,
defaults) and calls ``main(recipe, argv)``, which

1. parses the flags (`make_parser`) -- ``--set FIELD=VALUE`` overrides any model config field;
2. sets the number of virtual CPU devices (``--devices N``, default 8 unless ``XLA_FLAGS``
   already names a count) in ``XLA_FLAGS`` -- importing jax starts no backend, so this works
   as long as nothing has touched a device yet (checked: a clear error otherwise);
3. joins a multi-process job when asked (``--coordinator/--num-processes/--process-id`` or
   ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``; ``--distributed`` lets
   `jax.distributed.initialize` detect SLURM/Open MPI/TPU): gloo collectives on CPU;
4. builds the mesh (``--mesh``, default: on CPU ``fsdp=2,expert=2,context=2`` for 8 devices;
   on accelerators ``fsdp=<all>``) and the `Partitioner` (``--strategy``, default ``ep_as_cp``
   on CPU, ``fsdp`` on accelerators);
5. builds the data pipeline, the optimizer and train step (`setup` returns all of it as a
   `Setup`, e.g. for a benchmark) and runs `zoo.train.loop.train`.

Compiled programs are cached on disk (``JAX_COMPILATION_CACHE_DIR``, else
``ZOO_COMPILATION_CACHE``, else ``~/.cache/zoo/jax``), so a rerun or resume skips most of the
first compile.

Before anything is compiled or restored, the inputs are checked (`zoo.train.validate`): the
run dir is created and probed for writing first, then locked for this run (`zoo.train.lock`,
process 0 only: a second run on the same dir stops at once naming the holder), then ``--data``
must hold text and ``--tokenizer`` must load; ``--lr``, ``--warmup`` and the other numbers are
checked as they are parsed. A refused input is one line naming the flag, the value and the fix,
never a traceback (``--debug`` adds it). With several processes they agree before going on,
so either all start or all stop.

Exit codes: 0 finished or stopped by SIGTERM/SIGINT with a checkpoint saved (rerun to resume);
2 bad flags or inputs, a run dir in use by another run, or one whose checkpoint holds a model
of other shapes or a data-pipeline state saved under other data arguments (seq_len, load
balance, corpus, ...); 3 the loss (or the gradient/parameter norm) became NaN/Inf, or the loss
diverged (above ``--divergence-factor`` x the best of the last 100 steps for 10 steps): the
last good checkpoint is kept.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\d+")
DEFAULT_CPU_DEVICES = 8
EXIT_DIVERGED = 3


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a recipe script declares: the model and the defaults of its flags."""

    name: str                       # default run dir: runs/<name>
    model_cls: type                 # model_cls(config, inputs_shape=, partitioner=, rngs=)
    config: Any                     # the preset (a frozen dataclass), e.g. MixtralConfig.mini()
    from_hf: Callable | None = None  # (path, partitioner=, inputs_shape=, dtype=,
    #                                   config_overrides=): the family's loader
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int | None = None       # None: min(100, steps // 10)
    weight_decay: float = 0.1
    clip: float = 1.0
    checkpoint_every: int = 100
    aux_loss_field: str | None = None  # config field holding the aux-loss weight
    expert_bias_rate: float = 0.0   # DeepSeek-V3's aux-loss-free balancing speed (0: off)
    description: str = ""


# -- flags -------------------------------------------------------------------------------------

class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except the unset ones (their help says what happens)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def make_parser(recipe: Recipe) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python recipes/{recipe.name}.py", description=recipe.description,
        formatter_class=_Help)
    a = p.add_argument
    a("--steps", type=int, default=recipe.steps,
      help="planned total of updates (fixes the learning-rate schedule; on resume, the new total)")
    a("--batch-size", type=int, default=recipe.batch_size, help="global batch (rows)")
    a("--seq-len", type=int, default=recipe.seq_len, help="tokens per row")
    a("--lr", type=float, default=recipe.lr, help="peak learning rate")
    a("--warmup", type=int, default=recipe.warmup, help="warmup steps (default min(100, steps/10))")
    a("--weight-decay", type=float, default=recipe.weight_decay,
      help="AdamW decoupled weight decay (matrices only)")
    a("--aux-loss-weight", type=float, default=None,
      help=f"weight of the MoE load-balance loss (default: the config's {recipe.aux_loss_field})")
    a("--seed", type=int, default=0, help="parameter init and data order")
    a("--strategy", choices=("fsdp", "cp", "ep_as_cp"), default=None,
      help="partitioning strategy (default: ep_as_cp on CPU, fsdp on accelerators)")
    a("--mesh", default=None, help="mesh axis sizes, any subset of data,fsdp,expert,context,"
      "tensor (the rest are 1), e.g. fsdp=2,expert=2,context=2")
    a("--attention", choices=("auto", "all_gather", "ring", "reference"), default=None,
      help="attention implementation (default: the config's)")
    a("--no-load-balance", action="store_true", help="same as --load-balance none")
    a("--load-balance", choices=("auto", "row", "document", "none"), default="auto",
      help="reorder each packed row for context parallelism: auto picks, per row, the "
           "permutation whose busiest shard computes the fewest attention tiles (zoo.data)")
    a("--corpus-docs", choices=("file", "short"), default="file",
      help="documents of the corpus: whole files, or one per top-level function/class of .py")
    a("--data", nargs="*", default=None,
      help="text files, globs or folders (default: the Python standard library's sources)")
    a("--tokenizer", default=None, help="a tokenizer.json (default: bytes)")
    a("--run-dir", default=None, help=f"default runs/{recipe.name}")
    a("--checkpoint-every", type=int, default=recipe.checkpoint_every,
      help="steps between checkpoints (one is also saved at the end and on SIGTERM/SIGINT)")
    a("--dtype", default=None, help="computation dtype (default: bfloat16 on GPU/TPU and with "
      "--rehearse, the config's on CPU)")
    a("--param-dtype", default=None, help="parameter dtype (default: the config's, float32)")
    a("--remat", default=None, help="remat policy: none, full, dots_saveable, save_layer_outputs,"
      " offload_layer_outputs (default: the config's)")
    a("--rehearse", action="store_true", help="compile the train step for --devices virtual "
      "devices and print per-device memory, FLOPs and collectives instead of training")
    a("--from-hf", default=None, metavar="PATH",
      help="start from a Hugging Face checkpoint folder instead of random weights")
    a("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
      help="override a model config field (repeatable), e.g. --set hidden_size=256")
    a("--devices", type=int, default=None,
      help=f"virtual CPU devices of this process (default {DEFAULT_CPU_DEVICES} unless XLA_FLAGS "
           f"sets a count)")
    a("--coordinator", default=None, metavar="HOST:PORT",
      help="process 0's address (multi-process)")
    a("--num-processes", type=int, default=None, help="processes in the job (multi-process)")
    a("--process-id", type=int, default=None, help="this process, 0..N-1 (multi-process)")
    a("--distributed", action="store_true",
      help="call jax.distributed.initialize() with auto-detection (SLURM, Open MPI, Cloud TPU)")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--divergence-factor", type=float, default=5.0,
      help="stop (exit 3) when the loss stays above this many times the best of the last 100 "
           "steps for 10 steps; inf: never")
    a("--debug", action="store_true", help="show Python tracebacks of refused flags and inputs")
    return p


def config_fields(config: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(config)]


def _parse_value(name: str, text: str, current: Any, annotation: str) -> Any:
    """``--set`` value text -> a Python value suited to the field (by its current value/type)."""
    if text.lower() in ("none", "null"):
        return None
    if "dtype" in name:
        import jax.numpy as jnp
        try:
            return jnp.dtype(text).type
        except TypeError as e:
            raise ValueError(f"--set {name}={text}: not a dtype (e.g. float32, bfloat16)") from e
    if isinstance(current, bool) or annotation.startswith("bool"):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"--set {name}={text}: expected true or false")
    kinds = [k for k in ("int", "float", "str") if re.search(rf"\b{k}\b", annotation)]
    if isinstance(current, int) and not kinds:
        kinds = ["int"]
    elif isinstance(current, float) and not kinds:
        kinds = ["float"]
    for kind in kinds:
        try:
            return {"int": int, "float": float, "str": str}[kind](text)
        except ValueError:
            continue
    if kinds and kinds != ["str"]:
        raise ValueError(f"--set {name}={text}: expected {' or '.join(kinds)} "
                         f"(the field is {annotation})")
    try:
        return json.loads(text)  # dicts (e.g. rope_scaling), lists, numbers
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text


def apply_overrides(config: Any, overrides: Sequence[str]) -> Any:
    """``["field=value", ...]`` -> a new config; unknown fields raise naming the valid ones."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    changes = {}
    for item in overrides:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--set {item!r}: write FIELD=VALUE, e.g. --set hidden_size=256")
        if name not in fields:
            raise ValueError(f"--set {item!r}: {type(config).__name__} has no field {name!r}; "
                             f"valid fields: {', '.join(fields)}")
        changes[name] = _parse_value(name, text.strip(), getattr(config, name),
                                     str(fields[name].type))
    return dataclasses.replace(config, **changes) if changes else config


def config_to_json(config: Any) -> dict[str, Any]:
    """A config dataclass as JSON-able values (dtypes by name, nested dataclasses as dicts)."""
    import numpy as np

    def convert(name, value):
        if "dtype" in name and value is not None:
            return np.dtype(value).name
        if dataclasses.is_dataclass(value):
            return {f.name: convert(f.name, getattr(value, f.name))
                    for f in dataclasses.fields(value)}
        if isinstance(value, tuple):
            return list(value)
        return value

    return {f.name: convert(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)}


# -- devices and processes ---------------------------------------------------------------------

def set_cpu_devices(n: int | None) -> None:
    """Put ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` (replacing a count there):
    `n` if given, else the default 8 when the environment names no count. Must run before the
    first device is touched (importing jax is fine: it starts no backend)."""
    from jax._src import xla_bridge
    flags = os.environ.get("XLA_FLAGS", "")
    if n is None and _COUNT_FLAG.search(flags):
        return
    count = DEFAULT_CPU_DEVICES if n is None else n
    if count < 1:
        raise ValueError(f"--devices {count}: must be >= 1")
    if xla_bridge.backends_are_initialized():
        import jax
        if n is not None and jax.default_backend() == "cpu" and jax.local_device_count() != n:
            raise ValueError(
                f"--devices {n}: jax already started with {jax.local_device_count()} CPU devices "
                f"(something touched a device before main()); run the recipe as a script, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python")
        return
    os.environ["XLA_FLAGS"] = (_COUNT_FLAG.sub("", flags) +
                               f" --xla_force_host_platform_device_count={count}").strip()


def init_distributed(args) -> None:
    """Join a multi-process job when flags or ``JAX_*`` environment variables ask for it."""
    env = os.environ
    coordinator = args.coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    num = args.num_processes if args.num_processes is not None else (
        int(env["JAX_NUM_PROCESSES"]) if env.get("JAX_NUM_PROCESSES") else None)
    pid = args.process_id if args.process_id is not None else (
        int(env["JAX_PROCESS_ID"]) if env.get("JAX_PROCESS_ID") else None)
    if coordinator is None and num is None and pid is None and not args.distributed:
        return
    import jax
    if not args.distributed and (coordinator is None or num is None or pid is None):
        raise ValueError(
            f"multi-process needs all of --coordinator HOST:PORT, --num-processes N and "
            f"--process-id I (got {coordinator!r}, {num!r}, {pid!r}), or --distributed to "
            f"detect them (SLURM, Open MPI, Cloud TPU)")
    if num is not None and pid is not None and not 0 <= pid < num:
        raise ValueError(f"--process-id {pid} must be in [0, --num-processes {num})")
    # CPU collectives across processes need gloo (harmless where the backend is GPU/TPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                               process_id=pid)


def default_mesh(n: int, backend: str) -> str:
    """CPU: the EP-as-CP showcase (expert=2, context=2, the rest fsdp) as far as `n` allows;
    accelerators: plain FSDP over every device."""
    if backend != "cpu":
        return f"fsdp={n}"
    expert = 2 if n % 2 == 0 else 1
    context = 2 if n % (2 * expert) == 0 else 1
    return f"fsdp={n // (expert * context)},expert={expert},context={context}"


def _enable_compile_cache() -> None:
    import jax
    if not jax.config.jax_compilation_cache_dir:
        path = os.environ.get("ZOO_COMPILATION_CACHE",
                              os.path.join(os.path.expanduser("~"), ".cache", "zoo", "jax"))
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


# -- main --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
    """Everything `main` builds before training (a benchmark can time `train_step` from it)."""

    args: argparse.Namespace
    config: Any                      # the model config after --set/--attention/--dtype/--from-hf
    partitioner: Any                 # zoo.Partitioner
    mesh_text: str
    strategy: str
    batch_sharding: Any              # NamedSharding of the global [batch, seq_len] arrays
    make_model: Callable[[], Any]    # builds the model sharded (under jax.jit)
    tx: Any                          # optax transformation (zoo.train.step.make_tx)
    schedule: Callable[[int], float]
    train_step: Callable             # zoo.train.step.make_train_step(...)
    data: Any                        # this process's batches (Grain iterator)
    run_config: dict[str, Any]
    run_dir: str
    flops_per_token: float | None
    create: Callable[[], tuple[Any, Any]] | None  # fresh-run init from --from-hf
    lock: Any = None                 # zoo.train.lock.RunLock held by main (process 0)

    def create_sharded(self):
        """``(model, optimizer)`` as a fresh run starts them (created sharded)."""
        from zoo.train import step as step_lib
        return self.create() if self.create else step_lib.create_sharded(self.make_model, self.tx)


def check_flags(args) -> None:
    """The flags whose values alone decide whether they are valid (raise `ValueError`)."""
    from zoo.train import validate
    validate.check_positive("--lr", args.lr, "pass a peak learning rate such as 3e-3")
    validate.check_warmup(args.warmup, args.steps)
    if not args.divergence_factor > 1:  # also refuses nan
        raise ValueError(f"--divergence-factor {args.divergence_factor}: must be > 1 (e.g. the "
                         f"default 5; inf turns the divergence stop off)")


def _refuse(parser, args, error: BaseException, message: str | None = None):
    """Exit 2 through argparse with one line; the traceback only with --debug."""
    if getattr(args, "debug", False):
        traceback.print_exception(error)
    parser.error(message or str(error))


def setup(recipe: Recipe, argv: Sequence[str] | None = None, *, lock: bool = False) -> Setup:
    """Parse `argv`, check the inputs and build devices, processes, mesh, config, data,
    optimizer and step. With ``lock=True`` process 0 locks the run dir (`Setup.lock`; the
    caller releases it).

    Bad flags and inputs exit through argparse (`SystemExit` 2, one line naming the flag, the
    value and the fix).
    """
    parser = make_parser(recipe)
    args = parser.parse_args(argv)
    try:
        config = apply_overrides(recipe.config, args.overrides)
        check_flags(args)
        set_cpu_devices(args.devices)
        init_distributed(args)
    except ValueError as e:
        _refuse(parser, args, e)

    import jax

    from zoo.train import validate
    from zoo.train.lock import RunDirLocked, RunLock

    # The run dir first (before any restore or compile), then the lock, then the inputs.
    run_lock, problem = None, None
    try:
        run_dir = validate.check_run_dir(args.run_dir or os.path.join("runs", recipe.name))
        if lock and jax.process_index() == 0:
            run_lock = RunLock(run_dir).acquire()
        validate.check_data(args.data)
        tokenizer = validate.load_tokenizer(args.tokenizer)
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
        _refuse(parser, args, problem)
    try:
        return _build(recipe, parser, args, config, tokenizer, run_lock)
    except BaseException:
        if run_lock is not None:
            run_lock.release()
        raise


def _build(recipe, parser, args, config, tokenizer, run_lock) -> Setup:
    import jax
    from flax import nnx

    from zoo import data as data_lib
    from zoo.partitioning import MeshShape, Partitioner
    from zoo.train import step as step_lib

    _enable_compile_cache()
    backend, n = jax.default_backend(), jax.device_count()
    mesh_text = args.mesh or default_mesh(n, backend)
    strategy = args.strategy or ("ep_as_cp" if backend == "cpu" else "fsdp")
    try:
        for name, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                            ("--seq-len", args.seq_len),
                            ("--checkpoint-every", args.checkpoint_every)):
            if value < 1:
                raise ValueError(f"{name} {value} must be >= 1")
        shape = MeshShape.parse(mesh_text)
        try:
            mesh = shape.make()
        except ValueError as e:
            raise ValueError(f"--mesh {mesh_text}: {e}") from None
        partitioner = Partitioner(mesh, strategy)
        set_fields = {o.partition("=")[0].strip() for o in args.overrides}
        changes: dict[str, Any] = {}
        if args.attention:
            changes["attention_implementation"] = args.attention
        # accelerators (and their rehearsal) compute in bf16 over fp32 parameters by default
        dtype_flags = {"dtype": args.dtype or ("bfloat16" if backend != "cpu" or args.rehearse
                                               else None), "param_dtype": args.param_dtype}
        for field, text in dtype_flags.items():
            try:
                if text:
                    changes[field] = jax.numpy.dtype(text).type
            except TypeError:
                raise ValueError(f"--{field.replace('_', '-')} {text}: not a dtype (e.g. "
                                 f"float32, bfloat16)") from None
        if args.remat:
            changes["remat_policy"] = None if args.remat == "none" else args.remat
        if tokenizer.vocab_size > config.vocab_size and "vocab_size" not in set_fields:
            changes["vocab_size"] = -(-tokenizer.vocab_size // 128) * 128
        elif tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"--set vocab_size={config.vocab_size} is smaller than the "
                             f"tokenizer's {tokenizer.vocab_size} ids")
        if args.from_hf:
            if recipe.from_hf is None:
                raise ValueError(f"--from-hf: recipe {recipe.name} cannot load checkpoints")
            from zoo.models import hf
            raw = hf.read_config(args.from_hf, recipe.model_cls.hf_model_types,
                                 loader=recipe.name)
            overrides = {k: getattr(config, k) for k in set_fields} | changes
            config = recipe.model_cls.config_cls.from_hf_config(raw, **overrides)
        elif changes:
            config = dataclasses.replace(config, **changes)
        schedule = step_lib.lr_schedule(args.lr, args.steps, warmup=args.warmup)
    except ValueError as e:
        _refuse(parser, args, e)

    B, L = args.batch_size, args.seq_len
    if B % jax.process_count():
        parser.error(f"--batch-size {B} must be divisible by the {jax.process_count()} processes")
    batch_sharding = partitioner.sharding(("batch", "length"))
    try:
        step_lib.check_process_layout(batch_sharding, (B, L))
        # Build once abstractly now so shape/mesh errors surface here as flag errors.
        abstract = nnx.eval_shape(lambda: recipe.model_cls(config, inputs_shape=(B, L),
                                                partitioner=partitioner, rngs=nnx.Rngs(0)))
    except ValueError as e:
        _refuse(parser, args, e, f"{e} (mesh {mesh_text}, strategy {strategy}, batch {B}, "
                                 f"seq_len {L})")

    def make_model():
        return recipe.model_cls(config, inputs_shape=(B, L), partitioner=partitioner,
                                rngs=nnx.Rngs(args.seed))

    tx = step_lib.make_tx(weight_decay=args.weight_decay, clip=recipe.clip)
    aux_weight = args.aux_loss_weight
    if aux_weight is None:
        aux_weight = getattr(config, recipe.aux_loss_field) if recipe.aux_loss_field else 0.0
    train_step = step_lib.make_train_step(aux_loss_weight=aux_weight,
                                          expert_bias_rate=recipe.expert_bias_rate)
    create = None
    if args.from_hf:
        def create():
            fields = {k: v for k, v in config_to_python(config).items()
                      if k not in ("dtype", "param_dtype")}
            model = recipe.from_hf(args.from_hf, partitioner=partitioner, inputs_shape=(B, L),
                                   dtype=config.dtype, param_dtype=config.param_dtype,
                                   config_overrides=fields)
            return model, jax.jit(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param))(model)

    cp = partitioner.context_size("attention")
    balance = "none" if args.no_load_balance else args.load_balance
    try:
        data = data_lib.text_dataset(args.data or None, seq_len=L, batch_size=B,
                                     context_parallel=cp, balance=balance,
                                     rows_per_device=batch_sharding.shard_shape((B, L))[0],
                                     corpus_docs=args.corpus_docs, tokenizer=tokenizer,
                                     seed=args.seed)
    except ValueError as e:
        _refuse(parser, args, e)
    run_config = dict(
        recipe=recipe.name, model=config_to_json(config),
        train=dict(steps=args.steps, batch_size=B, seq_len=L, lr=args.lr, warmup=args.warmup,
                   weight_decay=args.weight_decay, clip=recipe.clip, seed=args.seed,
                   aux_loss_weight=aux_weight, expert_bias_rate=recipe.expert_bias_rate,
                   checkpoint_every=args.checkpoint_every,
                   divergence_factor=args.divergence_factor),
        parallel=dict(mesh=mesh_text, strategy=strategy, context_parallel=cp,
                      load_balance=balance != "none"),
        data=dict(paths=args.data, tokenizer=args.tokenizer or "bytes", from_hf=args.from_hf,
                  load_balance=balance, corpus_docs=args.corpus_docs))
    from zoo.layers.moe import moe_modules  # the MoE kernels as resolved for this mesh
    run_config["moe"] = next((dict(dispatch=m.dispatch, requested=m.dispatch_requested,
                                   grouped_matmul=m.grouped_matmul, buffer_factor=m.buffer_factor)
                              for m in moe_modules(abstract, with_bias=False)), None)
    return Setup(args=args, config=config, partitioner=partitioner, mesh_text=mesh_text,
                 strategy=strategy, batch_sharding=batch_sharding, make_model=make_model, tx=tx,
                 schedule=schedule, train_step=train_step, data=data, run_config=run_config,
                 run_dir=args.run_dir or os.path.join("runs", recipe.name),
                 flops_per_token=(config.flops_per_token(L)
                                  if hasattr(config, "flops_per_token") else None),
                 create=create, lock=run_lock)


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

    if s.args.rehearse:
        from zoo.train.rehearse import rehearse_step
        train = s.run_config["train"]
        print(rehearse_step(make_model=s.make_model, tx=s.tx, partitioner=s.partitioner,
                            batch_size=s.args.batch_size, seq_len=s.args.seq_len,
                            aux_loss_weight=train["aux_loss_weight"],
                            expert_bias_rate=train["expert_bias_rate"],
                            flops_per_token=s.flops_per_token, label=recipe.name,
                            mesh_text=s.mesh_text, remat=s.config.remat_policy,
                            dtype=s.config.dtype, param_dtype=s.config.param_dtype))
        return 0
    from zoo.data import PipelineStateMismatch
    from zoo.train import loop

    args = s.args
    if jax.process_index() == 0:
        print(f"{recipe.name}: {jax.device_count()} {jax.default_backend()} devices in "
              f"{jax.process_count()} process(es), mesh {s.mesh_text}, strategy {s.strategy}; "
              f"batch {args.batch_size} x {args.seq_len} tokens; run dir {s.run_dir}",
              file=sys.stderr, flush=True)
    try:
        loop.train(make_model=s.make_model, tx=s.tx, train_step=s.train_step,
                   schedule=s.schedule, data=s.data, batch_sharding=s.batch_sharding,
                   run_dir=s.run_dir, steps=args.steps, global_batch=args.batch_size,
                   seq_len=args.seq_len, config=s.run_config,
                   checkpoint_every=args.checkpoint_every, flops_per_token=s.flops_per_token,
                   name=recipe.name, progress=not args.no_progress, on_step=on_step,
                   create=s.create, divergence_factor=args.divergence_factor)
    except loop.TrainingDiverged as e:
        print(f"{recipe.name}: {e}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except (loop.IncompatibleCheckpoint, PipelineStateMismatch) as e:
        print(f"{recipe.name}: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        getattr(s.data, "close", lambda: None)()
    return 0


def config_to_python(config: Any) -> dict[str, Any]:
    """Config fields as a dict for ``config_overrides`` (keeps dtypes and nested dataclasses)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
