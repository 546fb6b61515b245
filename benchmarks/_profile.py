"""Where one compiled step spends its time: XLA's per-op timings from the jax profiler,
grouped by what the op does.

`profile_step` runs a compiled program a few times under `jax.profiler.trace`, reads the trace
back with `jax.profiler.ProfileData` and sums the duration of every executed HLO op (the CPU
runtime records one event per op it runs, on every device). Each op is put in one `CATEGORIES`
row by its opcode and its named scope (the ``op_name`` metadata XLA keeps from
`jax.named_scope`, forward and backward alike):

* ``collectives``: all-gather, reduce-scatter, all-reduce, all-to-all (ragged too),
  collective-permute, wherever they are;
* ``optimizer``: the optimizer update (the train step's ``optimizer`` scope);
* ``attention``: the attention op inside each layer's ``attend`` scope (the kernel, the ring
  or the gather's local work, MLA's latent expansion), not the q/k/v/o projections;
* ``grouped matmul``: the experts' matmuls (`zoo.ops.moe`'s ``grouped_matmul`` scope);
* ``dense matmuls``: every other op that contains a dot (projections, dense MLPs, shared
  experts, the router, the head);
* ``MoE dispatch``: the rest of the ``moe`` scope (routing, sorting, gathering and scattering
  the token copies, combining);
* ``other``: everything else (norms, RoPE, the loss, casts, copies).

Each row's time is its share of all op time times the step's (untraced) wall time, so the
rows add up to the step. Its FLOPs are those of the dots in the ops that actually ran
(`zoo.ops.hlo`'s count per op, times the op's executions in the trace, summed over the
devices: skipped attention blocks and idle expert blocks count nothing), and its MFU is
those FLOPs over its time against the machine's matmul rate. On virtual CPU devices a
collective's time includes the wait for the slowest peer.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

__all__ = ["CATEGORIES", "categorize", "profile_step", "format_profile"]

CATEGORIES = ("attention", "MoE dispatch", "grouped matmul", "dense matmuls", "collectives",
              "optimizer", "other")
_CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")


def _scopes(op_name: str) -> list[str]:
    return op_name.split("/") if op_name else []


def categorize(opcode: str, op_name: str | None, flops: float) -> str:
    """The `CATEGORIES` row of one op, from its opcode, its ``op_name`` and its dot FLOPs."""
    from zoo.ops.hlo import _KIND
    scopes = _scopes(op_name or "")
    if opcode in _KIND or opcode.removesuffix("-done") in _KIND:
        return "collectives"
    if "optimizer" in scopes:
        return "optimizer"
    if "attend" in scopes:
        return "attention"
    if "grouped_matmul" in scopes:
        return "grouped matmul"
    if flops > 0:
        return "dense matmuls"
    if "moe" in scopes:
        return "MoE dispatch"
    return "other"


def _op_table(text: str) -> dict[str, tuple[str, str | None, float]]:
    """HLO op name -> (opcode, op_name, dot FLOPs per execution of the op, fusions included)
    for every op of every computation of a compiled module."""
    from zoo.ops.hlo import parse
    module = parse(text)
    flops_of: dict[str, float] = {}

    def comp_flops(comp: str) -> float:  # the dots a fused computation holds
        if comp not in flops_of:
            flops_of[comp] = 0.0
            total = 0.0
            for ins in module.computations.get(comp, ()):
                total += _own_flops(ins, module.types[comp])
                if ins.opcode == "fusion":
                    total += sum(comp_flops(c) for c in ins.callees)
            flops_of[comp] = total
        return flops_of[comp]

    table = {}
    for comp, ins in module.instructions():
        f = _own_flops(ins, module.types[comp])
        if ins.opcode == "fusion":
            f += sum(comp_flops(c) for c in ins.callees)
        table[ins.name] = (ins.opcode, ins.op_name, f)
    return table


def _own_flops(ins, types) -> float:
    from zoo.ops.hlo import _dot_flops
    return _dot_flops(ins, types) if ins.opcode in ("dot", "convolution") else 0.0


def _op_times(trace_dir: str, module_name: str) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds and executions per HLO op name, summed over devices and runs, for the ops of
    `module_name`."""
    from jax.profiler import ProfileData
    times: collections.Counter = collections.Counter()
    runs: collections.Counter = collections.Counter()
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            for line in plane.lines:
                for event in line.events:
                    stats = dict(event.stats)
                    if stats.get("hlo_module") == module_name and "hlo_op" in stats:
                        times[stats["hlo_op"]] += event.duration_ns * 1e-9
                        runs[stats["hlo_op"]] += 1
    return dict(times), dict(runs)


def profile_step(compiled, run, *, steps: int = 2) -> dict:
    """Profile `steps` calls of ``run()`` (one execution of `compiled` each, blocking).

    Returns ``op_seconds`` ({category: seconds of op time}, all devices, all steps),
    ``flops`` ({category: FLOPs of the dots that ran in one step, all devices}: each executed
    op's dots, so skipped blocks and untaken branches count nothing), ``wall_s`` (the traced
    step) and ``unmatched_s`` (op time the compiled text does not name)."""
    import time

    import jax
    text = compiled.as_text()
    first = next(line for line in text.splitlines() if line.startswith("HloModule"))
    module_name = first.split()[1].rstrip(",")
    table = _op_table(text)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            start = time.perf_counter()
            for _ in range(steps):
                run()
            wall = (time.perf_counter() - start) / steps
        times, runs = _op_times(tmp, module_name)
    if not times:
        raise RuntimeError(f"the profiler recorded no op of module {module_name!r}; this "
                           f"backend's runtime may not trace its ops")
    seconds_by: collections.Counter = collections.Counter()
    flops_by: collections.Counter = collections.Counter()
    unknown = 0.0
    for name, seconds in times.items():
        opcode, op_name, op_flops = table.get(name, ("?", None, 0.0))
        if opcode in _CONTAINERS:
            continue  # its body's ops carry their own events
        if opcode == "?":
            unknown += seconds
        cat = categorize(opcode, op_name, op_flops)
        seconds_by[cat] += seconds
        flops_by[cat] += runs[name] * op_flops / steps
    return dict(op_seconds=dict(seconds_by), flops=dict(flops_by), wall_s=wall,
                unmatched_s=unknown)


def format_profile(title: str, prof: dict, *, machine_rate: float, step_s: float) -> str:
    """Markdown table: per category its share of op time, its ms of `step_s` (the untraced
    step), its GFLOP (all devices), its achieved GFLOP/s and its MFU against
    `machine_rate`."""
    total = sum(prof["op_seconds"].values()) or 1.0
    wall = step_s
    lines = [f"{title}: step {wall * 1e3:.0f} ms ({prof['wall_s'] * 1e3:.0f} ms traced; shares "
             f"of the traced op time)", "",
             "| part | share | ms of the step | GFLOP | GFLOP/s | MFU |",
             "|---|---|---|---|---|---|"]
    for cat in CATEGORIES:
        share = prof["op_seconds"].get(cat, 0.0) / total
        ms = share * wall * 1e3
        gflop = prof["flops"].get(cat, 0.0) / 1e9
        rate = gflop / (ms / 1e3) if ms > 0 else 0.0
        mfu = f"{rate * 1e9 / machine_rate:.1%}" if gflop else "-"
        lines.append(f"| {cat} | {share:.1%} | {ms:.0f} | {gflop:.2f} | "
                     f"{rate:.1f} | {mfu} |")
    return "\n".join(lines)
