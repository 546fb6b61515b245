"""Train-step speed of the mini DeepSeek-V3 and Mixtral under each partitioning strategy.

For each model x strategy: the compile time of the train step (``lower(...).compile()`` wall
time), the median step time over ``--steps`` timed steps after ``--warmup`` untimed ones (each
timed until every output is ready), tokens/s (``batch * seq_len / median``), model FLOP/s
(``config.flops_per_token(seq_len) * tokens/s``; the configs count *training* FLOPs, forward +
backward = 3x forward, causal attention included) and MFU: model FLOP/s as a fraction of this
machine's own matmul rate, measured in the same process just before and just after that row's
timed steps (their mean) with a large square matmul (``--matmul-size``) in the same dtype,
median of 5 runs. On a shared machine the rate tracks the load, so MFU is steadier than the
times; a row whose rate fell more than 1.25x below the run's best is marked ``(busy)``.

What is timed is exactly the recipes' step: the model class, preset, aux-loss weight and
expert-bias rate come from ``recipes/mini_*.py``, the step from `zoo.train.make_train_step`, the
state from `zoo.train.create_sharded`, and the batch has the recipes' sharding. The batch is
synthetic (random tokens, one document per row, so attention is fully causal -- the most work a
real packed batch can need); its positions are load-balanced for the attention's CP degree, as
the data pipeline does. The persistent compilation cache is off, so compile times are real.

The machine rate: on CPU the virtual devices (``jax_num_cpu_devices``)
share the same cores, so the machine's rate is that of *one* jitted matmul (which uses all
cores); on accelerators it is one device's rate times the device count.

    python benchmarks/train_step.py                 # 2 models x 3 strategies, 8 CPU devices
    python benchmarks/train_step.py --quick         # smoke test: 1 model x 1 strategy, 2 steps
    python benchmarks/train_step.py --models mixtral --strategies fsdp,cp --seq-len 512 \\
        --set num_hidden_layers=2 --mesh cp=context=8

Legend (shapes): B batch, L length.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"deepseek3": "mini_deepseek3", "mixtral": "mini_mixtral"}
STRATEGIES = ("fsdp", "cp", "ep_as_cp")
NOISY = 1.25  # a row's matmul rate this far below the run's best: the machine was busy
# --quick: the smallest run that still goes through every piece of one real configuration
# (EP-as-CP with native CP, MoE, ring/all-gather attention) -- a smoke test, not a figure.
QUICK = dict(models="mixtral", strategies="ep_as_cp", steps=2, warmup=1, seq_len=64,
             matmul_size=512, overrides=["num_hidden_layers=1"])


def load_recipe(model: str):
    """The `zoo.train.cli.Recipe` of ``recipes/mini_<model>.py`` (the recipes are scripts)."""
    path = os.path.join(ROOT, "recipes", f"{RECIPES[model]}.py")
    spec = importlib.util.spec_from_file_location(f"_recipe_{model}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RECIPE


def default_mesh(strategy: str, n: int) -> str:
    """Mesh text for `strategy` on `n` devices (8: fsdp=8 | fsdp=2,context=4 |
    fsdp=2,expert=2,context=2, the recipes' default)."""
    if strategy == "fsdp":
        return f"fsdp={n}"
    if strategy == "cp":  # keep a 2-way batch axis so batch 8 splits; context as wide as fits
        context = 4 if n % 4 == 0 and n >= 8 else (n if n <= 4 else 1)
        return f"fsdp={n // context},context={context}"
    expert = 2 if n % 2 == 0 else 1
    context = 2 if n % (2 * expert) == 0 else 1
    return f"fsdp={n // (expert * context)},expert={expert},context={context}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = ap.add_argument
    a("--models", default="deepseek3,mixtral", help=f"comma list of {', '.join(RECIPES)}")
    a("--strategies", default=",".join(STRATEGIES), help="comma list of strategies")
    a("--mesh", action="append", default=[], metavar="STRATEGY=AXIS=SIZE,...",
      help="mesh of one strategy, e.g. --mesh cp=context=8 (default: see default_mesh)")
    a("--batch-size", type=int, default=8, help="global batch (rows)")
    a("--seq-len", type=int, default=256)
    a("--dtype", default="float32", help="computation dtype (parameters stay float32, as in "
      "the recipes' --dtype); the matmul rate is measured in it too")
    a("--steps", type=int, default=5, help="timed steps (median reported)")
    a("--warmup", type=int, default=2, help="untimed steps after compilation")
    a("--matmul-size", type=int, default=2048, help="side of the square matmul for the "
      "machine rate")
    a("--attention", default=None, help="attention implementation (default: the config's)")
    a("--set", action="append", default=[], dest="overrides", metavar="FIELD=VALUE",
      help="override a field of every model's config, e.g. --set num_hidden_layers=2")
    a("--devices", type=int, default=None, help="virtual CPU devices (default 8 unless "
      "JAX_NUM_CPU_DEVICES or XLA_FLAGS sets a count)")
    a("--profile", action="store_true", help="also break one step into attention, MoE "
      "dispatch, grouped matmul, dense matmuls, collectives, optimizer and other (XLA's "
      "per-op times from the jax profiler; see benchmarks/_profile.py), each with its MFU")
    a("--quick", action="store_true", help=f"smoke test: {QUICK['models']} x "
      f"{QUICK['strategies']}, {QUICK['steps']} steps, seq_len {QUICK['seq_len']}, "
      f"--set {' '.join(QUICK['overrides'])}")
    args = ap.parse_args(argv)
    if args.quick:  # QUICK replaces the defaults; flags given explicitly still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for m in args.models:
        if m not in RECIPES:
            ap.error(f"--models: unknown model {m!r}; valid: {', '.join(RECIPES)}")
    for s in args.strategies:
        if s not in STRATEGIES:
            ap.error(f"--strategies: unknown strategy {s!r}; valid: {', '.join(STRATEGIES)}")
    meshes = {}
    for item in args.mesh:
        strategy, sep, text = item.partition("=")
        if not sep or strategy not in STRATEGIES:
            ap.error(f"--mesh {item!r}: write STRATEGY=AXIS=SIZE,..., e.g. cp=context=8, with "
                     f"STRATEGY one of {', '.join(STRATEGIES)}")
        meshes[strategy] = text
    args.mesh = meshes
    for name in ("batch_size", "seq_len", "steps", "matmul_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        ap.error(f"--warmup {args.warmup} must be >= 0")
    return ap, args


def matmul_rate(size: int, dtype, device, repeats: int = 5) -> float:
    """FLOP/s of one jitted ``[size, size] @ [size, size]`` on `device` (median of `repeats`)."""
    import jax
    import jax.numpy as jnp
    keys = jax.random.split(jax.random.key(0))
    a, b = (jax.device_put(jax.random.normal(k, (size, size), jnp.float32).astype(dtype), device)
            for k in keys)
    f = jax.jit(jnp.matmul)
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * size**3 / float(np.median(times))


def synthetic_batch(config, partitioner, batch: int, seq_len: int, seed: int = 0):
    """``inputs, targets, positions, segment_ids`` (int32) and ``loss_weights`` (float32)
    ``[B, L]`` on the batch sharding; positions load-balanced for the attention's CP degree."""
    import jax
    from zoo.data import load_balance
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len))
    cp = partitioner.context_size("attention")
    host = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], positions=positions,
                segment_ids=np.ones((batch, seq_len), np.int32),
                loss_weights=np.ones((batch, seq_len), np.float32))
    host = {k: np.ascontiguousarray(load_balance(v, cp)) for k, v in host.items()}
    sharding = partitioner.sharding(("batch", "length"))
    return {k: jax.device_put(v, sharding) for k, v in host.items()}


def bench_one(recipe, strategy: str, mesh_text: str, args, machine_rate_fn):
    """One table row (a dict) for `recipe` x `strategy`: the recipe's settings through
    `zoo.train.build`, with this benchmark's mesh, batch, length, dtype and ``--set``."""
    import jax
    from flax import nnx

    from zoo.train import build

    B, L = args.batch_size, args.seq_len
    t = recipe.train
    model = [f"dtype={args.dtype}"] + ([f"attention_implementation={args.attention}"]
                                       if args.attention else [])
    train = t.replace(strategy=strategy, mesh=mesh_text, batch_size=B, seq_len=L,
                      overrides=(*t.overrides, *model, *args.overrides))
    built = build(train, with_data=False)
    config, partitioner = built.model_config, built.partitioner
    model, optimizer = built.create_sharded()
    batch = synthetic_batch(config, partitioner, B, L)
    lr = np.float32(1e-4)

    t = time.perf_counter()
    compiled = built.train_step.lower(model, optimizer, batch, lr).compile()
    compile_s = time.perf_counter() - t

    times, rates = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # the machine rate brackets the timed steps (shared machines)
            rates.append(machine_rate_fn())
        t = time.perf_counter()
        model, optimizer, metrics = compiled(model, optimizer, batch, lr)
        jax.block_until_ready((nnx.state(model), nnx.state(optimizer), metrics))
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    rates.append(machine_rate_fn())
    profile = None
    if args.profile:
        from _profile import profile_step

        def run(step=compiled):
            nonlocal model, optimizer, metrics
            model, optimizer, metrics = step(model, optimizer, batch, lr)
            jax.block_until_ready((nnx.state(model), nnx.state(optimizer), metrics))
        profile = profile_step(compiled, run)
    loss = float(metrics["loss"])
    if not np.isfinite(loss):
        raise RuntimeError(f"{recipe.name} {strategy}: loss {loss} is not finite")
    step_s = float(np.median(times))
    tokens_per_s = B * L / step_s
    model_flops = config.flops_per_token(L) * tokens_per_s
    rate = float(np.mean(rates))
    del model, optimizer, compiled
    return dict(model=recipe.name, strategy=strategy, mesh=mesh_text,
                cp=partitioner.context_size("attention"), compile_s=compile_s, step_s=step_s,
                tokens_per_s=tokens_per_s, model_flops=model_flops, machine_rate=rate,
                mfu=model_flops / rate, loss=loss, rates=(min(rates), max(rates)),
                profile=profile,
                mflop_per_token=config.flops_per_token(L) / 1e6)


def format_table(rows, best_rate: float = 0.0) -> str:
    """Markdown table; ``vs base`` is tokens/s relative to the same model's first strategy row
    (the fsdp row when fsdp is benchmarked). A row is marked busy when its matmul rates (before
    and after its steps) differ by more than `NOISY`, or fall that far below the best rate of
    the run (`best_rate` or the rows' own)."""
    best = max([best_rate, *(r["rates"][1] for r in rows)])
    busy = {id(r) for r in rows if r["rates"][0] * NOISY < best}
    lines = ["| model | strategy | mesh | attention CP | compile s | step ms (median) | tokens/s "
             "| vs base | model GFLOP/s | machine GFLOP/s | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        base.setdefault(r["model"], r)
        ratio = r["tokens_per_s"] / base[r["model"]]["tokens_per_s"]
        tag = " (base)" if base[r["model"]] is r else ""
        lines.append(
            f"| {r['model']} | {r['strategy']}{tag} | {r['mesh']} | {r['cp']} | "
            f"{r['compile_s']:.1f} | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:,.0f} | "
            f"{ratio:.2f}x | {r['model_flops'] / 1e9:.2f} | {r['machine_rate'] / 1e9:.0f}"
            f"{' (busy)' if id(r) in busy else ''} | {r['mfu']:.1%} |")
    if busy:
        lines.append(f"\n(busy): a matmul rate measured around the row's steps was more than "
                     f"{NOISY:.2f}x below the run's best ({best / 1e9:.0f} GFLOP/s) -- other "
                     f"work shared the machine, so its times are less reliable; its MFU uses "
                     f"the mean of its two rates, which corrects for part of that.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    from zoo.train import cli
    try:
        cli.set_cpu_devices(args.devices)  # before the first device is touched
    except ValueError as e:
        ap.error(str(e))

    import jax
    import jax.numpy as jnp
    # Compile times must be real: no persistent cache hits from earlier runs or recipes.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        dtype = jnp.dtype(args.dtype)
    except TypeError:
        ap.error(f"--dtype {args.dtype}: not a dtype (e.g. float32, bfloat16)")

    started = time.perf_counter()
    backend, n = jax.default_backend(), jax.device_count()
    # CPU virtual devices share the cores: one matmul already uses the whole machine.
    scale = 1 if backend == "cpu" else n
    measure = lambda: scale * matmul_rate(args.matmul_size, dtype, jax.devices()[0])

    recipes = {m: load_recipe(m) for m in args.models}
    meshes = {s: args.mesh.get(s) or default_mesh(s, n) for s in args.strategies}

    print(f"# train step: {n} {backend} devices ({os.cpu_count()} CPU cores), batch "
          f"{args.batch_size} x seq_len {args.seq_len}, {dtype.name} compute, "
          f"median of {args.steps} steps after {args.warmup} warmup", flush=True)
    first = measure()
    print(f"machine matmul rate ({args.matmul_size}^3 {dtype.name}, "
          f"{'one jit on all cores' if scale == 1 else f'per device x {n}'}): "
          f"{first / 1e9:.0f} GFLOP/s at start", flush=True)
    rows, skipped = [], []
    for m in args.models:
        for s in args.strategies:
            try:
                rows.append(bench_one(recipes[m], s, meshes[s], args, measure))
            except ValueError as e:  # mesh/shape rules: name the row and go on
                skipped.append(f"{recipes[m].name} {s} ({meshes[s]}): {e}")
                print(f"skipped {skipped[-1]}", file=sys.stderr, flush=True)
                continue
            r = rows[-1]
            print(f"{r['model']}: {r['mflop_per_token']:.2f} MFLOP/token (training = 3x forward, "
                  f"causal attention at seq_len {args.seq_len})", flush=True)
            print(f"  {r['model']} {s} ({r['mesh']}): compile {r['compile_s']:.1f} s, step "
                  f"{r['step_s'] * 1e3:.0f} ms, loss {r['loss']:.3f}", file=sys.stderr,
                  flush=True)
    print()
    print(format_table(rows, first))
    if args.profile:
        from _profile import format_profile
        for r in rows:
            print()
            print(format_profile(f"{r['model']} {r['strategy']} ({r['mesh']})", r["profile"],
                                 machine_rate=r["machine_rate"], step_s=r["step_s"]))
    print(f"\nwall time {time.perf_counter() - started:.0f} s", flush=True)
    for line in skipped:
        print(f"skipped {line}", flush=True)
    return 1 if skipped or not rows else 0


if __name__ == "__main__":
    from _record import json_main  # --json PATH: the table as a record
    raise SystemExit(json_main(main, ["train_step"]))
