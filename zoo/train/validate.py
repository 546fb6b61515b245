"""Checks of a recipe's inputs that run before anything is compiled or restored.

Each raises `ValueError` with a message that names the flag, the value and the fix; the
recipes' command line turns it into exit 2 without a traceback (``--debug`` shows one).

* `check_run_dir` -- ``--run-dir`` is (or can be made) a folder this process can write to.
* `check_data` -- ``--data`` paths exist and give text files: a file with a NUL byte or more
  than `MAX_BAD_FRACTION` undecodable UTF-8 in its first KiB is binary; a ``.jsonl`` file
  whose first lines are not JSON objects with a string ``"text"`` is refused the same way.
* `load_tokenizer` -- ``--tokenizer`` loads as a ``tokenizer.json``.
* `check_positive` / `check_warmup` -- ``--lr`` and friends.
"""

from __future__ import annotations

import codecs
import glob
import json
import math
import os
import uuid
from collections.abc import Sequence

__all__ = ["check_run_dir", "check_data", "sniff_text", "load_tokenizer", "check_positive",
           "check_warmup", "HEAD_BYTES", "MAX_BAD_FRACTION"]

HEAD_BYTES = 1024          # how much of each file the binary check reads
MAX_BAD_FRACTION = 0.01    # undecodable bytes allowed in that head (a few stray latin-1 bytes)
JSONL_HEAD_LINES = 20      # .jsonl lines checked for a "text" field
_SHOWN = 5                 # files named in a message


def check_positive(flag: str, value: float, fix: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {value}: must be a finite number > 0; {fix}")


def check_warmup(warmup: int | None, steps: int) -> None:
    if warmup is not None and not 0 <= warmup <= steps:
        raise ValueError(f"--warmup {warmup}: must be in [0, --steps {steps}]; lower --warmup or "
                         f"raise --steps (or leave --warmup out: min(100, steps/10))")


# -- run dir -----------------------------------------------------------------------------------

def check_run_dir(path: str | os.PathLike) -> str:
    """Create ``path`` if needed and prove it writable (a probe file, removed again); returns
    the absolute path. Nothing else in the folder is touched."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--run-dir {path}: is a file, not a folder; pass a folder (new or "
                         f"holding an earlier run)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--run-dir {path}: cannot be created ({e.strerror or e}); pass a "
                         f"folder under a writable parent") from None
    probe = os.path.join(path, f".write-probe-{uuid.uuid4().hex}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--run-dir {path}: is not writable ({e.strerror or e}); pass a folder "
                         f"you can write to, or fix its permissions") from None
    return path


# -- data --------------------------------------------------------------------------------------

def sniff_text(path: str) -> str | None:
    """Why the file is not UTF-8 text, judged from its first `HEAD_BYTES`; None if it is."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    if b"\0" in head:
        return "NUL byte in the first KiB"
    bad, rest, decoder = 0, head, codecs.getincrementaldecoder("utf-8")()
    while rest:
        try:
            decoder.decode(rest, final=False)  # a character cut at the end is not an error
            break
        except UnicodeDecodeError as e:
            bad += e.end - e.start
            rest = rest[e.end:]
            decoder.reset()
    if bad > MAX_BAD_FRACTION * len(head):
        return f"{bad} of the first {len(head)} bytes are not UTF-8"
    if path.endswith(".jsonl"):
        return _sniff_jsonl(path)
    return None


def _sniff_jsonl(path: str) -> str | None:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if number > JSONL_HEAD_LINES:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                return f"line {number} is not JSON"
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                return f'line {number} has no string "text" field'
    return None


def _expand(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    from zoo.data.corpus import SUFFIXES, find_files

    missing = []
    for p in paths:
        p = os.path.expanduser(p)
        if any(c in p for c in "*?["):
            if not glob.glob(p, recursive=True):
                missing.append(f"{p} (the glob matches nothing)")
        elif not os.path.exists(p):
            missing.append(f"{p} (does not exist)")
        elif os.path.isdir(p) and not _has_text(p, SUFFIXES):
            missing.append(f"{p} (a folder with no {'/'.join(SUFFIXES)} files)")
    return (find_files(list(paths)) if not missing else []), missing


def _has_text(folder: str, suffixes: Sequence[str]) -> bool:
    for _, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(f.endswith(tuple(suffixes)) and not f.startswith(".") for f in files):
            return True
    return False


def check_data(paths: Sequence[str] | None) -> list[str] | None:
    """``--data`` -> the files it names (None: the built-in corpus, not checked)."""
    if not paths:
        return None
    fix = ("pass UTF-8 text files (.txt/.md/.py, or .jsonl with a \"text\" field per line), "
           "folders or globs of them, or leave --data out for the built-in corpus")
    files, missing = _expand(paths)
    if missing:
        raise ValueError(f"--data: {_listing(missing)}; {fix}")
    bad = [f"{f} ({why})" for f in files if (why := sniff_text(f))]
    if bad:
        raise ValueError(f"--data: {len(bad)} of {len(files)} files are not text: "
                         f"{_listing(bad)}; {fix}")
    if not any(os.path.getsize(f) for f in files):
        raise ValueError(f"--data: the {len(files)} file(s) found are empty "
                         f"({_listing(files)}); {fix}")
    return files


def _listing(items: Sequence[str]) -> str:
    more = len(items) - _SHOWN
    return ", ".join(items[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


# -- tokenizer ---------------------------------------------------------------------------------

def load_tokenizer(path: str | None):
    """``--tokenizer`` -> `zoo.data.HFTokenizer` (None: the byte tokenizer)."""
    from zoo import data

    if path is None:
        return data.ByteTokenizer()
    fix = ("pass a Hugging Face tokenizer.json (or the folder holding one), or leave "
           "--tokenizer out for byte tokens")
    if not os.path.exists(path):
        raise ValueError(f"--tokenizer {path}: does not exist; {fix}")
    try:
        return data.HFTokenizer(path)
    except Exception as e:  # the tokenizers package raises bare Exceptions for bad files
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"--tokenizer {path}: cannot be loaded as a tokenizer ({reason}); "
                         f"{fix}") from e
