"""The floors of docs/design.md hold in the imports: a module imports only from its own floor
or the floors below it, never from a floor above, and no two modules import each other, even
through others or inside a function (a lazy import is still a dependency). `zoo/__init__.py`,
the package's front door, may name any floor lazily; every other module is checked."""

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
ZOO = ROOT / "zoo"

# Lowest first. A module belongs to the floor of the longest prefix of its name listed here
# (zoo.inference.cli sits on the command floor, the rest of zoo.inference below zoo.train).
FLOORS = (
    ("compat", ("zoo._flax_compat", "zoo._jax_compat")),
    ("partitioning", ("zoo.partitioning", "zoo.targets")),
    ("ops", ("zoo.ops",)),
    ("layers", ("zoo.layers",)),
    ("models", ("zoo.models", "zoo.shardings")),
    ("data", ("zoo.data",)),
    ("inference", ("zoo.inference", "zoo.speculative")),
    ("train", ("zoo.train",)),
    ("commands", ("zoo.inference.cli", "zoo.inference.rehearsal", "zoo.generate",
                  "zoo.evaluate")),
)
# floors that must not see each other although one sits above the other
UNRELATED = {("data", "ops"), ("data", "layers"), ("data", "models")}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ZOO.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the zoo modules it imports (anywhere in the file)."""
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = collections.defaultdict(set)
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                target = owner(name) if name.startswith("zoo") else None
                if target and target not in (mod, "zoo") and not mod.startswith(target + "."):
                    edges[mod].add(target)
    return edges


def floor_of(mod: str) -> int | None:
    """The floor of the longest prefix of `mod` named in `FLOORS`."""
    best = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_floor():
    assert [m for m in modules() if m != "zoo" and floor_of(m) is None] == []


def test_nothing_points_up_a_floor():
    mods = modules()
    bad = []
    for mod, targets in imports(mods).items():
        if mod == "zoo":
            continue
        for target in sorted(targets):
            a, b = floor_of(mod), floor_of(target)
            pair = (FLOORS[a][0], FLOORS[b][0])
            if b > a or pair in UNRELATED:
                bad.append(f"{mod} ({pair[0]}) imports {target} ({pair[1]})")
    assert bad == [], "\n".join(bad)


def test_no_import_cycles():
    edges = imports(modules())
    edges.pop("zoo", None)
    assert cycles(edges) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floor_of("zoo.ops.ring") < floor_of("zoo.layers.mla") < floor_of("zoo.train.cli")
    assert floor_of("zoo.inference.engine") < floor_of("zoo.train.cli") \
        < floor_of("zoo.inference.cli")


def private_crossings(mods: dict[str, pathlib.Path]) -> list[str]:
    """``_name``s of one zoo module used by another (``from zoo.x import _y``, or
    ``alias._y`` where ``alias`` names another zoo module)."""
    hits = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zoo"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in mods:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        hits.append(f"{mod}:{node.lineno}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("zoo") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id, mod) != mod and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                hits.append(f"{mod}:{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(set(hits))


def test_no_private_name_crosses_a_module():
    """What two modules share is public in the module that owns it."""
    assert private_crossings(modules()) == []


def test_library_internals_are_read_in_compat_modules_only():
    """``jax._src`` and ``tokamax._src`` are imported by ``zoo/*_compat.py`` alone, where each
    use is keyed to the versions it was checked on."""
    bad = []
    for mod, path in modules().items():
        if mod.endswith("_compat"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{mod}:{node.lineno}: {n}" for n in names if "._src" in n]
    assert bad == [], "\n".join(bad)
