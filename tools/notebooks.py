"""Execute the repository's notebooks and store their outputs, or check that they are current.

    python tools/notebooks.py            # re-execute notebooks/*.ipynb in place, outputs saved
    python tools/notebooks.py --check    # re-execute in memory; exit 1 naming the stale cells
    python tools/notebooks.py notebooks/inspect_sharding.ipynb   # just this one

A script of the repository, not part of the package. The kernel runs this checkout's ``zoo``
(the repository root goes first on ``PYTHONPATH``) on 8 virtual CPU devices
(``JAX_PLATFORMS=cpu``), so the stored outputs are the same on every machine. Only the *text*
of the outputs is compared (streams, ``text/plain`` results, errors), with volatile parts
masked (`VOLATILE`: memory addresses, durations); HTML renderings and execution counts are
not. Needs ``nbclient``, ``nbformat`` and ``ipykernel`` (the ``[test]`` extra).
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import sys
from collections.abc import Sequence

__all__ = ["ROOT", "NOTEBOOKS", "VOLATILE", "kernel_env", "execute", "cell_texts",
           "differences", "main"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
DEVICES = 8
# (pattern, replacement): what may differ between two runs of the same notebook
VOLATILE = (
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),                                   # object addresses
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms|us|µs|ns|min)\b"), "<duration>"),  # timings
)


def kernel_env() -> dict[str, str]:
    """The environment the kernel gets: this checkout first on the path, 8 CPU devices."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # jax reads JAX_NUM_CPU_DEVICES (the jax_num_cpu_devices option) at import; it wins over
    # any count in XLA_FLAGS
    env["JAX_NUM_CPU_DEVICES"] = str(DEVICES)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def execute(path: str | os.PathLike, *, timeout: int = 900):
    """The notebook at `path`, executed top to bottom in its own folder (a new object)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", record_timing=False,
        resources={"metadata": {"path": str(pathlib.Path(path).resolve().parent)}})
    client.execute(env=kernel_env())
    return nb


def _mask(text: str) -> str:
    for pattern, replacement in VOLATILE:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.splitlines())


def cell_texts(nb) -> list[str]:
    """One string per code cell: the text of its outputs, volatile parts masked."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            elif out.get("output_type") == "error":
                parts.append(f"{out.get('ename')}: {out.get('evalue')}")
            else:
                parts.append(out.get("data", {}).get("text/plain", ""))
        texts.append(_mask("".join(p if isinstance(p, str) else "".join(p) for p in parts)))
    return texts


def differences(stored, fresh, *, context: int = 2, limit: int = 40) -> list[str]:
    """Readable differences between two executions' cell texts (empty: the same)."""
    a, b = cell_texts(stored), cell_texts(fresh)
    if len(a) != len(b):
        return [f"{len(a)} code cells stored, {len(b)} now"]
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            diff = list(difflib.unified_diff(x.splitlines(), y.splitlines(), "stored", "now",
                                             n=context, lineterm=""))
            out.append(f"code cell {i + 1}:\n" + "\n".join(diff[:limit]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/notebooks.py", description=__doc__.split(
        "\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when a stored output differs from a fresh run")
    args = parser.parse_args(argv)
    import nbformat

    paths = [pathlib.Path(p) for p in args.paths] or sorted(NOTEBOOKS.glob("*.ipynb"))
    stale = 0
    for path in paths:
        fresh = execute(path)
        if args.check:
            diffs = differences(nbformat.read(path, as_version=4), fresh)
            stale += bool(diffs)
            print(f"{path}: " + ("stale\n" + "\n".join(diffs) if diffs else "current"))
        else:
            nbformat.write(fresh, path)
            print(f"{path}: executed, outputs stored")
    if stale:
        print("refresh the stored outputs with: python tools/notebooks.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
