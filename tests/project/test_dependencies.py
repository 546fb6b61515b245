"""Every third-party module zoo imports is declared in pyproject.toml: a module imported at
the top of a file in `dependencies`; one imported only inside a function or a ``try`` (an
optional, guarded import) in `dependencies` or in an extra."""

import ast
import functools
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Import names whose distribution is not installed here (optional extras), or named otherwise.
KNOWN = {"wandb": "wandb", "yaml": "pyyaml"}


def _requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_requirement_name(r) for r in project["dependencies"]}
    extras = {_requirement_name(r) for reqs in project["optional-dependencies"].values()
              for r in reqs}
    return required, extras


def _imports(tree: ast.Module):
    """(top-level module name, guarded) for every import; guarded = inside a function, a
    class body's method, or a ``try``."""
    def walk(node, guarded):
        for child in ast.iter_child_nodes(node):
            inner = guarded or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Try, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name.split(".")[0], guarded
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.module.split(".")[0], guarded
            yield from walk(child, inner)
    yield from walk(tree, False)


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distribution(module: str) -> str:
    names = _installed().get(module)
    if names:
        return names[0].lower().replace("_", "-")
    return KNOWN.get(module, module).lower().replace("_", "-")


def test_every_third_party_import_is_declared():
    required, extras = _declared()
    missing = []
    for path in sorted((ROOT / "zoo").rglob("*.py")):
        for module, guarded in _imports(ast.parse(path.read_text())):
            if module in sys.stdlib_module_names or module in {"zoo", "__future__"}:
                continue
            dist = _distribution(module)
            if dist in required or (guarded and dist in extras):
                continue
            where = "an extra (guarded import) or dependencies" if guarded else "dependencies"
            missing.append(f"{path.relative_to(ROOT)}: `{module}` (distribution {dist}) "
                           f"is not declared in {where}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_the_check_sees_an_undeclared_import():
    tree = ast.parse("import tensorflow\ndef f():\n    import wandb\n")
    found = dict(_imports(tree))
    assert found == {"tensorflow": False, "wandb": True}
    required, extras = _declared()
    assert _distribution("tensorflow") not in required | extras
