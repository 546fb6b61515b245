"""One train step compiled for each target by its own compiler, side by side.

    python benchmarks/targets.py                      # DeepSeek-V3's goal row, four targets
    python benchmarks/targets.py --targets cpu-256,tpu-v5p-256 --set num_hidden_layers=2

Each target's step is the program a run there builds (`zoo.train.rehearse.rehearse` with
``target=``): 256 virtual CPU devices compiled by XLA:CPU, a TPU slice by libtpu's compiler,
GPUs by XLA:GPU from the CUDA plugin -- all on this host, nothing allocated. The default row
is DeepSeek-V3's goal row: fsdp=4 x expert=64, 256 x 4096 tokens, bf16 over fp32 parameters
and Adam, remat full, ``moe_buffer_factor=2`` with overflow dropped, no MTP layer.

Columns: per-device temporaries and peak (arguments + temporaries + outputs) against the
device's memory, compile seconds, HLO/model FLOPs (kernels' custom calls are not in the HLO
count), collective GB per device per step, the custom calls (kernels) and the roofline bound
(`Rehearsal.roofline`, a lower bound on the step's time, with the MFU at it). A TPU target
needs libtpu (``.[tpu-compile]``), a GPU target the CUDA plugin (``.[gpu-compile]``).
"""

from __future__ import annotations

import argparse
import sys

GOAL_ROW = ("moe_buffer_factor=2", "moe_overflow=drop", "num_nextn_predict_layers=0")
COLUMNS = ("target", "device", "temp GiB", "peak GiB", "memory GiB", "fits", "compile s",
           "HLO/model FLOPs", "all-gather GB", "reduce-scatter GB", "all-reduce GB",
           "all-to-all GB", "kernels", "bound ms", "bound by", "MFU at bound")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--targets", default="cpu-256,tpu-v5p-256,h100-256,h200-256",
      help="comma-separated targets (zoo.targets.parse forms)")
    a("--model", default="deepseek_v3")
    a("--mesh", default="fsdp=4,expert=64")
    a("--strategy", default="fsdp", choices=("fsdp", "cp", "ep_as_cp"))
    a("--batch-size", type=int, default=256)
    a("--seq-len", type=int, default=4096)
    a("--remat", default="full")
    a("--set", action="append", default=None, metavar="FIELD=VALUE", dest="overrides",
      help=f"config overrides (default: the goal row's, {' '.join(GOAL_ROW)}); given, they "
           f"replace those")
    a("--json", default=None, metavar="PATH",
      help="write the table as a record (docs/benchmarks/goal_row_targets.json)")
    return p.parse_args(argv)


def row(r) -> dict:
    """The table's cells of one `Rehearsal`."""
    gib = 2 ** 30
    bound = r.roofline()
    kernels = ", ".join(f"{k} {n}" for k, n in r.custom_calls.items()) or "none"
    return {"target": r.target, "device": r.device_kind or "cpu",
            "temp GiB": r.temp_bytes / gib, "peak GiB": r.peak_bytes / gib,
            "memory GiB": "-" if r.hbm_bytes is None else r.hbm_bytes / gib,
            "fits": {True: "yes", False: "no", None: "-"}[r.fits], "compile s": r.compile_s,
            "HLO/model FLOPs": r.flops_ratio,
            **{f"{k} GB": r.collective_bytes.get(k, 0.0) / 1e9
               for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")},
            "kernels": kernels,
            "bound ms": "-" if bound is None else bound["bound_s"] * 1e3,
            "bound by": "-" if bound is None else bound["bound_by"],
            "MFU at bound": "-" if bound is None else f"{bound['mfu']:.1%}"}


def main(argv=None) -> int:
    args = parse_args(argv)
    from zoo.targets import parse
    from zoo.train.rehearse import rehearse, set_virtual_devices
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    parsed = [parse(t) for t in targets]  # every name checked before any compile
    cpus = [t.count for t in parsed if t.platform == "cpu" and t.count]
    if cpus:  # before anything starts jax's backend
        set_virtual_devices(max(cpus))
    overrides = list(GOAL_ROW) if args.overrides is None else args.overrides
    remat = None if args.remat in ("none", "None") else args.remat
    rows = []
    for target in targets:
        r = rehearse(args.model, mesh=args.mesh, strategy=args.strategy,
                     batch_size=args.batch_size, seq_len=args.seq_len, dtype="bfloat16",
                     remat=remat, overrides=overrides, target=target)
        print(r, file=sys.stderr)
        rows.append({**row(r), "target": target})
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from scale import markdown  # benchmarks/, beside this script
    text = (f"## {args.model}, mesh {args.mesh}, {args.batch_size} x {args.seq_len}, "
            f"{' '.join(overrides)}\n\n" + markdown(rows, COLUMNS))
    print(text)
    if args.json:
        import _record
        _record.write_tables(args.json, ["goal_row_targets"], _record.markdown_tables(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
