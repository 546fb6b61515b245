"""The same zoo checkout on two Python environments (e.g. the pinned jax/flax/tokamax and the
current releases), side by side: the issue-27 DeepSeek-V3 reduction of `vs_maxtext.py` trained
by each environment's Python, one after the other, with each median and its ratio to the first.

    python benchmarks/stacks.py --python /usr/bin/python3.11 --python /path/to/venv/bin/python

Each environment must have zoo's dependencies installed; the code is this checkout's (put
first on ``PYTHONPATH``), so only the stack differs. The table names each stack's jax, flax
and tokamax versions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from vs_maxtext import STRATEGIES, run_zoo

VERSIONS = ("import importlib.metadata as m; print(' '.join(f'{p} {m.version(p)}' for p in "
            "('jax', 'flax', 'tokamax')))")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--python", action="append", required=True,
                    help="an environment's Python (repeat; the first is the baseline)")
    ap.add_argument("--strategies", default="ep_as_cp", help=f"comma list of "
                    f"{', '.join(STRATEGIES)}")
    ap.add_argument("--steps", type=int, default=12, help="steps each run takes")
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the median")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    args = ap.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in args.strategies:
        if s not in STRATEGIES:
            ap.error(f"--strategies: unknown strategy {s!r}; valid: {', '.join(STRATEGIES)}")
    for py in args.python:
        if not os.path.exists(py):
            ap.error(f"--python {py}: no such file")
    if args.steps <= args.skip:
        ap.error(f"--steps {args.steps} must exceed --skip {args.skip}")
    return args


def versions(python: str) -> str:
    done = subprocess.run([python, "-c", VERSIONS], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{python} lacks zoo's dependencies: {done.stderr.strip()[-500:]}")
    return done.stdout.strip()


def main(argv=None) -> int:
    args = parse_args(argv)
    stacks = [(py, versions(py)) for py in args.python]
    print(f"# zoo on {len(stacks)} stacks: DeepSeek-V3 reduction, 8 virtual CPU devices "
          f"({os.cpu_count()} cores), global batch 8, medians of steps {args.skip + 1}-"
          f"{args.steps}, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    for s in args.strategies:
        seq = STRATEGIES[s][2]
        base = None
        for py, stack in stacks:
            step = run_zoo(args, s, python=py)
            base = base or step
            rows.append((s, stack, 8 * seq / step, base / step))
            print(f"  {s} on {stack}: {step * 1e3:.0f} ms", file=sys.stderr, flush=True)
    print()
    print("| strategy | stack | tokens/s | vs first |")
    print("|---|---|---|---|")
    for s, stack, tps, ratio in rows:
        print(f"| {s} | {stack} | {tps:,.0f} | {ratio:.2f}x |")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    from _record import json_main  # --json PATH: the table as a record
    raise SystemExit(json_main(main, ["stacks"]))
