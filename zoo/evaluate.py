"""``python -m zoo.evaluate --run DIR``: a run's checkpoint on its held-out documents.

The run's newest checkpoint (or ``--step``) is restored with `zoo.train.load`, on this
process's devices, and evaluated with `zoo.train.evaluation.Evaluator` -- the forward pass and
the token cross-entropy the training run's ``eval_loss`` is -- on the documents the run held
out (``--validation-fraction``, chosen by a hash of their text: `zoo.data.split`), or on every
document of ``--data PATH ...``. It prints the loss (nats per target token) and the
perplexity::

    python -m zoo.evaluate --run runs/mini_deepseek3
    python -m zoo.evaluate --run runs/mini_deepseek3 --data notes/ --batches 16
    python -m zoo.evaluate --run runs/research --decoder-layer-cls my_lab.layers:TemperedLayer

The model is rebuilt with the classes the run trained with (run.json's ``model_cls`` and
``decoder_layer_cls``, imported by their ``module:QualName``); ``--model-cls`` and
``--decoder-layer-cls`` pass one that cannot be imported that way (a class defined in the
training script). Bad input (no run dir, no checkpoint in it, missing or non-text ``--data``,
a run that held out nothing, a class that cannot be imported) exits 2 with one line naming it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from zoo.train.cli import FlagParser
    p = FlagParser(
        prog="python -m zoo.evaluate",
        description="Evaluate a training run's checkpoint on its held-out documents (or on "
                    "--data): loss and perplexity.")
    p.add_argument("--run", metavar="DIR", required=True,
                   help="a run dir (its checkpoints/ and settings)")
    p.add_argument("--data", metavar="PATH", nargs="+", default=None,
                   help="text files, globs or folders to evaluate on, every document of them "
                        "(default: the run's held-out split)")
    p.add_argument("--batches", type=int, default=None,
                   help="batches to read, of the run's batch size and length (default: the "
                        "run's --eval-batches; fewer when the text runs out)")
    p.add_argument("--step", type=int, default=None,
                   help="this checkpoint step (default the newest)")
    from zoo.train.load import add_class_flags
    add_class_flags(p)
    return p


def _evaluate(args):
    from zoo.train import validate
    from zoo.train.evaluation import Evaluator
    from zoo.train.load import classes_from_flags, load
    if not os.path.isdir(args.run):
        raise ValueError(f"--run {args.run}: is not a directory; pass a run dir (the recipes' "
                         f"--run-dir, e.g. runs/mini_deepseek3)")
    validate.check_data(args.data)  # before the restore: missing or non-text files
    loaded = load(args.run, step=args.step, **classes_from_flags(args))
    config = loaded.config
    if args.data is None and not config.validation_fraction:
        raise ValueError(f"--run {args.run}: the run held out no documents "
                         f"(--validation-fraction 0); pass --data PATH to evaluate on other text")
    batches = args.batches or config.eval_batches
    data = loaded.built.eval_data(args.data)
    return loaded, Evaluator(loaded.built).evaluate(loaded.model, data, batches)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring): 0 on success, 2 on bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.batches is not None and args.batches < 1:
        parser.error(f"--batches {args.batches}: must be >= 1; e.g. 8")
    try:
        loaded, result = _evaluate(args)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    what = ("--data " + " ".join(args.data) if args.data else
            f"the held-out {loaded.config.validation_fraction:g} of the run's documents")
    print(f"step {loaded.step}: eval_loss {result.loss:.4f}, perplexity {result.ppl:.2f} "
          f"({result.tokens:,} tokens in {result.batches} batches of {what})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
