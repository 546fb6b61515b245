"""Scale rehearsal table: the recipes' train step compiled for a virtual mesh at full size.

    python benchmarks/scale.py --model deepseek_v3 --devices 256 --mesh fsdp=4,expert=64 \\
        --strategy fsdp --batch-size 256 --seq-len 4096 --dtype bfloat16 --remat full

Nothing is allocated (abstract state, `jax.ShapeDtypeStruct` batch); XLA compiles the
program for ``--devices`` virtual CPU devices and reports per-device memory. Columns: per-
device parameter / optimizer / temporary GiB and arguments + temporaries + outputs ("peak"),
compile seconds, HLO instructions, HLO FLOPs / model FLOPs (dots counted with loop bodies x
trip counts against ``flops_per_token``), collective GB per device per step by kind.

``--decode``: one decode step instead (`zoo.inference.rehearsal.rehearse_decode`): ``--batch-size``
rows against a donated KV cache of ``--context`` slots, bf16 parameters unless
``--param-dtype`` says otherwise; columns: per-device parameter / cache / argument / temporary
GiB and the rest as above (model FLOPs: the forward for one token per row).

    python benchmarks/scale.py --decode --model deepseek_v3 --target tpu:v5p:4x4x4 \
        --mesh fsdp=64 --batch-size 128 --context 32768

``--set FIELD=VALUE`` overrides config fields (e.g. ``--set num_hidden_layers=4``,
``--set first_k_dense_replace=61`` for DeepSeek-V3's dense part alone). ``--json`` adds one
JSON line per row (for scripts). Several ``--set`` groups: run the script once per row.
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    from zoo.train.rehearse import presets  # the registry's; importing starts no backend
    a("--model", default="deepseek_v3", choices=presets(), metavar="PRESET",
      help="one of " + ", ".join(presets()))
    a("--devices", type=int, default=256, help="virtual CPU devices (--target cpu)")
    a("--target", default="cpu", help="cpu, cpu-N, a TPU slice compiled by the TPU "
      "compiler here, e.g. tpu-v5p-256 or tpu:v5p:4x8x8 (256 v5p chips; needs libtpu), or "
      "GPUs compiled by XLA's GPU compiler, h100-256 / h200-N (needs jax-cuda12-plugin)")
    a("--mesh", default=None, help="e.g. fsdp=4,expert=64 (default fsdp=<devices>)")
    a("--strategy", default="fsdp", choices=("fsdp", "cp", "ep_as_cp"))
    a("--batch-size", type=int, default=256, help="global rows")
    a("--seq-len", type=int, default=4096)
    a("--dtype", default="bfloat16", help="compute dtype")
    a("--param-dtype", default=None, help="default float32 (training), bfloat16 (--decode)")
    a("--decode", action="store_true", help="compile one decode step, not a train step")
    a("--context", type=int, default=32768, help="--decode: the KV cache's slots per row")
    a("--remat", default="full", help="remat policy (none, full, dots_saveable, "
      "save_layer_outputs, ...)")
    a("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides")
    a("--json", nargs="?", const="-", default=None, metavar="PATH",
      help="also print the row as one JSON line; with PATH, add the row to that record "
           "(docs/benchmarks/scale.json, rendered by tools/benchmarks_page.py)")
    return p.parse_args(argv)


COLUMNS = ("model", "target", "devices", "mesh", "strategy", "batch x seq", "dtype", "remat",
           "params GiB", "opt GiB", "temp GiB", "peak GiB", "compile s", "HLO ops",
           "HLO/model FLOPs",
           "all-gather GB", "reduce-scatter GB", "all-reduce GB", "all-to-all GB",
           "collective-permute GB", "fits")


DECODE_COLUMNS = ("model", "target", "devices", "mesh", "strategy", "batch x context", "dtype",
                  "params GiB", "cache GiB", "arguments GiB", "temp GiB", "peak GiB",
                  "compile s", "HLO ops", "HLO/model FLOPs", "all-gather GB",
                  "reduce-scatter GB", "all-reduce GB", "all-to-all GB",
                  "collective-permute GB", "fits")


def markdown(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.3g}"
        return f"{v:,}" if isinstance(v, int) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, 0.0)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from zoo.inference.rehearsal import rehearse_decode
    from zoo.train.rehearse import rehearse, set_virtual_devices
    from zoo.targets import parse
    target = parse(args.target)
    if target.platform == "cpu":  # before anything starts jax's backend
        set_virtual_devices(target.count or args.devices)

    overrides = args.overrides  # parsed from the config's field types, as the recipes do
    remat = None if args.remat in ("none", "None") else args.remat
    common = dict(mesh=args.mesh, strategy=args.strategy, batch_size=args.batch_size,
                  dtype=args.dtype, overrides=overrides, target=args.target)
    try:
        if args.decode:
            r = rehearse_decode(args.model, context=args.context,
                                param_dtype=args.param_dtype or "bfloat16", **common)
        else:
            r = rehearse(args.model, seq_len=args.seq_len,
                         param_dtype=args.param_dtype or "float32", remat=remat, **common)
    except ValueError as e:  # a bad --set names the field and the fix
        raise SystemExit(str(e)) from None
    columns = DECODE_COLUMNS if args.decode else COLUMNS
    row = r.row()
    if overrides:
        row["model"] += " (" + ", ".join(o.replace(" ", "") for o in overrides) + ")"
    print(r, file=sys.stderr)
    print(markdown([row], columns))
    if args.json:
        print(json.dumps({**row, "dots_by_dtype": r.dots_by_dtype,
                          "fp32_dots": r.fp32_dots()}))
    if args.json not in (None, "-"):
        import _record  # benchmarks/, beside this script
        _record.write_tables(args.json, ["scale_decode" if args.decode else "scale"],
                             _record.markdown_tables(markdown([row], columns)), merge=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
