"""Throughput of the zoo.data pipeline against what the mini recipe consumes.

For each ``seq_len`` it builds `zoo.data.text_dataset` on the built-in corpus (or ``--paths``),
times the first batch (start-up: indexing + first reads + first packing), then pulls batches as
fast as possible and reports row slots per second (``tokens/s``, what a train step consumes),
the fill fraction (non-padding share of the slots) and the headroom over the recipe: the
median ``tokens_per_s`` of ``runs/mini_deepseek3/metrics.jsonl`` when that file exists, else
``--recipe-tokens-per-s``.

    python benchmarks/data.py                       # seq_len 1024 and 4096, batch 8
    python benchmarks/data.py --seq-lens 512 --batch-size 16 --tokens 4e6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

from zoo.data import text_dataset  # noqa: E402

NO_RECIPE = "n/a (run recipes/mini_deepseek3.py first)"


def recipe_tokens_per_s(metrics_path: str, fallback: float | None) -> tuple[float | None, str]:
    """Median ``tokens_per_s`` of the recipe's metrics file, else the flag, else None."""
    if os.path.isfile(metrics_path):
        values = []
        with open(metrics_path) as f:
            for line in f:
                try:
                    value = json.loads(line).get("tokens_per_s")
                except (json.JSONDecodeError, AttributeError):
                    continue
                if isinstance(value, (int, float)) and value > 0:
                    values.append(float(value))
        if values:
            return statistics.median(values), f"median of {len(values)} steps in {metrics_path}"
    if fallback is not None:
        return fallback, "--recipe-tokens-per-s"
    return None, NO_RECIPE


def measure(seq_len: int, batch_size: int, tokens: float, paths) -> dict:
    start = time.perf_counter()
    it = text_dataset(paths, seq_len=seq_len, batch_size=batch_size, process_index=0,
                      process_count=1)
    batch = next(it)
    first = time.perf_counter() - start
    n = max(1, int(tokens // (seq_len * batch_size)))
    filled = 0
    start = time.perf_counter()
    for _ in range(n):
        batch = next(it)
        filled += int(np.count_nonzero(batch["segment_ids"]))
    elapsed = time.perf_counter() - start
    it.close()
    slots = n * seq_len * batch_size
    return dict(seq_len=seq_len, batch=batch_size, batches=n, first_s=first,
                tokens_per_s=slots / elapsed, fill=filled / slots)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=float, default=8e6, help="slots timed per seq_len")
    parser.add_argument("--paths", nargs="*", default=None, help="default: built-in corpus")
    parser.add_argument("--metrics", default=os.path.join(ROOT, "runs", "mini_deepseek3",
                                                          "metrics.jsonl"))
    parser.add_argument("--recipe-tokens-per-s", type=float, default=None)
    args = parser.parse_args(argv)

    recipe, source = recipe_tokens_per_s(args.metrics, args.recipe_tokens_per_s)
    rows = [measure(L, args.batch_size, args.tokens, args.paths) for L in args.seq_lens]
    print(f"corpus: {'built-in (Python standard library)' if args.paths is None else args.paths}"
          f"; recipe tokens/s: {source}")
    header = ("| seq_len | batch | first batch (s) | pipeline tokens/s | fill | "
              "recipe tokens/s | headroom |")
    print(header)
    print("|" + "|".join("---" for _ in range(header.count("|") - 1)) + "|")
    for r in rows:
        if recipe is None:
            rec, head = NO_RECIPE, "n/a"
        else:
            rec, head = f"{recipe:,.0f}", f"{r['tokens_per_s'] / recipe:,.0f}x"
        print(f"| {r['seq_len']} | {r['batch']} | {r['first_s']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {100 * r['fill']:.1f}% | {rec} | {head} |")


if __name__ == "__main__":
    main()
