"""The zoo.data pipeline: throughput against the recipe, and context-parallel load balance.

**Throughput** (default). For each ``seq_len`` it builds `zoo.data.text_dataset` on the built-in
corpus (or ``--paths``), times the first batch (start-up: indexing + first reads + first
packing), then pulls batches as fast as possible and reports row slots per second (``tokens/s``,
what a train step consumes), the fill fraction (non-padding share of the slots) and the headroom
over the recipe: the median ``tokens_per_s`` of ``runs/mini_deepseek3/metrics.jsonl`` when that
file exists, else ``--recipe-tokens-per-s``. Rows are reordered for ``--cps`` (default 4, the
recipe's context parallelism) with ``--load-balance`` (default auto, whose per-row search is
part of the cost).

    python benchmarks/data.py                       # seq_len 1024 and 4096, batch 8
    python benchmarks/data.py --seq-lens 512 --batch-size 16 --tokens 4e6

**Load balance** (``--balance``). Packed rows of the built-in corpus, as whole files
("long documents") and cut into top-level definitions (``corpus_docs="short"``), reordered by
each strategy for ``cp`` context shards; per row, the attention kernels' tiles on each shard
(`zoo.data.shard_tiles`: the tiles zoo's flash kernel computes rather than skips, 64x64 by
default) and the causal pairs (`zoo.data.shard_pairs`). Columns: busiest and mean shard tiles
(averaged over rows; a step waits for the busiest shard), their ratio, total tiles against
the contiguous row ("none"), the busiest shard against today's "row" reorder, the same ratio
in causal pairs, and which candidates "auto" picked.

    python benchmarks/data.py --balance             # seq 8k/16k/32k, cp 2/4/8, 16 rows each
    python benchmarks/data.py --balance --seq-lens 8192 --cps 8 --rows 4
    python benchmarks/data.py --balance --rows-per-device 4   # 4 rows share each device
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

from zoo.data import (balance_candidates, balance_permutation, best_candidate,  # noqa: E402
                      shard_pairs, shard_tiles, text_dataset, work as work_model)

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


def measure(seq_len: int, batch_size: int, tokens: float, paths, cp: int = 1,
            balance: str = "auto", corpus_docs: str = "file") -> dict:
    start = time.perf_counter()
    it = text_dataset(paths, seq_len=seq_len, batch_size=batch_size, process_index=0,
                      process_count=1, context_parallel=cp, balance=balance,
                      corpus_docs=corpus_docs)
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
    return dict(seq_len=seq_len, batch=batch_size, cp=cp, balance=balance, batches=n,
                first_s=first,
                tokens_per_s=slots / elapsed, fill=filled / slots)


def print_header(header: str) -> None:
    """A markdown table's header and its separator line."""
    print(header)
    print("|" + "|".join("---" for _ in range(header.count("|") - 1)) + "|")


def packed_rows(corpus_docs: str, seq_len: int, rows: int, seed: int):
    """positions, segment ids [rows, seq_len] of rows packed from the built-in corpus."""
    it = text_dataset(seq_len=seq_len, batch_size=rows, balance="none", corpus_docs=corpus_docs,
                      seed=seed, process_index=0, process_count=1)
    batch = next(it)
    it.close()
    return batch["positions"], batch["segment_ids"]


def device_tiles(pos, seg, cp: int, tile: int | None, rows_per_device: int) -> np.ndarray:
    """[devices, cp] tiles when ``rows_per_device`` rows share a device: a tile is computed when
    any of them needs it (the kernels test the whole local batch)."""
    if rows_per_device == 1:
        return shard_tiles(pos, seg, cp, tile)
    m = work_model.tile_map(pos, seg, cp, tile)
    m = m.reshape(-1, rows_per_device, *m.shape[1:]).any(1)
    return m.sum(-1).reshape(len(m), cp, -1).sum(-1)


def balance_rows(positions, segment_ids, cp: int, tile: int | None,
                 rows_per_device: int = 1) -> list[dict]:
    """One table row per strategy: the work of every shard of every row, summarised."""
    work, picks = {}, Counter()
    for strategy in ("none", "row", "document", "auto"):
        if strategy == "auto" and rows_per_device > 1:
            perm = balance_permutation(positions, segment_ids, cp=cp, tile=tile,
                                       rows_per_device=rows_per_device)
        elif strategy == "auto":  # balance_permutation's choice, with the candidate's name
            perm = []
            for p, s in zip(positions, segment_ids):
                scored = balance_candidates(p, s, cp=cp, tile=tile)
                name = best_candidate(scored)
                picks[name] += 1
                perm.append(scored[name][0])
            perm = np.stack(perm)
        else:
            perm = balance_permutation(positions, segment_ids, cp=cp, strategy=strategy)
        pos, seg = (np.take_along_axis(a, perm, 1) for a in (positions, segment_ids))
        work[strategy] = (device_tiles(pos, seg, cp, tile, rows_per_device),
                          shard_pairs(pos, seg, cp))
    out = []
    for strategy, (tiles, pairs) in work.items():
        busiest = tiles.max(1).mean()
        out.append(dict(
            strategy=strategy, busiest=busiest, mean=tiles.mean(1).mean(),
            total_vs_none=tiles.sum() / work["none"][0].sum(),
            busiest_vs_row=busiest / work["row"][0].max(1).mean(),
            pairs_ratio=pairs.max(1).mean() / pairs.mean(1).mean(),
            picks=", ".join(f"{k} {v}" for k, v in picks.most_common(3))
            if strategy == "auto" else ""))
    return out


def balance_table(seq_lens, cps, rows: int, tile: int | None, seed: int,
                  rows_per_device: int = 1) -> None:
    print(f"{rows} packed rows per corpus and length (seed {seed}), kernel tile "
          f"{tile or 64}, {rows_per_device} row(s) per device; tiles per shard (of all the "
          f"device's rows) and pairs per shard, averaged over devices")
    header = ("| corpus | seq | cp | strategy | busiest tiles | mean tiles | busiest/mean | "
              "total vs contiguous | busiest vs row | pairs busiest/mean | auto picks |")
    print_header(header)
    for corpus_docs, label in (("file", "long docs"), ("short", "short docs")):
        for seq_len in seq_lens:
            positions, segment_ids = packed_rows(corpus_docs, seq_len, rows, seed)
            docs = np.median([len(np.unique(r[r > 0])) for r in segment_ids])
            for cp in cps:
                for r in balance_rows(positions, segment_ids, cp, tile, rows_per_device):
                    print(f"| {label} ({docs:.0f}/row) | {seq_len} | {cp} | {r['strategy']} | "
                          f"{r['busiest']:,.0f} | {r['mean']:,.0f} | "
                          f"{r['busiest'] / r['mean']:.2f} | {r['total_vs_none']:.2f} | "
                          f"{r['busiest_vs_row']:.2f} | {r['pairs_ratio']:.2f} | "
                          f"{r['picks']} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None,
                        help="default 1024 4096 (throughput), 8192 16384 32768 (--balance)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=float, default=8e6, help="slots timed per seq_len")
    parser.add_argument("--paths", nargs="*", default=None, help="default: built-in corpus")
    parser.add_argument("--metrics", default=os.path.join(ROOT, "runs", "mini_deepseek3",
                                                          "metrics.jsonl"))
    parser.add_argument("--recipe-tokens-per-s", type=float, default=None)
    parser.add_argument("--balance", action="store_true",
                        help="print the load-balance table instead (see the module docstring)")
    parser.add_argument("--cps", type=int, nargs="+", default=None,
                        help="context-parallel degrees (default 4, the recipe's; --balance: "
                             "2 4 8)")
    parser.add_argument("--load-balance", default="auto", choices=("auto", "row", "document",
                                                                  "none"),
                        help="throughput: the reorder applied")
    parser.add_argument("--corpus-docs", default="file", choices=("file", "short"),
                        help="throughput: documents of the corpus")
    parser.add_argument("--rows", type=int, default=16, help="--balance: rows per corpus/length")
    parser.add_argument("--tile", type=int, default=None, help="--balance: kernel tile (64)")
    parser.add_argument("--rows-per-device", type=int, default=1,
                        help="--balance: rows one device holds (tiles: their union; auto: "
                             "balanced together)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.balance:
        balance_table(args.seq_lens or [8192, 16384, 32768], args.cps or [2, 4, 8],
                      args.rows, args.tile, args.seed, args.rows_per_device)
        return

    args.cps = args.cps or [4]
    recipe, source = recipe_tokens_per_s(args.metrics, args.recipe_tokens_per_s)
    rows = [measure(L, args.batch_size, args.tokens, args.paths, cp, args.load_balance,
                    args.corpus_docs)
            for L in args.seq_lens or [1024, 4096] for cp in args.cps]
    print(f"corpus: {'built-in (Python standard library)' if args.paths is None else args.paths}"
          f"; recipe tokens/s: {source}")
    header = ("| seq_len | batch | cp | balance | first batch (s) | pipeline tokens/s | fill | "
              "recipe tokens/s | headroom |")
    print_header(header)
    for r in rows:
        if recipe is None:
            rec, head = NO_RECIPE, "n/a"
        else:
            rec, head = f"{recipe:,.0f}", f"{r['tokens_per_s'] / recipe:,.0f}x"
        print(f"| {r['seq_len']} | {r['batch']} | {r['cp']} | {r['balance']} | "
              f"{r['first_s']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {100 * r['fill']:.1f}% | {rec} | {head} |")


if __name__ == "__main__":
    import sys

    from _record import json_main  # --json PATH: the table as a record
    raise SystemExit(json_main(main, ["data_throughput"] if "--balance" not in sys.argv else
                               ["data_balance_rows_per_device"]
                               if "--rows-per-device" in sys.argv else ["data_balance"]))
