"""Accelerator check: for whoever has a GPU/TPU. Correctness first, then speed at real width.

    python benchmarks/accelerator_check.py            # on a GPU/TPU machine
    python benchmarks/accelerator_check.py --dry-run  # CPU: 8 virtual devices, reduced widths

1. **Losses against CPU.** The mini presets train ``--steps`` steps (fp32; the accelerator at
   its default matmul precision, the reference at the highest) under each strategy on the
   accelerator's devices, on the same batches as a one-device CPU run of the same step; the
   table gives both loss curves' last value and the largest relative difference over the
   steps.
2. **Full-width layers.** One scanned DeepSeek-V3 MoE layer and one Mixtral-8x7B layer at real
   width (bf16 compute, bf16 parameters so a layer's weights and gradients fit), forward +
   backward over ``--tokens`` tokens per device: median time, the layer's model FLOP/s and
   MFU against the chip's bf16 peak (from its device kind, when known) and against a large
   bf16 matmul measured in the same process.
3. **Parts of other issues**, when present beside this file: ``accel_moe.py`` and
   ``accel_attention.py`` each expose ``run(report)``, ``report(section, row_dict)``.
4. **Memory: the rehearsal against the chip.** Each row's train step is rehearsed for a
   compile-only target of the chip's own kind and count (`zoo.targets.target_devices`, e.g.
   ``tpu-v5e-1`` or ``h100-8``: what a CPU host predicts), then built and run here for
   ``--steps`` steps; the table sets the rehearsal's peak (arguments + temporaries + outputs
   not aliased) beside the chip's own peak (``memory_stats()["peak_bytes_in_use"]``).

``--dry-run`` runs every path on the CPU (2 steps, hidden width 256, 16 experts) so the script
itself is tested without an accelerator; its numbers say nothing about any accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# bf16 dense peak FLOP/s by device kind (public spec sheets); None: only the measured rate
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "TPU v4": 275e12,
             "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6": 918e12}


# the losses section's families and their expert-bias rates (aux-loss-free balancing where the
# family routes with a selection bias)
LOSS_MODELS = {"deepseek3": 1e-2, "mixtral": 0.0, "qwen3_moe": 0.0, "glm4_moe": 1e-2,
               "gpt_oss": 0.0, "deepseek_v32": 1e-2, "glm_moe_dsa": 1e-2, "deepseek_v4": 1e-2,
               "qwen3_next": 0.0, "qwen3_5_moe": 0.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, reduced widths, 2 steps")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per device (layer timing)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip", nargs="*", default=[],
                   choices=("losses", "layers", "parts", "memory"))
    p.add_argument("--models", nargs="*", default=["deepseek3", "mixtral"], choices=LOSS_MODELS,
                   help="families whose mini preset the losses section trains")
    p.add_argument("--parts", nargs="*", default=["accel_moe", "accel_attention"],
                   choices=("accel_moe", "accel_attention"), help="which parts to run")
    return p.parse_args(argv)


def report(section: str, row: dict) -> None:
    """Print one table row, with the header the first time a section is seen."""
    cells = [f"{v:,.4g}" if isinstance(v, float) else str(v) for v in row.values()]
    if section not in report.seen:
        report.seen.add(section)
        print(f"\n## {section}\n\n| " + " | ".join(row) + " |\n|" + "---|" * len(row))
    print("| " + " | ".join(cells) + " |", flush=True)


report.seen = set()


# -- 1. losses against CPU -----------------------------------------------------------------------

def strategy_meshes(n: int) -> dict[str, dict[str, int]]:
    out = {"fsdp": dict(fsdp=n)}
    if n % 2 == 0:
        out["cp"] = dict(fsdp=n // 2, context=2)
    if n % 4 == 0:
        out["ep_as_cp"] = dict(fsdp=n // 4, expert=2, context=2)
    return out


def train_losses(family, batches, *, devices, strategy="fsdp", mesh=None, bias_rate=0.0):
    """The losses of the mini `family` trained on `batches` at a constant rate, built by
    `zoo.train.build` on `devices` (one device: the unsharded reference)."""
    import numpy as np

    from zoo.train import TrainConfig, build
    from zoo.train import step as S
    B, L = batches[0]["inputs"].shape
    train = TrainConfig(family=family, preset="mini", batch_size=B, seq_len=L, strategy=strategy,
                        mesh=mesh or f"fsdp={len(devices)}", aux_loss_weight=1e-3,
                        expert_bias_rate=bias_rate, load_balance="none")
    built = build(train, devices=devices, with_data=False)
    model, opt = built.create_sharded()
    losses = []
    for batch in batches:
        model, opt, m = built.train_step(model, opt, S.make_global_batch(batch,
                                                                         built.batch_sharding),
                                         np.float32(1e-3))
        losses.append(float(m["loss"]))
    return losses


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def check_losses(args) -> None:
    import jax
    import numpy as np

    from zoo import data

    devices = jax.devices()
    cpu = jax.devices("cpu")[0]
    steps = 2 if args.dry_run else args.steps
    it = data.text_dataset(None, seq_len=128, batch_size=8)
    batches = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(steps)]
    for family in args.models:
        name, bias_rate = f"mini_{family}", LOSS_MODELS[family]
        # the reference at full fp32; the accelerator at its default precision, as a run
        # trains (a TPU's Mosaic ragged dot refuses "highest" for its bf16 passes)
        with jax.default_matmul_precision("highest"):
            ref = train_losses(family, batches, devices=[cpu], bias_rate=bias_rate)
        for strategy, sizes in strategy_meshes(len(devices)).items():
            mesh = ",".join(f"{k}={v}" for k, v in sizes.items())
            got = train_losses(family, batches, devices=devices, strategy=strategy, mesh=mesh,
                               bias_rate=bias_rate)
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
            report("losses: accelerator vs one CPU device (fp32)", dict(
                model=name, strategy=strategy, mesh=",".join(f"{k}={v}" for k, v in
                                                             sizes.items()),
                device=devices[0].device_kind, steps=steps, first_loss=ref[0],
                last_loss_accel=got[-1], last_loss_cpu=ref[-1], max_rel_diff=rel,
                ok="yes" if rel < 1e-2 else "NO"))


# -- 2. full-width layers ----------------------------------------------------------------------

def matmul_rate(n: int = 4096, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    t = []
    for _ in range(repeats):
        s = time.perf_counter()
        f(a).block_until_ready()
        t.append(time.perf_counter() - s)
    return 2 * n ** 3 / min(t)


def time_layer(name, config, layer_cls, args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from zoo.models.stacks import build_stack, run_layers
    from zoo.partitioning import Partitioner, make_mesh

    devices = jax.devices()
    n = len(devices)
    E = config.num_experts
    mesh = make_mesh(expert=n, devices=devices) if E % n == 0 else make_mesh(fsdp=n,
                                                                            devices=devices)
    p = Partitioner(mesh, "fsdp")
    L = min(args.tokens, 256) if args.dry_run else args.tokens
    B, D = n, config.hidden_size
    x_sharding = p.sharding(("batch", "length", "act_embed"))

    @jax.jit
    def create():
        return build_stack(layer_cls, config, first=config.num_hidden_layers - 1, count=1,
                           inputs_shape=(B, L, D), partitioner=p, rngs=nnx.Rngs(0))

    layer = create()
    x = jax.device_put(jnp.asarray(np.random.RandomState(0).randn(B, L, D) * 0.1,
                                   config.dtype), x_sharding)
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))

    def loss(layer, x):
        y, _ = run_layers(layer, x, positions=pos, remat=config.remat_policy)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jax.block_until_ready(step(layer, x))
    times = []
    for _ in range(args.repeats):
        s = time.perf_counter()
        jax.block_until_ready(step(layer, x))
        times.append(time.perf_counter() - s)
    t = statistics.median(times)
    # one MoE layer's work: no dense layers before it, no MTP module after it
    one = dataclasses.replace(config, num_hidden_layers=1, **(
        {"first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
        if hasattr(config, "first_k_dense_replace") else {}))
    per_token = one.flops_per_token(L) - 6 * D * config.vocab_size  # without the lm_head
    flops = per_token * B * L / n / t
    kind = devices[0].device_kind
    peak = next((v for k, v in PEAK_BF16.items() if k.lower() in kind.lower()), None)
    rate = matmul_rate(1024 if args.dry_run else 8192)
    report("one full-width layer, forward + backward (bf16)", dict(
        layer=name, device=kind, devices=n, tokens_per_device=B * L // n,
        step_ms=t * 1e3, model_TFLOPs_per_device=flops / 1e12,
        MFU_vs_peak=f"{flops / peak:.1%}" if peak else "-",
        matmul_TFLOPs=rate / 1e12, MFU_vs_matmul=f"{flops / rate:.1%}"))


def check_layers(args) -> None:
    import jax.numpy as jnp

    from zoo.models.deepseek3 import DeepSeek3Config, DeepSeek3DecoderLayer
    from zoo.models.mixtral import MixtralConfig, MixtralDecoderLayer

    import jax
    common = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat_policy="full")
    # at most 8 experts a device (DeepSeek-V3's share at EP 32; Mixtral has 8): one chip holds
    # the layer's weights and gradients
    n = jax.device_count()
    ds = DeepSeek3Config.deepseek_v3(n_routed_experts=min(256, 8 * n), n_group=1, topk_group=1,
                                     **common)
    mx = MixtralConfig.mixtral_8x7b(**common)
    if args.dry_run:
        ds = DeepSeek3Config.mini(hidden_size=256, n_routed_experts=16, **common)
        mx = MixtralConfig.mini(hidden_size=256, **common)
    time_layer("DeepSeek-V3 MoE layer", ds, DeepSeek3DecoderLayer, args)
    time_layer("Mixtral-8x7B layer", mx, MixtralDecoderLayer, args)


# -- 4. memory: the rehearsal against the chip -------------------------------------------------

# (preset, overrides, batch, sequence): the mini, and a DeepSeek-V3 layer at full width with 4
# experts and a 8k vocabulary (fp32 parameters and Adam, bf16 compute: about 11 GiB on one chip)
MEMORY_ROWS = [
    ("deepseek3_mini", {}, 8, 2048),
    ("deepseek_v3", dict(num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, vocab_size=8192,
                         num_nextn_predict_layers=0, remat_policy="full"), 2, 4096),
]
TPU_GENERATIONS = {"TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v4": "v4"}


def target_of(devices) -> str | None:
    """The compile-only target naming these devices' kind and count (None: not one zoo has)."""
    kind, n = devices[0].device_kind, len(devices)
    if kind in TPU_GENERATIONS:
        return f"tpu-{TPU_GENERATIONS[kind]}-{n}"
    gpu = next((g for g in ("H100", "H200") if g in kind), None)
    return f"{gpu.lower()}-{n}" if gpu else None


def check_memory(args) -> None:
    import jax
    import numpy as np

    from zoo.train import TrainConfig, build
    from zoo.train import step as S
    from zoo.train.rehearse import model_config, rehearse

    devices = jax.devices()
    target = "cpu-8" if args.dry_run else target_of(devices)
    if target is None:
        print(f"\n(memory: no compile-only target for {devices[0].device_kind}: skipped)")
        return
    GiB = 2 ** 30
    rows = MEMORY_ROWS[:1] if args.dry_run else MEMORY_ROWS
    for preset, overrides, B, L in rows:
        if args.dry_run:
            B, L = 8, 128
        config = dataclasses.replace(model_config(preset)[1], **overrides)
        mesh = f"fsdp={len(devices)}"
        predicted = rehearse(config, target=target, mesh=mesh, batch_size=B, seq_len=L,
                             dtype="bfloat16")
        row = dict(model=preset, target=target, batch=f"{B} x {L}",
                   rehearsal_args_GiB=predicted.argument_bytes / GiB,
                   rehearsal_temp_GiB=predicted.temp_bytes / GiB,
                   rehearsal_peak_GiB=predicted.peak_bytes / GiB,
                   rehearsal_fits=predicted.fits)
        if predicted.fits is False:
            report("memory: the rehearsal against the chip", dict(
                **row, chip_arrays_GiB="-", chip_reserved_GiB="-", chip_total_GiB="-",
                rehearsal_over_chip="not run: does not fit"))
            continue
        train = TrainConfig(mesh=mesh, strategy="fsdp", batch_size=B, seq_len=L,
                            overrides=["dtype=bfloat16", "param_dtype=float32"])
        built = build(train, model_config=config, devices=devices, with_data=False,
                      donate=True)
        model, opt = built.create_sharded()
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, config.vocab_size, (B, L + 1), dtype=np.int32)
        batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                     positions=np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)),
                     segment_ids=np.ones((B, L), np.int32),
                     loss_weights=np.ones((B, L), np.float32))
        for _ in range(2 if args.dry_run else args.steps):
            model, opt, metrics = built.train_step(
                model, opt, S.make_global_batch(batch, built.batch_sharding), np.float32(1e-4))
        jax.block_until_ready(metrics["loss"])
        # arrays (parameters, optimizer state, batches) are the allocator's "in use"; a TPU
        # runtime holds a program's temporaries apart, as "reserved" (both peaks; a GPU's
        # allocator reports none reserved)
        stats = None if args.dry_run else devices[0].memory_stats()
        arrays = stats["peak_bytes_in_use"] if stats else None
        reserved = stats.get("peak_bytes_reserved", 0) if stats else None
        report("memory: the rehearsal against the chip", dict(
            **row, chip_arrays_GiB=arrays / GiB if stats else "-",
            chip_reserved_GiB=reserved / GiB if stats else "-",
            chip_total_GiB=(arrays + reserved) / GiB if stats else "-",
            rehearsal_over_chip=(f"{predicted.peak_bytes / (arrays + reserved):.3f}"
                                 if stats else "-")))
        del model, opt, metrics, built


# -- 3. other issues' parts --------------------------------------------------------------------

def run_parts(parts) -> None:
    for part in parts:
        path = os.path.join(HERE, f"{part}.py")
        if not os.path.exists(path):
            print(f"\n({part}.py not present: skipped)")
            continue
        spec = importlib.util.spec_from_file_location(part, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.run(report)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
    import jax
    print(f"accelerator_check: {jax.device_count()} {jax.default_backend()} devices "
          f"({jax.devices()[0].device_kind}){' -- DRY RUN on CPU' if args.dry_run else ''}")
    if jax.default_backend() == "cpu" and not args.dry_run:
        print("no accelerator found; pass --dry-run to exercise the script on the CPU")
        return 2
    if "memory" not in args.skip:
        check_memory(args)
    if "losses" not in args.skip:
        check_losses(args)
    if "parts" not in args.skip:
        run_parts(args.parts)
    if "layers" not in args.skip:
        check_layers(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
