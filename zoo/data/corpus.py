"""Text corpora on disk: find the files, index them lazily, read documents on demand.

* `find_files(paths)` -- files, globs or folders -> a sorted, de-duplicated list of files.
  Symlinks are followed, each real folder walked once (a loop such as ``self -> .`` ends
  there) and each real file kept once, with a warning counting the names skipped.
  Folders are walked for ``.txt``, ``.md``, ``.py`` and ``.jsonl``; files and glob matches
  named explicitly are taken whatever their suffix (``.jsonl`` parsed, the rest plain text).
  ``paths=None`` is the built-in corpus, `stdlib_files()`: the ``.py`` sources of the running
  Python's standard library (no ``test``/``tests``/``site-packages``), present on every machine.
* `index_ranges(files)` -- the unit of reading: ``(file, start, end)`` byte ranges from
  ``os.stat`` alone (nothing is read), files above `RANGE_BYTES` cut into several ranges, so
  the first batch never waits for a large corpus or a large file.
* `read_documents(file, start, end, size)` -- the documents of one range as text. A range
  owns the lines that *start* inside it (the Hadoop split rule), so ranges never overlap and
  never lose a line. A plain-text range is one document (a large file becomes several);
  ``.jsonl`` ranges give one document per line, its ``"text"`` field.
* `split_short(text)` -- Python source -> short documents, one per top-level function or class
  (``text_dataset(corpus_docs="short")``, the recipes' ``--corpus-docs short``): packed rows
  then hold many documents of skewed lengths, as pre-training text does.
"""

from __future__ import annotations

import ast
import glob
import itertools
import json
import os
import re
import sysconfig
import threading
import warnings
from collections.abc import Sequence

__all__ = ["SUFFIXES", "RANGE_BYTES", "find_files", "stdlib_files", "index_ranges",
           "read_documents", "split_short", "Range"]

SUFFIXES = (".txt", ".md", ".py", ".jsonl")
RANGE_BYTES = 8 << 20  # 8 MiB: one read per range, many ranges for a big file
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__"})
_GLOB_CHARS = frozenset("*?[")

_NOTED: set[str] = set()  # the symlink notes `find_files` gave

# (file, start byte, end byte, file size, is_jsonl)
Range = tuple[str, int, int, int, bool]


def _walk(folder: str, suffixes: Sequence[str], skip: frozenset[str] = frozenset(),
          revisits: list[str] | None = None) -> list[str]:
    """The files under `folder`, symlinked folders followed, each real folder entered once: a
    link back to a parent (``self -> .``) or a second link to a folder is appended to
    `revisits` and not entered."""
    out = []
    seen = set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            if revisits is not None:
                revisits.append(root)
            continue
        seen.add(real)
        # folders before links to folders, so a linked folder is walked under its own name
        dirs[:] = sorted((d for d in dirs if d not in skip and not d.startswith(".")),
                         key=lambda d: (os.path.islink(os.path.join(root, d)), d))
        out += [os.path.join(root, f) for f in sorted(files)
                if f.endswith(tuple(suffixes)) and not f.startswith(".")]
    return out


def _unique(files: Sequence[str], revisits: Sequence[str]) -> list[str]:
    """`files` (sorted, absolute) with every real file kept once, under its first name; a
    warning counts the other names of the same files and the folders not walked again."""
    out, seen = [], set()
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    if len(out) < len(files) or revisits:
        note = (f"data: symlinks lead to files or folders already found: skipped "
                f"{len(files) - len(out)} second name(s) of a file and {len(revisits)} "
                f"folder(s) already walked (e.g. "
                f"{(list(revisits) + sorted(set(files) - set(out)))[0]}); each of the "
                f"{len(out)} files is read once")
        if note not in _NOTED:  # once per process, however often the files are listed
            _NOTED.add(note)
            warnings.warn(note, stacklevel=3)
    return out


def stdlib_files() -> list[str]:
    """The built-in corpus: the standard library's ``.py`` files, sorted (deterministic)."""
    root = sysconfig.get_paths()["stdlib"]
    files = _walk(root, (".py",), _SKIP_DIRS)
    if not files:
        raise ValueError(f"the built-in corpus is empty: no .py files under the standard "
                         f"library folder {root!r}; pass paths= explicitly")
    return files


def find_files(paths) -> list[str]:
    """Expand files, globs and folders into a sorted list of files (see module docstring)."""
    if paths is None:
        return stdlib_files()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: list[str] = []
    missing: list[str] = []
    revisits: list[str] = []
    for p in paths:
        p = os.path.expanduser(os.fspath(p))
        if any(c in p for c in _GLOB_CHARS):
            matches = sorted(glob.glob(p, recursive=True))
            if not matches:
                missing.append(f"{p!r} (glob matched nothing)")
            for m in matches:
                found += _walk(m, SUFFIXES, revisits=revisits) if os.path.isdir(m) else [m]
        elif os.path.isdir(p):
            files = _walk(p, SUFFIXES, revisits=revisits)
            if not files:
                missing.append(f"{p!r} (folder has no {'/'.join(SUFFIXES)} files)")
            found += files
        elif os.path.isfile(p):
            found.append(p)
        else:
            missing.append(f"{p!r} (does not exist)")
    if missing:
        raise ValueError("text_dataset: these paths give no text files: " + ", ".join(missing)
                         + "; pass existing files, folders or globs (or paths=None for the "
                         "built-in standard-library corpus)")
    return _unique(sorted(set(os.path.abspath(f) for f in found)), revisits)


def _check_jsonl_head(path: str) -> None:
    """Fail at construction, not mid-training, when a .jsonl file is not what we expect."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                _jsonl_text(line, path, 0)
                return


def _jsonl_text(line: bytes, path: str, offset: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line at byte {offset} is not valid JSON ({e}); .jsonl files "
                         "need one JSON object with a 'text' field per line") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f"{path}: line at byte {offset} has no string 'text' field; .jsonl "
                         "files need one JSON object with a 'text' field per line")
    return record["text"]


# CPython 3.11's parser is not safe in several threads at once ("AST constructor recursion
# depth mismatch", SystemError); the pipeline reads with threads, so parses take turns.
_PARSE_LOCK = threading.Lock()
_TOP_LEVEL = re.compile(r"(async\s+def|def|class)\s|@")  # a top-level definition starts


def _definition_lines(text: str, lines: list[str]) -> set[int]:
    """0-based first and end lines of every top-level function/class (decorators included)."""
    try:
        with _PARSE_LOCK:
            body = ast.parse(text).body
    except (SyntaxError, ValueError, RecursionError, MemoryError, SystemError):
        # not valid Python (a range of a large file, another version's syntax): cut at lines
        # that start a definition at column 0, a decorator only when it opens a run of them
        return {i for i, line in enumerate(lines)
                if _TOP_LEVEL.match(line) and not (i and lines[i - 1].startswith("@"))}
    cuts = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            cuts.add(min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1)
            cuts.add(node.end_lineno)
    return cuts


def split_short(text: str) -> list[str]:
    """Python source -> its top-level functions and classes, one document each, in order.

    The module-level code between them (imports, docstring, constants) forms documents of its
    own, so no line is lost; blank pieces are dropped. Text that does not parse is cut at
    lines starting with ``def``/``class``/``async def``/``@`` at column 0.
    """
    lines = text.split("\n")
    cuts = sorted({0, len(lines)} | _definition_lines(text, lines))
    pieces = ("\n".join(lines[a:b]) for a, b in itertools.pairwise(cuts))
    return [p for p in pieces if p.strip()]


def index_ranges(files: Sequence[str], range_bytes: int | None = None) -> list[Range]:
    """Byte ranges of at most ``range_bytes`` (default `RANGE_BYTES`) covering every non-empty
    file, from ``os.stat`` alone."""
    range_bytes = RANGE_BYTES if range_bytes is None else range_bytes
    ranges: list[Range] = []
    for path in files:
        size = os.stat(path).st_size
        is_jsonl = path.endswith(".jsonl")
        if size == 0:
            continue
        if is_jsonl:
            _check_jsonl_head(path)
        for start in range(0, size, range_bytes):
            ranges.append((path, start, min(start + range_bytes, size), size, is_jsonl))
    if not ranges:
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        raise ValueError(f"empty corpus: the {len(files)} file(s) found ({shown}) hold no "
                         "bytes; pass paths with some text")
    return ranges


def _read_lines(path: str, start: int, end: int) -> tuple[int, bytes]:
    """(first byte, bytes) of the lines that start in ``[start, end)``, the last one whole."""
    with open(path, "rb") as f:
        first = start
        if start > 0:
            f.seek(start - 1)
            head = f.read(end - start + 1)
            newline = head.find(b"\n")
            if newline < 0:
                return start, b""  # one line spans the whole range: an earlier range owns it
            data = head[newline + 1:]
            first = start + newline
        else:
            data = f.read(end)
        if data and not data.endswith(b"\n"):
            data += f.readline()  # finish the line that crosses `end`
    return first, data


def read_documents(path: str, start: int, end: int, size: int,
                   is_jsonl: bool) -> list[tuple[str, bool, bool]]:
    """``[(text, starts_document, ends_document), ...]`` of one range.

    A plain-text file cut into several ranges gives one piece of one document per range:
    only the first starts the document (gets BOS), only the last ends it (gets EOS).
    """
    if start == 0 and end == size:
        with open(path, "rb") as f:
            offset, data = 0, f.read()
    else:
        offset, data = _read_lines(path, start, end)
    if not is_jsonl:
        # The range whose lines reach the end of the file ends the document.
        text = data.decode("utf-8", errors="replace")
        return [(text, offset == 0, offset + len(data) >= size)] if data else []
    docs = []
    for line in data.split(b"\n"):  # the same rule as the ranges: lines end at b"\n"
        if line.strip():
            docs.append((_jsonl_text(line, path, offset), True, True))
        offset += len(line) + 1
    return docs
