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
* ``grouped matmul``: the experts' matmuls (`zoo.ops.grouped`'s ``grouped_matmul`` scope);
* ``dense matmuls``: every other op that contains a dot (projections, dense MLPs, shared
  experts, the router, the head);
* ``MoE dispatch``: the rest of the ``moe`` scope (routing, sorting, gathering and scattering
  the token copies, combining);
* ``other``: everything else (norms, RoPE, the loss, casts, copies).

Each row's time is its share of the traced step's busy wall time, times the step's (untraced)
wall time, so the rows add up to the step. On a shared CPU the virtual devices' ops overlap
and contend for the cores, and a device waiting in a collective uses no core, so op durations
summed over devices would overstate what waits and understate what computes. The trace is
therefore swept in time: each instant on which some device runs a compute op goes to the
categories of the compute ops running then, shared equally among them; an instant on which
devices only communicate or wait goes to ``collectives``; instants with no op (host work)
are left out. Its FLOPs are those of the dots in the ops that actually ran (`zoo.ops.hlo`'s
count per op, times the op's executions in the trace, summed over the devices: skipped
attention blocks and idle expert blocks count nothing), and its MFU is those FLOPs over its
time against the machine's matmul rate.
"""

from __future__ import annotations

import collections
import glob
import heapq
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


def _line_intervals(line, module_name: str, label):
    """``(start ns, end ns, label(op name))`` of `line`'s ops of `module_name`, in time order
    (a trace line is one thread), skipping ops whose label is None."""
    for event in line.events:
        stats = dict(event.stats)
        if stats.get("hlo_module") == module_name and "hlo_op" in stats:
            cat = label(stats["hlo_op"])
            if cat is not None:
                yield int(event.start_ns), int(event.end_ns), cat


def sweep(lines) -> dict[str, float]:
    """Wall seconds per category from time-ordered ``(start ns, end ns, category)`` streams
    (one per trace line), merged in time without holding them: each instant goes to the
    compute categories active then, shared by how many of their ops are active; an instant
    with only ``collectives`` active goes to them; idle instants to none."""
    active: collections.Counter = collections.Counter()
    wall: collections.Counter = collections.Counter()
    ends: list[tuple[int, str]] = []
    now = None

    def advance(to: int) -> None:
        nonlocal now
        if now is not None and to > now:
            dt = (to - now) * 1e-9
            compute = sum(n for c, n in active.items() if c != "collectives")
            if compute:
                for c, n in active.items():
                    if c != "collectives" and n:
                        wall[c] += dt * n / compute
            elif active["collectives"]:
                wall["collectives"] += dt
        now = to if now is None else max(now, to)

    for start, end, cat in heapq.merge(*lines):
        while ends and ends[0][0] <= start:
            t, c = heapq.heappop(ends)
            advance(t)
            active[c] -= 1
        advance(start)
        active[cat] += 1
        heapq.heappush(ends, (end, cat))
    while ends:
        t, c = heapq.heappop(ends)
        advance(t)
        active[c] -= 1
    return dict(wall)


def profile_step(compiled, run, *, steps: int = 2) -> dict:
    """Profile `steps` calls of ``run()`` (one execution of `compiled` each, blocking).

    Returns ``op_seconds`` ({category: wall seconds of one step, from `sweep`}),
    ``flops`` ({category: FLOPs of the dots that ran in one step, all devices}: each executed
    op's dots, so skipped blocks and untaken branches count nothing), ``wall_s`` (the traced
    step) and ``unmatched_ops`` (executed ops the compiled text does not name)."""
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
        flops_by: collections.Counter = collections.Counter()
        unknown = [0]

        def label(name: str) -> str | None:
            opcode, op_name, op_flops = table.get(name, ("?", None, 0.0))
            if opcode in _CONTAINERS:
                return None  # its body's ops carry their own events
            cat = categorize(opcode, op_name, op_flops)
            flops_by[cat] += op_flops / steps
            if opcode == "?":
                unknown[0] += 1
            return cat

        from jax.profiler import ProfileData
        planes = [plane for path in glob.glob(os.path.join(tmp, "**", "*.xplane.pb"),
                                              recursive=True)
                  for plane in ProfileData.from_file(path).planes]
        wall_by = sweep([_line_intervals(line, module_name, label)
                         for plane in planes for line in plane.lines])
    if not wall_by:
        raise RuntimeError(f"the profiler recorded no op of module {module_name!r}; this "
                           f"backend's runtime may not trace its ops")
    seconds_by = {c: s / steps for c, s in wall_by.items()}
    return dict(op_seconds=seconds_by, flops=dict(flops_by), wall_s=wall,
                unmatched_ops=unknown[0])


def format_profile(title: str, prof: dict, *, machine_rate: float, step_s: float) -> str:
    """Markdown table: per category its share of op time, its ms of `step_s` (the untraced
    step), its GFLOP (all devices), its achieved GFLOP/s and its MFU against
    `machine_rate`."""
    total = sum(prof["op_seconds"].values()) or 1.0
    wall = step_s
    lines = [f"{title}: step {wall * 1e3:.0f} ms ({prof['wall_s'] * 1e3:.0f} ms traced; shares "
             f"of the traced busy wall time)", "",
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
