"""``--json PATH`` for the benchmark scripts: the markdown tables a script prints, as records.

Each printed table (its ``| ... |`` lines, titled by the nearest ``## ...`` line above it)
becomes one JSON record in the format `tools/benchmarks_page.py` renders into
docs/benchmarks.md: ``benchmark``, ``title``, ``command``, ``date``, ``commit``, ``machine``,
``load_average``, ``columns``, ``rows``. ``PATH`` ending in ``.json`` takes a script's single
table; otherwise it is a folder and table k goes to ``PATH/<names[k]>.json``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()


def markdown_tables(text: str) -> list[tuple[str | None, list[str], list[list[str]]]]:
    """``(title, columns, rows)`` of every markdown table in ``text``."""
    tables, title, lines = [], None, text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            title = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(
                r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            cells = lambda s: [c.strip() for c in s.strip().strip("|").split("|")]
            columns, rows, i = cells(line), [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            tables.append((title, columns, rows))
            continue
        i += 1
    return tables


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                              text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" (uncommitted changes)" if git("status", "--porcelain", "-uno") else "")


def _machine() -> str:
    text = f"{platform.node()}: {os.cpu_count()} CPU cores ({platform.machine()})"
    jax = sys.modules.get("jax")
    if jax is not None:
        with contextlib.suppress(Exception):
            devices = jax.devices()
            text += f", {len(devices)} {devices[0].platform} devices ({devices[0].device_kind})"
    return text


def _load() -> float | None:
    with contextlib.suppress(OSError, AttributeError):
        return round(os.getloadavg()[0], 2)
    return None


def _merged(out: pathlib.Path, record: dict) -> dict:
    """``record`` added to an existing record of the same columns: the row of the same command
    is replaced, a new command's row appended (``command`` becomes one entry per row)."""
    if not out.exists():
        return record
    old = json.loads(out.read_text())
    commands = old["command"] if isinstance(old["command"], list) else [old["command"]]
    if old.get("columns") != record["columns"] or len(commands) != len(old["rows"]):
        return record
    runs = dict(zip(commands, old["rows"]))
    for row in record["rows"]:
        runs[record["command"]] = row
    return {**record, "command": list(runs), "rows": list(runs.values())}


def write_tables(path: str, names: list[str], tables, *, merge: bool = False,
                 start_load: float | None = None) -> None:
    """Write ``tables`` (`markdown_tables`' output) as records under ``path`` (see above)."""
    target = pathlib.Path(path)
    single = target.suffix == ".json"
    if single and len(tables) != 1:
        raise SystemExit(f"--json {path}: this run printed {len(tables)} tables; give a folder "
                         f"(one file per table: {', '.join(names)})")
    if not single:
        target.mkdir(parents=True, exist_ok=True)
    command = "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    command = re.sub(r" --json(=| )\S+", "", command)
    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    for k, (title, columns, rows) in enumerate(tables):
        name = target.stem if single else names[min(k, len(names) - 1)] + (
            f"_{k}" if k >= len(names) else "")
        record = dict(benchmark=name, title=title or name, command=command, date=date,
                      commit=_commit(), machine=_machine(),
                      load_average=(f"{_load()}" if start_load is None else
                                      f"{start_load} at the start, {_load()} at the end"),
                      source="zoo", columns=columns, rows=rows)
        out = target if single else target / f"{name}.json"
        old = json.loads(out.read_text()) if out.exists() else {}
        for key in ("title", "order", "description"):  # what the page says about the table
            if key in old and (key != "title" or not title):
                record[key] = old[key]
        if merge:
            record = _merged(out, record)
        out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {out}", file=sys.stderr)


@contextlib.contextmanager
def recorded(path: str | None, names: list[str], *, merge: bool = False):
    """Run the block; with a ``path``, write the tables it printed as records (see above).
    ``merge``: add the run's rows to an existing record of the same columns (one row per
    run, as `benchmarks/scale.py` prints)."""
    if path is None:
        yield
        return
    start_load, buffer = _load(), io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, buffer)):
        yield
    write_tables(path, names, markdown_tables(buffer.getvalue()), merge=merge,
                 start_load=start_load)


def json_main(main, names: list[str]) -> int:
    """Run ``main()`` (which parses `sys.argv`) with ``--json PATH`` taken off the command
    line and honoured: the script's tables written as records (see above)."""
    argv, path = list(sys.argv), None
    for i, arg in enumerate(argv):
        if arg == "--json" and i + 1 < len(argv):
            path = argv[i + 1]
            del argv[i:i + 2]
            break
        if arg.startswith("--json="):
            path = arg.split("=", 1)[1]
            del argv[i]
            break
    if "-h" in argv or "--help" in argv:
        print("  --json PATH  also write the printed tables as JSON records for "
              "docs/benchmarks (a .json file for one table, else a folder)\n")
    sys.argv = argv
    with recorded(path, names):
        return main() or 0
