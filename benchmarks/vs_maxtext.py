"""zoo against MaxText, side by side: the same DeepSeek-V3 reduction trained by both, one after
the other, on 8 virtual CPU devices, with both medians and their ratio.

The shape (issue 27's): embedding 256; MLA with 8 heads, q_lora 64, kv_lora 64, nope 32,
rope 16, v 32; 4 layers with the first dense (mlp 512); 16 experts top-2 (mlp 128) plus one
shared; vocab 512; global batch 8 x 512 (CP: 8 x 2048); fp32 parameters and compute. Each
side's step time is the median of steps ``--skip + 1`` to ``--steps``.

* MaxText 0.2.5 runs from its own Python (``--maxtext-python``: a Python 3.12 venv with
  ``pip install 'maxtext[tpu]==0.2.5'``; MaxText is not a zoo dependency), as
  ``python -m maxtext.trainers.pre_train.train <its base.yml> hardware=cpu
  dataset_type=synthetic ...`` with ``JAX_PLATFORMS=cpu`` and ``DECOUPLE_GCLOUD=TRUE``; its
  step times are read from its ``completed step: N, seconds: S`` lines.
* zoo runs `benchmarks/train_step.py` (the recipe's settings through `zoo.train.build`) on the
  same shape and mesh, in a fresh process too.

Strategies and meshes: fsdp (fsdp=8), ep_as_cp (fsdp=2, expert=4; MaxText
``custom_mesh_and_rule=ep-as-cp``, ``sparse_matmul=false``), cp (fsdp=2, context=4, sequence
2048).

    python benchmarks/vs_maxtext.py --maxtext-python /path/to/venv/bin/python

``--goal-row`` compiles DeepSeek-V3's goal row instead, for 256 TPU v5p chips by the TPU
compiler on this host (no TPU needed), one side after the other: MaxText's ``train_compile``
(``model_name=deepseek3-671b compile_topology=v5p-512``, fsdp 4 x expert 64, 256 x 4096, remat
full, ``ragged_buffer_factor=2``) and zoo's `benchmarks/scale.py` on the same row
(``moe_buffer_factor=2``, overflow dropped, no MTP). It prints each side's per-chip arguments
and temporaries from the compiler's memory analysis, the TPU compiler's own time (libtpu's
``END_TO_END stage duration`` in its log, ``TPU_LOG_DIR``) and the process's wall time
(imports, build, lower and compile).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# zoo's field -> MaxText's key, for the shape above
SHAPE = {
    "hidden_size": ("base_emb_dim", 256), "num_attention_heads": ("base_num_query_heads", 8),
    "num_key_value_heads": ("base_num_kv_heads", 8), "q_lora_rank": ("q_lora_rank", 64),
    "kv_lora_rank": ("kv_lora_rank", 64), "qk_nope_head_dim": ("qk_nope_head_dim", 32),
    "qk_rope_head_dim": ("qk_rope_head_dim", 16), "v_head_dim": ("v_head_dim", 32),
    "num_hidden_layers": ("base_num_decoder_layers", 4),
    "intermediate_size": ("base_mlp_dim", 512), "moe_intermediate_size": ("base_moe_mlp_dim", 128),
    "n_routed_experts": ("num_experts", 16), "num_experts_per_tok": ("num_experts_per_tok", 2),
    "n_shared_experts": ("shared_experts", 1),
    "first_k_dense_replace": ("first_num_dense_layers", 1),
    "vocab_size": ("vocab_size", 512),
}
ZOO_ONLY = {"n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0}
STRATEGIES = {  # name -> (zoo mesh, MaxText mesh settings, sequence length)
    "fsdp": ("fsdp=8", {"ici_fsdp_parallelism": 8}, 512),
    "ep_as_cp": ("fsdp=2,expert=4", {"ici_fsdp_parallelism": 2, "ici_expert_parallelism": 4,
                                     "custom_mesh_and_rule": "ep-as-cp",
                                     "sparse_matmul": "false"}, 512),
    "cp": ("fsdp=2,context=4", {"ici_fsdp_parallelism": 2, "ici_context_parallelism": 4}, 2048),
}
# the goal row, as each side spells it
MAXTEXT_GOAL_ROW = {
    "model_name": "deepseek3-671b", "compile_topology": "v5p-512",
    "compile_topology_num_slices": 1, "per_device_batch_size": 1, "max_target_length": 4096,
    "ici_fsdp_parallelism": 4, "ici_expert_parallelism": 64, "remat_policy": "full",
    "dataset_type": "synthetic", "enable_checkpointing": "false", "ragged_buffer_factor": 2.0}
ZOO_GOAL_ROW = ["--model", "deepseek_v3", "--target", "tpu-v5p-256", "--mesh",
                "fsdp=4,expert=64", "--strategy", "fsdp", "--batch-size", "256", "--seq-len",
                "4096", "--dtype", "bfloat16", "--remat", "full", "--set",
                "moe_buffer_factor=2", "--set", "moe_overflow=drop", "--set",
                "num_nextn_predict_layers=0"]
MEMORY_FIELD = re.compile(r"\b(argument|temp)_size_in_bytes=(\d+)")  # not host_...
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--maxtext-python", required=True, help="the Python of a venv with "
                    "maxtext[tpu]==0.2.5 installed")
    ap.add_argument("--strategies", default="fsdp,ep_as_cp,cp",
                    help=f"comma list of {', '.join(STRATEGIES)}")
    ap.add_argument("--steps", type=int, default=25, help="steps each side runs")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--goal-row", action="store_true", help="compile DeepSeek-V3's goal row "
                    "for TPU v5p-256 on both sides instead of training")
    args = ap.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in args.strategies:
        if s not in STRATEGIES:
            ap.error(f"--strategies: unknown strategy {s!r}; valid: {', '.join(STRATEGIES)}")
    if args.steps <= args.skip:
        ap.error(f"--steps {args.steps} must exceed --skip {args.skip}")
    if not os.path.exists(args.maxtext_python):
        ap.error(f"--maxtext-python {args.maxtext_python}: no such file; make a Python 3.12 "
                 f"venv and `pip install 'maxtext[tpu]==0.2.5'` into it, then pass its "
                 f"bin/python")
    return args


def _env() -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE", TPU_SKIP_MDS_QUERY="1",
               XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=8"]))
    return env


def maxtext_command(python: str, strategy: str, steps: int, out_dir: str) -> list[str]:
    """The MaxText training command for `strategy` on the shape above."""
    found = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname("
                            "maxtext.__file__))"], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"{python} cannot import maxtext: {found.stderr.strip()[-500:]}")
    base = os.path.join(found.stdout.strip(), "configs", "base.yml")
    _, mesh, seq = STRATEGIES[strategy]
    settings = {
        "run_name": f"vs_zoo_{strategy}", "base_output_directory": out_dir,
        "hardware": "cpu", "skip_jax_distributed_system": "true", "dataset_type": "synthetic",
        "enable_checkpointing": "false",
        "steps": steps, "log_period": steps, "per_device_batch_size": 1,
        "max_target_length": seq, "dtype": "float32", "weight_dtype": "float32",
        "decoder_block": "deepseek", "attention_type": "mla", "mlp_activations": "[silu,linear]",
        "routed_score_func": "sigmoid", "routed_bias": "true", "routed_scaling_factor": 2.5,
        "megablox": "false", "capacity_factor": -1, "enable_dropout": "false",
        "logits_via_embedding": "false", "attention": "dot_product",
        **{key: value for key, value in SHAPE.values()}, **mesh,
    }
    return [python, "-m", "maxtext.trainers.pre_train.train", base,
            *(f"{k}={v}" for k, v in settings.items())]


def median_maxtext(output: str, skip: int) -> float:
    times = {int(n): float(s) for n, s in STEP_LINE.findall(output)}
    kept = [s for n, s in sorted(times.items()) if n >= skip]
    if not kept:
        raise RuntimeError(f"no 'completed step' lines past step {skip} in MaxText's output:\n"
                           f"{output[-3000:]}")
    return statistics.median(kept)


def run_maxtext(args, strategy: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = maxtext_command(args.maxtext_python, strategy, args.steps, out)
        print(f"  MaxText {strategy}: {' '.join(cmd[1:4])} ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, env=_env(), capture_output=True, text=True,
                              timeout=args.timeout, cwd=out)
        text = done.stdout + done.stderr
        if done.returncode != 0:
            raise RuntimeError(f"MaxText {strategy} exited {done.returncode}:\n{text[-4000:]}")
        return median_maxtext(text, args.skip)


def run_zoo(args, strategy: str, python: str = sys.executable) -> float:
    """zoo's median step in seconds for `strategy`, run by `python` on this checkout's code."""
    mesh, _, seq = STRATEGIES[strategy]
    sets = [f"{k}={v}" for k, (_, v) in SHAPE.items()] + [f"{k}={v}" for k, v in ZOO_ONLY.items()]
    with tempfile.TemporaryDirectory() as out:
        record = os.path.join(out, "row.json")
        cmd = [python, str(ROOT / "benchmarks" / "train_step.py"), "--models",
               "deepseek3", "--strategies", strategy, "--mesh", f"{strategy}={mesh}",
               "--seq-len", str(seq), "--batch-size", "8", "--steps",
               str(args.steps - args.skip), "--warmup", str(args.skip), "--json", record,
               *(x for s in sets for x in ("--set", s))]
        print(f"  zoo {strategy}: benchmarks/train_step.py ...", file=sys.stderr, flush=True)
        env = _env()  # this checkout's zoo, whatever `python` has installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"zoo {strategy} exited {done.returncode}:\n"
                               f"{(done.stdout + done.stderr)[-4000:]}")
        rec = json.loads(pathlib.Path(record).read_text())
    row = dict(zip(rec["columns"], rec["rows"][0]))
    return float(row["step ms (median)"].replace(",", "")) / 1e3


def _timed_run(cmd: list[str], env: dict[str, str], timeout: int, cwd) -> tuple[str, float]:
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)
    wall = time.perf_counter() - start
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {done.returncode}:\n{text[-4000:]}")
    return text, wall


def goal_row(args) -> int:
    """Both sides' goal-row compile for TPU v5p-256: memory and wall time (see the docstring)."""
    env = _env()
    env.update(TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    GiB = 2 ** 30
    print(f"# DeepSeek-V3 goal row compiled for TPU v5p-256 (256 chips), fsdp 4 x expert 64, "
          f"256 x 4096, remat full, buffers 2x; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as out:
        base = maxtext_command(args.maxtext_python, "fsdp", 1, out)[3]
        cmd = [args.maxtext_python, "-m", "maxtext.trainers.pre_train.train_compile", base,
               *(f"{k}={v}" for k, v in MAXTEXT_GOAL_ROW.items())]
        print(f"  MaxText: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        logs = os.path.join(out, "tpu_logs")
        text, wall = _timed_run(cmd, dict(env, TPU_LOG_DIR=logs), args.timeout, out)
        mem = {k: int(v) for k, v in MEMORY_FIELD.findall(text)}
        rows.append(("MaxText 0.2.5 train_compile", _libtpu(args.maxtext_python),
                     mem["argument"] / GiB, mem["temp"] / GiB, "-", compiler_seconds(logs),
                     wall))
    with tempfile.TemporaryDirectory() as logs:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), *ZOO_GOAL_ROW, "--json"]
        print(f"  zoo: benchmarks/scale.py {' '.join(ZOO_GOAL_ROW)}", file=sys.stderr,
              flush=True)
        text, wall = _timed_run(cmd, dict(env, TPU_LOG_DIR=logs), args.timeout, ROOT)
        row = json.loads(next(line for line in text.splitlines() if line.startswith("{")))
        rows.append(("zoo benchmarks/scale.py", _libtpu(sys.executable),
                     row["params GiB"] + row["opt GiB"], row["temp GiB"],
                     f"{row['compile s']:.0f}", compiler_seconds(logs), wall))
    return _table(("side", "libtpu", "arguments GiB", "temporaries GiB", "compile s",
                   "TPU compiler s", "process wall s"),
                  [(name, v, f"{a:.2f}", f"{t:.2f}", c,
                    "?" if tc is None else f"{tc:.0f}", f"{w:.0f}")
                   for name, v, a, t, c, tc, w in rows])


_STAGE = re.compile(r"END_TO_END stage duration: (?:(\d+)m)?([\d.]+)(ms|s)\b")


def compiler_seconds(log_dir: str) -> float | None:
    """The TPU compiler's own time for the longest program it compiled, from libtpu's log in
    `log_dir` (``TPU_LOG_DIR``): its ``END_TO_END stage duration`` line, the same clock on
    both sides, without Python's import, trace and lowering."""
    longest = None
    for path in pathlib.Path(log_dir).glob("*INFO*"):
        if path.is_symlink():
            continue
        for minutes, value, unit in _STAGE.findall(path.read_text(errors="replace")):
            seconds = int(minutes or 0) * 60 + float(value) / (1000 if unit == "ms" else 1)
            longest = seconds if longest is None else max(longest, seconds)
    return longest


def _libtpu(python: str) -> str:
    """The libtpu version `python` compiles TPU programs with (the compiler's version)."""
    done = subprocess.run([python, "-c", "import importlib.metadata as m; "
                           "print(m.version('libtpu'))"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def _table(columns, rows) -> int:
    """Print a markdown table of text cells, then the load average."""
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.goal_row:
        return goal_row(args)
    print(f"# zoo vs MaxText: DeepSeek-V3 reduction, 8 virtual CPU devices ({os.cpu_count()} "
          f"cores), global batch 8, medians of steps {args.skip + 1}-{args.steps}, load "
          f"average {os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    for s in args.strategies:
        mesh, _, seq = STRATEGIES[s]
        mt = run_maxtext(args, s)
        zoo = run_zoo(args, s)
        tokens = 8 * seq
        rows.append((s, mesh, seq, tokens / mt, tokens / zoo))
        print(f"  {s}: MaxText {mt * 1e3:.0f} ms, zoo {zoo * 1e3:.0f} ms", file=sys.stderr,
              flush=True)
    return _table(("strategy", "mesh", "sequence", "MaxText tokens/s", "zoo tokens/s",
                   "zoo / MaxText"),
                  [(s, mesh, seq, f"{mt:,.0f}", f"{zoo:,.0f}", f"{zoo / mt:.2f}x")
                   for s, mesh, seq, mt, zoo in rows])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _record import json_main  # --json PATH: the table as a record
    raise SystemExit(json_main(main, ["vs_maxtext"]))
