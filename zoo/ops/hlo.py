"""HLO module text read once, seen two ways: how often each op *runs*, and what a program costs.

Ops inside a ``while`` body appear once in the text; they run ``known_trip_count`` times (XLA
records it in the loop's backend config; the TPU compiler does not, and the count is read off
the loop's condition, `Module.trip_count`; XLA's own cost analysis counts a loop body once).
`parse` reads a module's text (``compiled.as_text()`` or a lowered module's HLO) into its
computations and instructions; both views below read that parse. Figures are per device for
an SPMD program.

* Executions: `executions` weights every computation by how many times its callers run it
  (loops multiply, every branch of a conditional and every fusion counts once), so
  `count_executed` ("conditionals per program"), `decisions` and `collective_bytes` (the
  bytes of each collective kind's results, of the program or of one `branches` computation)
  come out as executed totals.
* The rehearsal's counter: `hlo_stats` -> `HloStats`, the FLOPs of dots and convolutions,
  collective bytes and counts, dots by operand dtype and instructions. A conditional counts
  its costliest branch (an upper bound), and so do the 0-or-1-trip loops of one
  `zoo.ops.ring` decision (their named scope is `ONE_OF`). Collective bytes are buffer sizes:
  the gathered result of an all-gather, the input of a reduce-scatter, all-reduce, all-to-all
  or collective-permute.

Where no conditional or reduce-scatter runs, the two views' collective bytes agree.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Sequence

import numpy as np

from zoo.ops.ring import ONE_OF

__all__ = ["COLLECTIVES", "HloStats", "Instr", "Module", "branches", "collective_bytes",
           "count_executed", "decisions", "executions", "hlo_stats", "parse"]

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_KIND = {**{k: k for k in COLLECTIVES}, **{f"{k}-start": k for k in COLLECTIVES},
         "ragged-all-to-all": "all-to-all", "ragged-all-to-all-start": "all-to-all"}
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16}
_FLOATS = ("bf16", "f16", "f32", "f64")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")  # the printer's ``/*index=5*/`` in long operand lists
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)="
                    r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIVIAL = re.compile(r"replica_groups=\{(?:\{\d+\},?)+\}")  # groups of one device: no traffic
_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


# -- the parse ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction: ``name = type opcode(operands), attrs``."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str

    @property
    def trip_count(self) -> int | None:
        """A ``while``'s known trip count (None if XLA does not know it)."""
        trip = _TRIP.search(self.attrs)
        return int(trip.group(1)) if trip else None

    @property
    def op_name(self) -> str | None:
        op = _OP_NAME.search(self.attrs)
        return op.group(1) if op else None

    @property
    def callees(self) -> list[str]:
        """Computations it calls, branches excluded (fusion, while body and condition, ...)."""
        return _CALLS.findall(self.attrs)

    @property
    def device_groups(self) -> list[tuple[int, ...]] | None:
        """The device groups a collective moves data within: its ``replica_groups`` (listed,
        XLA's iota form ``[G,S]<=[dims]T(perm)``, or its mesh form ``mesh['a'=2,'b'=8]
        {'b'}``), or a collective-permute's source-target pairs; None where the instruction
        states none (every device, one group), [] where it states them in a form not read
        here."""
        if m := _GROUPS.search(self.attrs):
            return [tuple(int(d) for d in g.split(",") if d)
                    for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        if m := _GROUPS_IOTA.search(self.attrs):
            dims = [int(d) for d in m.group(3).split(",")]
            ids = np.arange(int(np.prod(dims))).reshape(dims)
            if m.group(4):
                ids = ids.transpose([int(d) for d in m.group(4).split(",")])
            return [tuple(g) for g in ids.reshape(int(m.group(1)), int(m.group(2))).tolist()]
        if m := _GROUPS_MESH.search(self.attrs):  # mesh['a'=2,'b'=8] {'b'}: groups over b
            axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
            names = [a for a, _ in axes]
            over = re.findall(r"'([^']+)'", m.group(2))
            if not set(over) <= set(names) or len(axes) != m.group(1).count("="):
                return []  # a form not read here (sub-axes): unknown groups
            ids = np.arange(int(np.prod([int(n) for _, n in axes]))).reshape(
                [int(n) for _, n in axes])
            kept = [i for i, a in enumerate(names) if a not in over]
            ids = ids.transpose(kept + [names.index(a) for a in over])
            size = int(np.prod([ids.shape[len(kept) + i] for i in range(len(over))]))
            return [tuple(g) for g in ids.reshape(-1, size).tolist()]
        if m := _PAIRS.search(self.attrs):
            return [tuple(map(int, pair)) for pair in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
        return [] if "replica_groups=" in self.attrs or "source_target_pairs=" in self.attrs \
            else None

    @property
    def branches(self) -> list[str]:
        """A conditional's branch computations, in branch-index order."""
        return [b.strip().lstrip("%") for group in _BRANCHES.findall(self.attrs)
                for b in group.split(",") if b.strip()]


@dataclasses.dataclass(frozen=True)
class Module:
    """Instructions per computation, name -> type per computation, the entry's name."""

    computations: dict[str, list[Instr]]
    types: dict[str, dict[str, str]]
    entry: str

    def instructions(self):
        """``(computation, instruction)`` for every instruction."""
        return ((c, ins) for c, instrs in self.computations.items() for ins in instrs)

    def trip_count(self, ins: Instr) -> int | None:
        """A ``while``'s trips: its ``known_trip_count``, else read off a condition whose root
        is ``counter < N`` with N a constant (a scan or fori_loop from 0 by 1; the TPU
        compiler's loops carry no backend config), else None (a data-dependent loop)."""
        if ins.trip_count is not None or ONE_OF in (ins.op_name or ""):
            return ins.trip_count
        m = re.search(r"condition=%?([\w.\-]+)", ins.attrs)
        cond = self.computations.get(m.group(1), []) if m else []
        if not cond or cond[-1].opcode != "compare" or "direction=LT" not in cond[-1].attrs:
            return None
        by_name = {i.name: i for i in cond}
        counter, bound = (by_name.get(o) for o in cond[-1].operands[:2])
        if counter is None or bound is None or counter.opcode != "get-tuple-element" or \
                bound.opcode != "constant" or not re.fullmatch(r"\d+", bound.operands[0]):
            return None
        return int(bound.operands[0])


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of every array in an HLO type (a tuple type gives several)."""
    return [(d, tuple(int(n) for n in dims.split(",") if n))
            for d, dims in _ARRAY.findall(type_text)]


def _nbytes(arrays: list[tuple[str, tuple[int, ...]]]) -> float:
    return sum(math.prod(dims) * _BYTES.get(d, 1 if d.startswith("f8") else 4)
               for d, dims in arrays)


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO line {text[:120]!r}")


def _parse_instr(line: str) -> Instr | None:
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _matching(rest, 0) + 1
        type_text, rest = rest[:end], rest[end:]
    else:
        type_text, _, rest = rest.partition(" ")
    op = re.match(r"\s*([\w\-]+)\(", rest)
    if not op:
        return None
    open_at = op.end() - 1
    close = _matching(rest, open_at)
    operands = tuple(_COMMENT.sub("", o).split()[-1].lstrip("%")
                     for o in _split_top(rest[open_at + 1:close]))
    return Instr(m.group(1), type_text, op.group(1), operands, rest[close + 1:])


@functools.lru_cache(maxsize=4)
def parse(text: str) -> Module:
    """Read an HLO module's text (a compiled or a lowered program). Cached, so the views below
    parse a text once however many of them read it: the `Module` is shared, read it only."""
    comps: dict[str, list[Instr]] = {}
    types: dict[str, dict[str, str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            m = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{$", stripped)
            if m and " = " not in stripped:  # a computation header (lowered HLO: no signature)
                current = m.group(2)
                entry = current if m.group(1) else entry
                comps[current], types[current] = [], {}
                sig = m.group(3) or "()"
                for p in _split_top(sig[1:_matching(sig, 0)]):
                    name, _, t = _COMMENT.sub("", p).partition(":")
                    types[current][name.strip().lstrip("%")] = t.strip()
            continue
        if stripped.startswith("}"):  # also ``}, execution_thread="sparsecore"`` (TPU)
            current = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            comps[current].append(ins)
            types[current][ins.name] = ins.type
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass a whole module's text "
                         "(compiled.as_text() or lowered.as_text(dialect='hlo'))")
    return Module(comps, types, entry)


# -- executions --------------------------------------------------------------------------------

def executions(text: str, root: str | None = None) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation (or of
    computation `root`, e.g. one branch of a conditional)."""
    module = parse(text)
    calls = collections.defaultdict(list)  # caller -> [(callee, factor)]
    for name, ins in module.instructions():
        factor = (module.trip_count(ins) or 1) if ins.opcode == "while" else 1
        calls[name] += [(callee, factor) for callee in ins.callees + ins.branches]
    root = root or module.entry
    runs = collections.Counter({root: 1})
    order, seen = [], set()

    def visit(n):  # callers before callees (the call graph is a DAG)
        if n in seen:
            return
        seen.add(n)
        for c, _ in calls[n]:
            visit(c)
        order.append(n)

    visit(root)
    for n in reversed(order):
        for c, f in calls[n]:
            runs[c] += runs[n] * f
    return dict(runs)


def _executed(text: str, keep) -> int:
    runs = executions(text)
    return sum(runs.get(c, 0) for c, ins in parse(text).instructions() if keep(ins))


def count_executed(text: str, opcode: str) -> int:
    """Executions of instructions with this opcode (e.g. ``"conditional"``)."""
    return _executed(text, lambda ins: ins.opcode == opcode)


def decisions(text: str) -> int:
    """Executions of data-dependent branch points: ``conditional``s and ``while`` loops with no
    known trip count (such as `zoo.ops.ring`'s run-if loops of 0 or 1 trips)."""
    module = parse(text)
    return _executed(text, lambda ins: ins.opcode == "conditional" or (
        ins.opcode == "while" and module.trip_count(ins) is None))


def branches(text: str) -> list[list[str]]:
    """Branch computations of every ``conditional``, in branch-index order (for a two-way
    `lax.cond`: [false, true])."""
    return [ins.branches for _, ins in parse(text).instructions()
            if ins.opcode == "conditional" and ins.branches]


def collective_bytes(text: str, floats_only: bool = False,
                     root: str | None = None, scope: str | None = None) -> dict[str, int]:
    """Executed bytes of each collective kind's results (per device), {kind: bytes}, of the
    whole program or of one computation `root` (e.g. a conditional's branch); with `scope`,
    only collectives whose ``op_name`` metadata contains it (a `jax.named_scope`, such as
    ``"/mix/"``: the collectives one part of a layer issues, apart from FSDP's)."""
    runs = executions(text, root)
    out = collections.Counter()
    for c, ins in parse(text).instructions():
        kind = _KIND.get(ins.opcode)
        if kind is None or _TRIVIAL.search(ins.attrs):
            continue
        if scope is not None and not any(scope in n for n in _OP_NAME.findall(ins.attrs)):
            continue
        arrays = [a for a in _arrays(ins.type) if not floats_only or a[0] in _FLOATS]
        if arrays:
            out[kind] += runs.get(c, 0) * _nbytes(arrays)
    return dict(out)


# -- the rehearsal's counter -------------------------------------------------------------------

def _dot_flops(ins: Instr, types: dict[str, str]) -> float:
    out = _arrays(ins.type)
    lhs = _arrays(types.get(ins.operands[0], ""))
    if not out or not lhs:
        return 0.0
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        dims = [int(d) for d in m.group(1).split(",") if d] if m else []
        return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in dims)
    # convolution: each output element takes the input features times the kernel positions
    # that land on real input (not padding or dilation holes): TPU writes dots and ragged
    # dots' transposes as convolutions that pad or dilate their input to the window
    rhs = _arrays(types.get(ins.operands[1], ""))
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not rhs or not labels or "i" not in labels.group(2):
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    kernel, image, result = rhs[0][1], lhs[0][1], out[0][1]
    window = _window(ins.attrs)
    taps, positions = 1, 1
    for n, d in enumerate(sorted(c for c in rhs_l if c.isdigit())):
        stride, pad, lhs_dil, rhs_dil = (window.get(key, [dflt] * (n + 1))[n]
                                         for key, dflt in _WINDOW_DEFAULTS)
        m = result[out_l.index(d)]
        taps *= _taps(image[lhs_l.index(d)], kernel[rhs_l.index(d)], m, stride, pad, lhs_dil,
                      rhs_dil)
        positions *= m
    return 2.0 * math.prod(result) / max(positions, 1) * taps * kernel[rhs_l.index("i")]


_WINDOW_DEFAULTS = (("stride", 1), ("pad", 0), ("lhs_dilate", 1), ("rhs_dilate", 1))


def _window(attrs: str) -> dict[str, list[int]]:
    """A convolution's ``window={size=4x4 stride=3x3 pad=1_1x0_0 lhs_dilate=...}`` per field
    and spatial dimension (``pad``: the low padding)."""
    m = re.search(r"window=\{([^}]*)\}", attrs)
    out: dict[str, list[int]] = {}
    for field in (m.group(1).split() if m else ()):
        key, _, value = field.partition("=")
        out[key] = [int(v.split("_")[0]) for v in value.split("x")]
    return out


def _taps(n: int, k: int, m: int, stride: int, pad: int, lhs_dil: int, rhs_dil: int) -> int:
    """Over the `m` output positions of one spatial dimension, the kernel taps that land on
    one of the `n` input positions (the input dilated by `lhs_dil`, low-padded by `pad`)."""
    if m * k > 2 ** 24:  # too many to list: every output position sees at most n of them
        return m * min(k, n)
    at = np.arange(m)[:, None] * stride + np.arange(k)[None, :] * rhs_dil - pad
    return int(np.sum((at >= 0) & (at % lhs_dil == 0) & (at // lhs_dil < n)))


def _buffer_bytes(ins: Instr, kind: str, types: dict[str, str]) -> float:
    """An all-gather's gathered result; the input of the other collectives (a ragged
    all-to-all's rows to send: its other operands are the receive buffer and offsets)."""
    if kind == "all-gather":
        return max((_nbytes([a]) for a in _arrays(ins.type)), default=0)
    operands = ins.operands[:1] if ins.opcode.startswith("ragged-") else ins.operands
    return sum(_nbytes(_arrays(types.get(o, ""))) for o in operands)


@dataclasses.dataclass
class HloStats:
    """Counts of one HLO module; loop bodies multiplied by their trip counts."""

    instructions: int = 0            # static: instructions in the text, each counted once
    flops: float = 0.0               # dots + convolutions
    collective_bytes: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(COLLECTIVES, 0.0))
    collective_counts: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    dots_by_dtype: dict[str, int] = dataclasses.field(default_factory=dict)  # operand dtype,
    # each dot instruction once (a loop body's once, whatever its trips)
    dot_names: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # dtype -> op_name
    unknown_trip_counts: int = 0     # while loops without known_trip_count (counted once)
    # the part of collective_bytes whose device groups span hosts (`hlo_stats`'s ``hosts``)
    cross_host_bytes: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(COLLECTIVES, 0.0))


def _spans_hosts(ins: Instr, hosts: Sequence[int]) -> bool:
    """Whether a collective's device groups (`Instr.device_groups`: partition ids, the mesh's
    device order) hold devices of more than one host (``hosts[id]``); groups in a form not
    read count as within a host, so a bound built on these bytes stays a lower bound."""
    groups = ins.device_groups
    if groups is None:
        return len(set(hosts)) > 1
    return any(len({hosts[d] for d in g if d < len(hosts)}) > 1 for g in groups)


def hlo_stats(text: str, hosts: Sequence[int] | None = None) -> HloStats:
    """Count an HLO module's text (``compiled.as_text()`` or a lowered module's HLO).
    ``hosts``: each partition's host (the mesh's devices in order, e.g. their process
    index), to split off the collective bytes that cross hosts (``cross_host_bytes``)."""
    module = parse(text)
    comps, types = module.computations, module.types
    stats = HloStats(instructions=sum(len(v) for v in comps.values()))

    @functools.cache
    def totals(comp: str) -> tuple:
        flops, coll, counts = 0.0, collections.Counter(), collections.Counter()
        cross: collections.Counter = collections.Counter()
        dots: collections.Counter = collections.Counter()
        names: dict[str, set] = collections.defaultdict(set)
        unknown, one_of = 0, []

        def add(callee, n):
            nonlocal flops, unknown
            f, c, k, d, nm, u, x = totals(callee)
            flops += n * f
            unknown += u
            for key, v in c.items():
                coll[key] += n * v
            for key, v in x.items():
                cross[key] += n * v
            for key, v in k.items():
                counts[key] += n * v
            for key, v in d.items():  # dot instructions, each once (not per trip)
                dots[key] += v
            for key, v in nm.items():
                names[key] |= v

        for ins in comps.get(comp, ()):
            if ins.opcode in ("dot", "convolution"):
                flops += _dot_flops(ins, types[comp])
                lhs = _arrays(types[comp].get(ins.operands[0], ""))
                dtype = lhs[0][0] if lhs else "?"
                dots[dtype] += 1
                names[dtype].add(ins.op_name or ins.name)
            kind = _KIND.get(ins.opcode)
            if kind:
                nbytes = _buffer_bytes(ins, kind, types[comp])
                coll[kind] += nbytes
                counts[kind] += 1
                if hosts is not None and _spans_hosts(ins, hosts):
                    cross[kind] += nbytes
            callees = [(name, 1) for name in ins.callees]
            if ins.branches:  # a conditional runs one branch: count the costliest (an upper bound)
                callees.append((max(ins.branches, key=lambda b: totals(b)[0]), 1))
            if ins.opcode == "while":
                trip = module.trip_count(ins)
                if trip is None and ONE_OF in (ins.op_name or ""):
                    # one of a decision's 0-or-1-trip loops (`zoo.ops.ring`), of which one
                    # runs: like a conditional's branches, only the costliest is counted
                    one_of.append([name for name, _ in callees])
                    continue
                unknown += trip is None
                callees = [(name, trip or 1) for name, _ in callees]
            for callee, n in callees:
                add(callee, n)
        if one_of:  # one decision's loops share a computation (a sub-block's visit)
            for callee in max(one_of, key=lambda cs: sum(totals(c)[0] for c in cs)):
                add(callee, 1)
        return flops, coll, counts, dots, names, unknown, cross

    flops, coll, counts, dots, names, unknown, cross = totals(module.entry)
    stats.flops = flops
    stats.collective_bytes.update(coll)
    stats.cross_host_bytes.update(cross)
    stats.collective_counts.update(counts)
    stats.dots_by_dtype = dict(sorted(dots.items()))
    stats.dot_names = {k: sorted(v) for k, v in sorted(names.items())}
    stats.unknown_trip_counts = unknown
    return stats
