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
(`Rehearsal.roofline`, a lower bound on the step's time, with the MFU at it; compute at the
chip's bf16 peak, or its FP8 peak for ``--set fp8=blockwise`` where it has one: "(FP8 peak)"
in the "bound by" column). A TPU target needs libtpu (``.[tpu-compile]``), a GPU target the
CUDA plugin (``.[gpu-compile]``).

``--breakdown N``: each target's compile also dumps the compiler's buffer assignment (about 60 s
more on a full-size TPU step) and a second table lists the N largest groups of temporaries live
at their peak, by named scope (`zoo.targets.peak_breakdown`: fwd/bwd, the layer's sublayer,
``[scan carry]`` for what a loop carries: under fwd, the residuals the forward scan stacks),
with their share of the temporaries and the largest shapes in each.

The MoE program space, one verdict per cell::

    python benchmarks/targets.py --matrix             # every cell: 5 families x 3 strategies x
                                                      # 2 dispatches x 3 overflows x 2 dtypes x
                                                      # 2 targets (360 compiles)
    python benchmarks/targets.py --pairwise --json docs/benchmarks/moe_target_matrix.json
    python benchmarks/targets.py --matrix --only dtype=float32,target=h100-8  # a slice of it
    python benchmarks/targets.py --matrix --shard 0/4 --rows rows.jsonl  # a quarter, resumable

Each cell is a family's mini preset (two layers, `MATRIX_SEQ` tokens a row, batch 8) trained
under a strategy on 8 devices of a target, with the MoE's dispatch, overflow and dtype set
(`cell_config`); its verdict is ``compiles``, ``invalid`` (a combination the MoE refuses at
construction, with its message: e.g. ``overflow='exact'`` with all_gather) or ``FAILS`` (the
error). The row also names the grouped-matmul kernel the execution resolved and why, where it
fell back to XLA's (`zoo.ops.moe_execution.MoEExecution`). ``--pairwise`` runs a covering subset
(`pairwise_cells`): every pair of values of any two axes appears in some valid cell.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

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
      help=f"config overrides, merged over the goal row's ({' '.join(GOAL_ROW)}): a given "
           f"field replaces that field's default, the other defaults stay")
    a("--json", default=None, metavar="PATH",
      help="write the table as a record (docs/benchmarks/goal_row_targets.json)")
    a("--breakdown", type=int, default=0, metavar="N",
      help="also print the N largest groups of temporaries live at the peak (the compiler's "
           "buffer assignment, by named scope; costs compile time)")
    a("--depth", type=int, default=4,
      help="with --breakdown: named scopes a group keeps (zoo.targets.scope_group)")
    a("--matrix", action="store_true",
      help="compile every cell of the MoE program space (MATRIX_AXES) and print its verdict")
    a("--pairwise", action="store_true",
      help="with or without --matrix: only a pairwise covering set of its cells")
    a("--only", default=None, metavar="AXIS=VALUE,...",
      help="with --matrix: only the cells with these values, e.g. dtype=float32,target=h100-8")
    a("--shard", default=None, metavar="I/N",
      help="with --matrix: only every N-th cell from the I-th (0-based), to spread the compiles "
           "over processes or machines")
    a("--rows", default=None, metavar="PATH",
      help="with --matrix: append each finished cell's row to this JSON-lines file and skip "
           "the cells already in it (a run resumes; rows from several shards, concatenated, "
           "make one table)")
    return p.parse_args(argv)


# -- the MoE program space ---------------------------------------------------------------------
MATRIX_AXES = {
    "family": ("deepseek3", "glm4_moe", "gpt_oss", "mixtral", "qwen3_moe"),
    "strategy": ("fsdp", "cp", "ep_as_cp"),
    "dispatch": ("all_gather", "all_to_all"),
    "overflow": ("drop", "exact", "dropless"),
    "dtype": ("float32", "bfloat16"),
    "target": ("tpu-v5p-8", "h100-8"),
}
# every strategy's mesh has an expert axis, so both dispatches are meaningful under each
MATRIX_MESHES = {"fsdp": "fsdp=2,expert=4", "cp": "fsdp=2,context=2,expert=2",
                 "ep_as_cp": "fsdp=2,expert=4"}
MATRIX_SEQ, MATRIX_BATCH, MATRIX_LAYERS = 256, 8, 2
# the float32 all_to_all cells of the three original minis (they did not compile for h100-8)
SEED_CELLS = (
    dict(family="deepseek3", strategy="ep_as_cp", dispatch="all_to_all", overflow="drop",
         dtype="float32", target="h100-8"),
    dict(family="mixtral", strategy="ep_as_cp", dispatch="all_to_all", overflow="exact",
         dtype="float32", target="h100-8"),
    dict(family="qwen3_moe", strategy="ep_as_cp", dispatch="all_to_all", overflow="dropless",
         dtype="float32", target="h100-8"),
)
MATRIX_COLUMNS = (*MATRIX_AXES, "verdict", "grouped matmul", "why", "compile s")


def cell_config(cell: dict) -> dict:
    """The config overrides of a cell: two layers, its dtype and dispatch; overflow ``drop``
    bounds what can be kept (all_to_all buffers of twice the balanced share, or all_gather's
    capacity factor 1.25), ``exact`` sends the overflow of those buffers in further rounds,
    ``dropless`` keeps every copy in one round."""
    bounded = {"all_to_all": dict(moe_buffer_factor=2.0),
               "all_gather": dict(capacity_factor=1.25)}[cell["dispatch"]]
    flow = {"drop": dict(moe_overflow="drop", **bounded),
            "exact": dict(moe_overflow="exact", moe_buffer_factor=2.0),
            "dropless": dict(moe_overflow="drop")}[cell["overflow"]]
    return dict(num_hidden_layers=MATRIX_LAYERS, dtype=cell["dtype"],
                moe_dispatch=cell["dispatch"], **flow)


def build_cell(cell: dict, devices=None):
    """``(lowered train step, the first MoE layer's execution)`` of a cell, built from the
    public pieces on the target's devices (`zoo.train.target_devices`); raises ValueError for
    a combination the model refuses at construction."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import zoo
    from zoo.layers.moe import moe_modules
    from zoo.models import registry
    from zoo.train import target_devices
    from zoo.train.step import BATCH_KEYS, abstract_state, make_train_step, make_tx

    family, config = registry.resolve(f"{cell['family']}_mini")
    sizes = dict(kv.split("=") for kv in MATRIX_MESHES[cell["strategy"]].split(","))
    devices = target_devices(cell["target"]) if devices is None else devices
    mesh = zoo.make_mesh(devices=devices, **{k: int(v) for k, v in sizes.items()})
    p = zoo.Partitioner(mesh, cell["strategy"])
    config = dataclasses.replace(config, **cell_config(cell))

    def make():
        return family.model_cls(config, inputs_shape=(MATRIX_BATCH, MATRIX_SEQ),
                                partitioner=p, rngs=nnx.Rngs(0))
    model, opt = abstract_state(make, make_tx(), mesh)
    execution = moe_modules(model, with_bias=False)[0].execution
    sharding = p.sharding(("batch", "length"))
    batch = {k: jax.ShapeDtypeStruct((MATRIX_BATCH, MATRIX_SEQ), jnp.float32
                                     if k == "loss_weights" else jnp.int32, sharding=sharding)
             for k in BATCH_KEYS}
    lowered = make_train_step(donate=True).lower(model, opt, batch,
                                                 jax.ShapeDtypeStruct((), jnp.float32))
    return lowered, execution


def run_cell(cell: dict, devices=None) -> dict:
    """A cell's row: its axes, verdict (``compiles``, ``invalid: ...``, ``FAILS: ...``), the
    grouped matmul the execution resolved and why, compile seconds."""
    start = time.perf_counter()
    kernel = why = "-"
    try:
        lowered, execution = build_cell(cell, devices)
        kernel, why = execution.grouped_matmul, execution.kernel_reason or "-"
        lowered.compile()
        verdict = "compiles"
    except ValueError as e:
        if "check_vma" in str(e) or "manual_axis_type" in str(e):
            verdict = f"FAILS: {str(e).splitlines()[0][:300]}"
        else:
            verdict = f"invalid: {str(e).splitlines()[0][:300]}"
    except Exception as e:  # a compiler's error: the verdict, not a crash of the whole run
        verdict = f"FAILS: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return {**cell, "verdict": verdict, "grouped matmul": kernel, "why": why,
            "compile s": time.perf_counter() - start}


def valid(cell: dict) -> bool:
    """Whether the MoE takes a cell's combination (the rules of
    `zoo.ops.moe_execution.MoEExecution`: rounds need all_to_all and plain SwiGLU experts;
    gpt-oss's have biases)."""
    if cell["overflow"] == "exact":
        return cell["dispatch"] == "all_to_all" and cell["family"] != "gpt_oss"
    return True


def all_cells() -> list[dict]:
    return [dict(zip(MATRIX_AXES, values)) for values in itertools.product(*MATRIX_AXES.values())]


def _pairs(cell: dict) -> set:
    items = list(cell.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def pairwise_cells() -> list[dict]:
    """A covering set of valid cells: `SEED_CELLS` first, then greedily the cell covering most
    pairs not yet covered (ties: the first in `all_cells` order), until every pair of values
    of two axes that some valid cell holds is covered. Deterministic."""
    cells = [c for c in all_cells() if valid(c)]
    todo = set().union(*(_pairs(c) for c in cells))
    chosen = []
    for seed in SEED_CELLS:
        chosen.append(dict(seed))
        todo -= _pairs(seed)
    while todo:
        best = max(cells, key=lambda c: len(_pairs(c) & todo))
        chosen.append(best)
        todo -= _pairs(best)
    return chosen


def cell_key(cell: dict) -> tuple:
    return tuple(cell[k] for k in MATRIX_AXES)


def saved_rows(path: str) -> dict:
    """The rows a ``--rows`` file holds, by cell (the last row of a cell wins)."""
    import json
    import os
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {cell_key(r): r for r in rows}


def matrix(argv_args) -> int:
    """``--matrix`` / ``--pairwise``: one row per cell, printed as it finishes, then the table;
    exit status 1 when a valid cell fails."""
    from zoo.train import target_devices
    cells = pairwise_cells() if argv_args.pairwise else all_cells()
    if argv_args.only:
        only = dict(kv.split("=", 1) for kv in argv_args.only.split(","))
        unknown = {k: v for k, v in only.items() if v not in MATRIX_AXES.get(k, ())}
        if unknown:
            raise SystemExit(f"--only {argv_args.only}: {unknown} are not axes' values; the "
                             f"axes are {MATRIX_AXES}")
        cells = [c for c in cells if all(c[k] == v for k, v in only.items())]
    if argv_args.shard:
        i, n = (int(x) for x in argv_args.shard.split("/"))
        if not 0 <= i < n:
            raise SystemExit(f"--shard {argv_args.shard}: expected I/N with 0 <= I < N")
        cells = cells[i::n]
    done = saved_rows(argv_args.rows) if argv_args.rows else {}
    todo = [c for c in cells if cell_key(c) not in done]
    devices = {t: target_devices(t) for t in {c["target"] for c in todo}}
    rows = []
    for cell in cells:
        if cell_key(cell) in done:
            rows.append(done[cell_key(cell)])
            continue
        r = run_cell(cell, devices[cell["target"]])
        print(" ".join(f"{k}={v}" for k, v in r.items()), file=sys.stderr, flush=True)
        if argv_args.rows:
            import json
            with open(argv_args.rows, "a") as f:
                f.write(json.dumps(r) + "\n")
        rows.append(r)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from scale import markdown  # benchmarks/, beside this script
    failed = sum(r["verdict"].startswith("FAILS") for r in rows)
    kind = "pairwise covering set" if argv_args.pairwise else "every cell"
    if argv_args.only:
        kind += f" with {argv_args.only}"
    if argv_args.shard:
        kind += f", shard {argv_args.shard}"
    text = (f"## MoE train steps for accelerator targets, {kind}: {len(rows)} cells, "
            f"{failed} failing (minis, {MATRIX_LAYERS} layers, {MATRIX_BATCH} x {MATRIX_SEQ})"
            f"\n\n" + markdown(rows, MATRIX_COLUMNS))
    print(text)
    if argv_args.json:
        import _record
        _record.write_tables(argv_args.json, ["moe_target_matrix"], _record.markdown_tables(text))
    return 1 if failed else 0


def merged_overrides(given, fields=None) -> list[str]:
    """The goal row's overrides (`GOAL_ROW`) with ``given`` (``FIELD=VALUE`` strings) merged
    over them by field, in order: a given field replaces its default, others stay. With
    ``fields`` (the model config's field names), a default the config has no field for is
    left out (Qwen3-Next has no MTP: ``num_nextn_predict_layers``); a given one is kept, for
    the config to refuse by name."""
    merged = {k: v for k, v in (kv.split("=", 1) for kv in GOAL_ROW)
              if fields is None or k in fields}
    for kv in given or ():
        if "=" not in kv:
            raise SystemExit(f"--set {kv!r}: expected FIELD=VALUE, e.g. --set fp8=blockwise")
        k, v = kv.split("=", 1)
        merged.pop(k, None)
        merged[k] = v
    return [f"{k}={v}" for k, v in merged.items()]


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
            # an FP8 program's bound is at the chip's FP8 peak where it has one (MFU too)
            "bound by": "-" if bound is None else bound["bound_by"] + (
                " (FP8 peak)" if bound["peak"] == "fp8" else ""),
            "MFU at bound": "-" if bound is None else f"{bound['mfu']:.1%}"}


BREAKDOWN_COLUMNS = ("target", "group", "GiB", "share of temp", "count", "largest shapes")


def breakdown_rows(target: str, peak, n: int, depth: int = 4) -> list[dict]:
    """The ``--breakdown`` table's rows of one target: the peak's `n` largest groups
    (`zoo.targets.PeakBreakdown`, regrouped at ``depth`` scopes), then a row of the live total
    against the temporaries."""
    import dataclasses

    from zoo.targets import scope_group
    gib = 2 ** 30
    def regroup(b):  # the buffers keep their op_name: regrouped at another depth
        group = scope_group(b.op_name, depth)
        carry = b.group.endswith("[scan carry]") and not group.endswith("[scan carry]")
        return dataclasses.replace(b, group=group + " [scan carry]" if carry else group)
    if depth != 4:
        peak = dataclasses.replace(peak, buffers=tuple(map(regroup, peak.buffers)))
    rows = []
    for group, nbytes, count in peak.groups()[:n]:
        shapes = ", ".join(f"{c} x {s} ({b / gib:.2f})" for s, b, c in peak.shapes(group, 2))
        rows.append({"target": target, "group": group, "GiB": nbytes / gib,
                     "share of temp": f"{nbytes / peak.temp_bytes:.1%}", "count": count,
                     "largest shapes": shapes})
    rows.append({"target": target, "group": f"live at the peak (schedule point {peak.peak_time})",
                 "GiB": peak.peak_bytes / gib,
                 "share of temp": f"{peak.peak_bytes / peak.temp_bytes:.1%}",
                 "count": len(peak.buffers),
                 "largest shapes": f"temporaries {peak.temp_bytes / gib:.2f} GiB"})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.matrix or args.pairwise:
        return matrix(args)
    from zoo.targets import parse
    from zoo.train.rehearse import rehearse, set_virtual_devices
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    parsed = [parse(t) for t in targets]  # every name checked before any compile
    cpus = [t.count for t in parsed if t.platform == "cpu" and t.count]
    if cpus:  # before anything starts jax's backend
        set_virtual_devices(max(cpus))
    import dataclasses

    from zoo.models import registry
    fields = {f.name for f in dataclasses.fields(registry.resolve(args.model)[1])}
    overrides = merged_overrides(args.overrides, fields)
    remat = None if args.remat in ("none", "None") else args.remat
    rows, peaks = [], []
    for target in targets:
        r = rehearse(args.model, mesh=args.mesh, strategy=args.strategy,
                     batch_size=args.batch_size, seq_len=args.seq_len, dtype="bfloat16",
                     remat=remat, overrides=overrides, target=target,
                     breakdown=args.breakdown > 0)
        print(r, file=sys.stderr)
        rows.append({**row(r), "target": target})
        if r.peak_breakdown is not None:
            peaks += breakdown_rows(target, r.peak_breakdown, args.breakdown, args.depth)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from scale import markdown  # benchmarks/, beside this script
    text = (f"## {args.model}, mesh {args.mesh}, {args.batch_size} x {args.seq_len}, "
            f"{' '.join(overrides)}\n\n" + markdown(rows, COLUMNS))
    if args.breakdown:
        text += (f"\n\n## Temporaries live at the peak, the {args.breakdown} largest groups by "
                 f"named scope (the compiler's buffer assignment)\n\n"
                 + markdown(peaks, BREAKDOWN_COLUMNS))
    print(text)
    if args.json:
        import _record
        _record.write_tables(args.json, ["goal_row_targets"],  # the breakdown is not recorded
                             _record.markdown_tables(text)[:1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
