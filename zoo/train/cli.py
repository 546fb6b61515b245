"""The recipes' command line: a `Recipe` (data) and ``main(recipe, argv)``.

A recipe is a name, a `TrainConfig` naming a family, a preset and overrides, and a line of
description. ``main``

1. parses the flags (`make_parser`): one per setting, flat (``--lr``) and by section
   (``--schedule.lr``), ``--set FIELD=VALUE`` for any model config field (``--dtype``,
   ``--param-dtype``, ``--remat`` and ``--attention`` spell it for theirs), ``--debug``; and
   makes the model config once (`zoo.train.build.choose_model`), which `build` completes;
2. sets the virtual CPU device count (``--devices``, default 8 unless the environment names a
   count) and joins a multi-process job when asked (``--coordinator/--num-processes/
   --process-id``, the ``JAX_*`` variables, or ``--distributed``);
3. checks the inputs before anything is built or compiled (`zoo.train.validate`): that the
   run dir can be written (without creating or touching it), ``--data`` and ``--tokenizer``;
   with several processes they agree, so all start or all stop;
4. builds everything with `zoo.train.build` (shape and mesh errors are flag errors); with
   several processes, each one's resolved settings (flags, mesh, model config, data digest)
   are compared (`job_settings`, `zoo.train.peers.exchange_settings`): a difference is exit 2
   on every process; only then is the run dir created, probed and locked (process 0), so a
   refused run writes nothing;
5. trains with a `zoo.train.Trainer`, which compares the run dir's checkpoint with this run
   before compiling (a run already at its last step says so without compiling), prints the
   run's summary line and a greedy sample (process 0); or, with ``--rehearse``, compiles the
   step and prints the `Rehearsal`.

A refused flag or input is one line naming the flag, the value and the fix, then ``(see
--help)`` (`FlagParser`; ``--debug`` adds the traceback). Exit codes: 0 finished, or stopped
by SIGTERM/SIGINT (a checkpoint saved: rerun to resume; during the compile: nothing trained);
2 bad flags or inputs, a run dir in use by another run, or a checkpoint of other model
shapes or other data arguments; 3 the loss (or the
gradient/parameter norm, or an updated state) became NaN/Inf or diverged: the last good
checkpoint is kept; 4 the data stream failed, stalled (``--data-timeout``) or its files
vanished or shrank: the state reached is saved first; 5 a checkpoint save failed (no space,
read-only, permission) or hung: the run stops at that save, the checkpoints on disk are kept;
6 a process of a multi-process job did not join, or stopped answering, within
``--peer-timeout`` seconds (`zoo.train.peers`): the message names it and the last checkpoint
on disk; restart every process to resume; 7 a log could not be written (``metrics.jsonl``,
``tensorboard/``, ``loss.png``: unwritable, checked before compiling, or the disk full):
`zoo.train.hooks.LoggingFailed`, the checkpoints on disk are kept.
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
from zoo.train.config import TrainConfig
from zoo.train.fields import apply_overrides, config_to_json, config_to_python
from zoo.train.launch import DEFAULT_CPU_DEVICES, default_mesh, set_cpu_devices

__all__ = ["Recipe", "FlagParser", "first_paragraph", "make_parser", "parse", "setup", "main",
           "run", "apply_overrides", "config_to_json", "config_to_python", "set_cpu_devices",
           "default_mesh", "DEFAULT_CPU_DEVICES", "EXIT_DIVERGED", "EXIT_USAGE", "EXIT_DATA",
           "EXIT_SAVE", "EXIT_PEER", "EXIT_LOG", "job_settings"]

EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_DATA = 4
EXIT_SAVE = 5
EXIT_PEER = 6  # zoo.train.peers.EXIT_PEER
EXIT_LOG = 7


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a recipe script declares: its name and the settings it starts from.

    ``train`` names the model (``family``, ``preset``, ``overrides``). Research code may hand
    a model (sub)class (``model_cls``), a model config (``config``, instead of the preset) or a
    decoder layer class (``decoder_layer_cls``).
    """

    name: str                          # default run dir: runs/<name>
    model_cls: type | None = None      # model_cls(config, inputs_shape=, partitioner=, rngs=)
    config: Any = None                 # a model config instead of train.family/train.preset
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)  # the flags' defaults
    decoder_layer_cls: type | None = None
    description: str = ""

    def model_config(self) -> Any:
        """The model config the flags start from (the preset, before ``--set``)."""
        from zoo.train.build import choose_model
        return choose_model(self.train.replace(overrides=()), self.config).config


# -- flags -------------------------------------------------------------------------------------

class FlagParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose refusals are one line: ``PROG: error: MESSAGE (see
    --help)`` and exit 2, without the usage block (``--help`` shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph, its lines joined: a recipe's ``--help`` description."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def make_parser(recipe: Recipe) -> argparse.ArgumentParser:
    p = FlagParser(
        prog=f"python recipes/{recipe.name}.py", description=recipe.description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    config_lib.add_flags(p, recipe.train)
    p.add_argument("--debug", action="store_true",
                   help="show Python tracebacks of refused flags and inputs")
    return p


def _refuse(parser, debug: bool, error: BaseException, message: str | None = None):
    """Exit 2 through argparse with one line; the traceback only with --debug."""
    if debug:
        traceback.print_exception(error)
    parser.error(message or str(error))


def parse(recipe: Recipe, argv: Sequence[str] | None = None
          ) -> tuple[argparse.ArgumentParser, argparse.Namespace, TrainConfig]:
    """``(parser, args, settings)``; bad flags exit 2. The model config is made here, once
    (`zoo.train.build.choose_model`: the preset, then ``--set`` and the flags that spell it),
    so a bad ``--set`` is a flag error; ``args.model_choice`` holds it for `build`."""
    from zoo.train.build import choose_model
    parser = make_parser(recipe)
    args = parser.parse_args(argv)
    try:
        train = config_lib.from_args(args)
        args.model_choice = choose_model(train, recipe.config)
    except ValueError as e:
        _refuse(parser, args.debug, e)
    return parser, args, train


def _start_processes(parser, args, train: TrainConfig) -> None:
    """Devices, then the job; a peer that does not join ends the process (exit 6)."""
    from zoo.train.peers import PeerLost
    try:
        set_cpu_devices(train.devices)
        from zoo.train.launch import init_distributed
        init_distributed(coordinator=train.coordinator, num_processes=train.num_processes,
                         process_id=train.process_id, distributed=train.distributed,
                         peer_timeout=train.peer_timeout)
    except ValueError as e:
        _refuse(parser, args.debug, e)
    except PeerLost as e:
        if args.debug:
            traceback.print_exception(e)
        print(f"zoo: error: {e}", file=sys.stderr, flush=True)
        # not SystemExit: jax's exit handler would wait minutes at the shutdown barrier
        os._exit(EXIT_PEER)


def _agreed(parser, args, check: Callable[[], Any], undo: Callable[[Any], None] | None = None):
    """``check()`` on every process; when any process refuses (a `ValueError` or the run dir's
    lock held elsewhere) all exit 2, this one with its own message. Returns what `check`
    returned; ``undo(it)`` runs before a refusal."""
    import jax

    from zoo.train.lock import RunDirLocked
    out, problem = None, None
    try:
        out = check()
    except (ValueError, RunDirLocked) as e:
        problem = e
    agreed = problem is None
    if jax.process_count() > 1:
        from zoo.train.checkpoint import all_processes_agree
        agreed = all_processes_agree(agreed)
    if not agreed:
        if undo is not None and problem is None:
            undo(out)
        _refuse(parser, args.debug, problem or ValueError(
            "another process of this job refused its inputs (see its message)"))
    return out


def _check_inputs(train: TrainConfig) -> None:
    """The run dir (without creating or touching it), then data, tokenizer and W&B."""
    import jax

    from zoo.train import validate
    validate.check_run_dir(train.run_dir, create=False)
    files = validate.check_data(train.data_files)
    if jax.process_index() == 0:
        validate.warn_small_corpus(files, train.batch_size, train.seq_len)
    validate.load_tokenizer(train.tokenizer)
    if train.wandb:
        from zoo.train.hooks import Wandb
        Wandb(train.wandb, train.run_dir)  # refuses when wandb is not installed


def _open_run_dir(train: TrainConfig, lock: bool):
    """The run dir created and probed, then locked (process 0, when `lock`): the lock or None."""
    import jax

    from zoo.train import validate
    from zoo.train.lock import RunLock
    writable = validate.check_run_dir(train.run_dir)
    return RunLock(writable).acquire() if lock and jax.process_index() == 0 else None


def setup(recipe: Recipe, argv: Sequence[str] | None = None, *, lock: bool = False):
    """Parse `argv`, start devices and processes, check the inputs, `build`, then create the
    run dir (nothing is written for a refused run); returns ``(built, lock)`` (the run dir's
    lock when ``lock=True`` on process 0, else None; the caller releases it). Bad flags and
    inputs exit 2 with one line."""
    parser, args, train = parse(recipe, argv)
    _start_processes(parser, args, train)
    train = train.replace(run_dir=train.run_dir or os.path.join("runs", recipe.name))
    _agreed(parser, args, lambda: _check_inputs(train))
    from zoo.train.build import build
    from zoo.train.launch import enable_compile_cache
    enable_compile_cache()
    built, problem = None, None
    try:
        built = build(train, model_config=args.model_choice, model_cls=recipe.model_cls,
                      decoder_layer_cls=recipe.decoder_layer_cls, devices=_devices(train))
        if train.from_hf:
            _check_hf(built)
    except ValueError as e:
        problem = e
    _same_settings(parser, args, train, built, problem)
    run_lock = _agreed(parser, args, lambda: _open_run_dir(train, lock),
                       undo=lambda held: held and held.release())
    return built, run_lock


# what may differ between the processes of one job
_PER_PROCESS = ("process_id", "devices", "coordinator", "distributed", "progress")


def job_settings(built) -> dict[str, Any]:
    """What every process of a job must share, by the name a user knows it by: each setting
    by its flag (but the per-process ones: --process-id, --devices, ...), the mesh's axes, the
    model config as resolved, and the data pipeline's arguments (files digest included)."""
    out: dict[str, Any] = {}
    for section in dataclasses.fields(built.config):
        value = getattr(built.config, section.name)
        for f in dataclasses.fields(value):
            if f.name not in _PER_PROCESS:
                out[f.metadata.get("flag") or config_lib.flag_name(f.name)] = getattr(value,
                                                                                     f.name)
    out["mesh axes"] = dict(built.mesh.shape)
    out.update({f"model config {k}": v for k, v in (built.record.get("model") or {}).items()})
    out.update({f"data {k}": v for k, v in (built.record.get("data_arguments") or {}).items()})
    return out


def _same_settings(parser, args, train: TrainConfig, built, problem: BaseException | None
                   ) -> None:
    """Several processes: each publishes its `job_settings` (or its refusal, `problem`) and
    reads the others' before anything is compiled (`zoo.train.peers.exchange_settings`). A
    refusal or a difference anywhere exits 2 on every process, naming the fields and values;
    a peer that reports nothing within --peer-timeout exits 6."""
    import jax

    from zoo.train import peers
    if jax.process_count() < 2:
        if problem is not None:
            _refuse(parser, args.debug, problem)
        return
    mine = {"refused": str(problem)} if problem is not None else job_settings(built)
    try:
        everyone = peers.exchange_settings(mine, train.peer_timeout)
    except peers.PeerLost as e:
        print(f"zoo: error: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER)  # jax's exit handler would wait for that peer at its barrier
    if problem is not None:
        _refuse(parser, args.debug, problem)
    different = peers.settings_differences(everyone) if everyone else None
    if different:
        _refuse(parser, args.debug, peers.SettingsDiffer(different))


def _devices(train: TrainConfig):
    """The devices to build for: a ``--target``'s (``--rehearse``), else this host's."""
    if train.target == "cpu":
        return None
    from zoo.targets import target_devices
    return target_devices(train.target)


def _check_hf(built) -> None:
    """``--from-hf``: the checkpoint's keys and shapes against the model, before compiling."""
    from zoo.models import hf
    hf.check_checkpoint(built.config.from_hf, built.make_model,
                        what=f"--from-hf {built.config.from_hf}")


# -- main ----

_abandoned: list = []  # compile threads left running by a signal (see `run`)


def run(recipe: Recipe) -> None:
    """A recipe script's entry point: `main` with ``sys.argv``, then exit. When a signal
    stopped the compile, the compiler thread is still inside XLA; the process then exits
    without waiting for it (interpreter shutdown would abort on it)."""
    code = main(recipe)
    if any(t.is_alive() for t in _abandoned):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


# -- main --------------------------------------------------------------------------------------

def main(recipe: Recipe, argv: Sequence[str] | None = None, *,
         on_step: Callable[[int, dict], None] | None = None) -> int:
    """Run a recipe with command-line flags `argv` (default ``sys.argv[1:]``); returns the exit
    code (see the module docstring; bad flags raise argparse's `SystemExit` 2)."""
    built, run_lock = setup(recipe, argv, lock=True)
    try:
        if built.config.rehearse:
            from zoo.train.rehearse import rehearse_built
            print(rehearse_built(built, label=recipe.name))
            return 0
        return _train(recipe, built, on_step)
    finally:
        if run_lock is not None:
            run_lock.release()


def _train(recipe: Recipe, built, on_step) -> int:
    import jax

    from zoo.data import PipelineStateMismatch
    from zoo.models.hf import BadCheckpoint
    from zoo.train import hooks
    from zoo.train.trainer import (CheckpointSaveFailed, CompileInterrupted, DataStreamError,
                                   IncompatibleCheckpoint, NoTrainingData, Trainer,
                                   TrainingDiverged)
    t = built.config
    if jax.process_index() == 0:
        print(f"{recipe.name}: {jax.device_count()} {jax.default_backend()} devices in "
              f"{jax.process_count()} process(es), mesh {t.mesh}, strategy {t.strategy}; "
              f"batch {t.batch_size} x {t.seq_len} tokens; run dir {t.run_dir}",
              file=sys.stderr, flush=True)
    from zoo.train.peers import set_checkpoints
    set_checkpoints(os.path.join(t.run_dir, "checkpoints"), recipe.name)
    extra = [hooks.OnStep(on_step)] if on_step is not None else []
    trainer = Trainer(built, hooks=extra, name=recipe.name, lock=False)
    try:
        summary = _train_watched(trainer)
    except TrainingDiverged as e:
        print(f"{recipe.name}: {e}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except (IncompatibleCheckpoint, PipelineStateMismatch, NoTrainingData, BadCheckpoint) as e:
        print(f"{recipe.name}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except DataStreamError as e:
        print(f"{recipe.name}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_DATA
    except CheckpointSaveFailed as e:
        print(f"{recipe.name}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_SAVE
    except hooks.LoggingFailed as e:
        print(f"{recipe.name}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_LOG
    except CompileInterrupted as e:
        print(f"{recipe.name}: {e}", file=sys.stderr, flush=True)
        _abandoned.extend(trainer.abandoned)
        return 0
    finally:
        trainer.close()
    if jax.process_index() == 0:
        print(summary.line(), flush=True)
    _print_sample(recipe, built, trainer)
    return 0


def _train_watched(trainer):
    """`trainer.train`, its `Summary`; with several processes, a failure that may come from a
    lost peer (a failed collective or save) waits for the peer watchdog's verdict first: exit
    6 naming the peer (`zoo.train.peers`), or, when the peers are all alive, the failure as it
    is."""
    import jax

    from zoo.train import peers
    try:
        return trainer.train()
    except Exception as e:
        if jax.process_count() > 1 and peers.caused_by_a_peer(e):
            peers.await_verdict()
        raise


def _print_sample(recipe: Recipe, built, trainer) -> None:
    """What the model learned: a greedy continuation of ``--sample-prompt`` (every process
    runs it, the model being sharded over all of them; process 0 prints it)."""
    import jax
    t = built.config
    if not t.sample_tokens or trainer.model is None or built.tokenizer is None:
        return
    from zoo.inference import generate
    prompt = [int(i) for i in built.tokenizer.encode(t.sample_prompt)]
    if not prompt:
        return
    out = generate(trainer.model, [prompt], max_new_tokens=t.sample_tokens)[0]
    if jax.process_index() == 0:
        text = built.tokenizer.decode(prompt + out)
        print(f"{recipe.name}: sample ({t.sample_tokens} greedy tokens after "
              f"{t.sample_prompt!r}):\n{text}", flush=True)
