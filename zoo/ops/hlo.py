"""Reading a compiled program's HLO text: how often an op *runs*, and the bytes collectives move.

Ops inside a ``while`` body appear once in the text; they run ``known_trip_count`` times (XLA
records it in the loop's backend config). `executions` weights every computation by how many
times its callers run it (loops multiply, conditionals' branches and fusions count once), so
"conditionals per program" or "bytes per collective kind" come out as executed totals, per
device, for an SPMD program.
"""

from __future__ import annotations

import collections
import re

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEES = re.compile(r"(?:condition|body|calls|to_apply|true_computation|false_computation)"
                      r"=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")
_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8,
              u64=8, f64=8)
_TRIVIAL = re.compile(r"replica_groups=\{(?:\{\d+\},?)+\}")  # groups of one device: no traffic
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def _parse(text: str):
    """{computation: [(result type, opcode, line)]}, the entry's name."""
    comps, entry, name = collections.defaultdict(list), None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0].split("(")[0]:
            name = m.group(1)
            if line.startswith("ENTRY"):
                entry = name
            continue
        i = _INSTR.match(line)
        if i and name is not None:
            comps[name].append((i.group(1), i.group(2), line))
    return comps, entry


def executions(text: str, root: str | None = None) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation (or of
    computation `root`, e.g. one branch of a conditional)."""
    comps, entry = _parse(text)
    entry = root or entry
    calls = collections.defaultdict(list)  # caller -> [(callee, factor)]
    for name, instrs in comps.items():
        for _, op, line in instrs:
            trip = _TRIP.search(line)
            factor = int(trip.group(1)) if op == "while" and trip else 1
            for single, branches in _CALLEES.findall(line):
                for callee in ([single] if single else re.findall(r"%?([\w.\-]+)", branches)):
                    calls[name].append((callee, factor))
    runs = collections.Counter({entry: 1})
    order, seen = [], set()

    def visit(n):  # callers before callees (the call graph is a DAG)
        if n in seen:
            return
        seen.add(n)
        for c, _ in calls[n]:
            visit(c)
        order.append(n)

    visit(entry)
    for n in reversed(order):
        for c, f in calls[n]:
            runs[c] += runs[n] * f
    return dict(runs)


def count_executed(text: str, opcode: str) -> int:
    """Executions of instructions with this opcode (e.g. ``"conditional"``)."""
    comps, _ = _parse(text)
    runs = executions(text)
    return sum(runs.get(n, 0) for n, instrs in comps.items() for _, op, _ in instrs
               if op == opcode)


def decisions(text: str) -> int:
    """Executions of data-dependent branch points: ``conditional``s and ``while`` loops with no
    known trip count (such as `zoo.ops.ring`'s run-if loops of 0 or 1 trips)."""
    comps, _ = _parse(text)
    runs = executions(text)
    return sum(runs.get(n, 0) for n, instrs in comps.items() for _, op, line in instrs
               if op == "conditional" or (op == "while" and not _TRIP.search(line)))


def branches(text: str) -> list[list[str]]:
    """Branch computations of every ``conditional``, in branch-index order (for a two-way
    `lax.cond`: [false, true])."""
    return [re.findall(r"%?([\w.\-]+)", m) for m in
            re.findall(r"\sconditional\(.*branch_computations=\{([^}]*)\}", text)]


def collective_bytes(text: str, floats_only: bool = False,
                     root: str | None = None) -> dict[str, int]:
    """Executed bytes of each collective kind's results (per device), {kind: bytes}, of the
    whole program or of one computation `root` (e.g. a conditional's branch)."""
    comps, _ = _parse(text)
    runs = executions(text, root)
    out = collections.Counter()
    for n, instrs in comps.items():
        for typ, op, line in instrs:
            kind = op.removesuffix("-start")
            if kind not in COLLECTIVES or _TRIVIAL.search(line):
                continue
            for dt, dims in _ARRAY.findall(typ):
                if floats_only and dt not in ("bf16", "f16", "f32", "f64"):
                    continue
                size = 1
                for d in filter(None, dims.split(",")):
                    size *= int(d)
                out[kind] += runs.get(n, 0) * size * _BYTES[dt]
    return dict(out)
