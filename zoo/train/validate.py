"""Checks of a recipe's inputs that run before anything is compiled or restored.

Each raises `ValueError` with a message that names the flag, the value and the fix; the
recipes' command line turns it into exit 2 without a traceback (``--debug`` shows one).

* `check_run_dir` -- ``--run-dir`` is (or can be made) a folder this process can write to.
* `check_data` -- ``--data`` paths exist and give text files: a file with a NUL byte or more
  than `MAX_BAD_FRACTION` undecodable UTF-8 in its first KiB is binary, one with more than
  `MAX_BAD_SAMPLED` in the rest is mostly not text; a ``.jsonl`` file whose first lines are
  not JSON objects with a string ``"text"`` is refused the same way; so is a corpus without
  one non-empty document. `warn_small_corpus`: a corpus smaller than one batch.
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
           "check_warmup", "warn_small_corpus", "HEAD_BYTES", "MAX_BAD_FRACTION",
           "MAX_BAD_SAMPLED"]

HEAD_BYTES = 1024          # how much of each file the binary check reads
MAX_BAD_FRACTION = 0.01    # undecodable bytes allowed in that head (a few stray latin-1 bytes)
MAX_BAD_SAMPLED = 0.10     # undecodable bytes allowed in the rest of the file
SAMPLE_WINDOWS, SAMPLE_BYTES = 16, 64 * 1024  # how the rest of a large file is sampled
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

def check_run_dir(path: str | os.PathLike, *, create: bool = True) -> str:
    """Create ``path`` if needed and prove it writable (a probe file, removed again); returns
    the absolute path. Nothing else in the folder is touched. ``create=False`` writes nothing:
    the folder, or the nearest one above it that exists, must be writable (`os.access`)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--run-dir {path}: is a file, not a folder; pass a folder (new or "
                         f"holding an earlier run)")
    if not create:
        return _check_writable(path)
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


def _check_writable(path: str) -> str:
    """`path`, or the nearest folder above it that exists, is a folder this process can
    write to (nothing is created)."""
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--run-dir {path}: cannot be created, {existing} is a file; pass a "
                         f"folder under a writable parent")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created ({existing} is " \
                                                          f"not writable)"
        raise ValueError(f"--run-dir {path}: {what}; pass a folder you can write to, or fix its "
                         f"permissions")
    return path


# -- data --------------------------------------------------------------------------------------

def _undecodable(data: bytes) -> int:
    """How many bytes of `data` are not UTF-8 (a character cut at either end is not counted)."""
    start = 0
    while start < min(3, len(data)) and 0x80 <= data[start] < 0xC0:
        start += 1  # the tail of a character cut by the window's start
    bad, rest, decoder = 0, data[start:], codecs.getincrementaldecoder("utf-8")()
    while rest:
        try:
            decoder.decode(rest, final=False)  # a character cut at the end is not an error
            break
        except UnicodeDecodeError as e:
            bad += e.end - e.start
            rest = rest[e.end:]
            decoder.reset()
    return bad


def _sampled(f, size: int) -> list[bytes]:
    """The file past its head: whole when small, else `SAMPLE_WINDOWS` evenly spread windows."""
    rest = size - HEAD_BYTES
    if rest <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        f.seek(HEAD_BYTES)
        return [f.read()]
    out = []
    for i in range(SAMPLE_WINDOWS):
        f.seek(HEAD_BYTES + (rest - SAMPLE_BYTES) * i // (SAMPLE_WINDOWS - 1))
        out.append(f.read(SAMPLE_BYTES))
    return out


def sniff_text(path: str) -> str | None:
    """Why the file is not UTF-8 text; None if it is. Binary: a NUL byte or more than
    `MAX_BAD_FRACTION` undecodable bytes in its first `HEAD_BYTES`; mostly not text: more than
    `MAX_BAD_SAMPLED` undecodable bytes in the rest (read whole up to 1 MiB, else sampled)."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
        if b"\0" in head:
            return "NUL byte in the first KiB"
        bad = _undecodable(head)
        if bad > MAX_BAD_FRACTION * len(head):
            return f"{bad} of the first {len(head)} bytes are not UTF-8"
        chunks = _sampled(f, os.path.getsize(path)) if len(head) == HEAD_BYTES else []
    seen = sum(len(c) for c in chunks)
    bad = sum(_undecodable(c) for c in chunks)
    if seen and bad > MAX_BAD_SAMPLED * seen:
        return (f"{bad} of {seen} bytes read past the first KiB ({bad / seen:.0%}) are not "
                f"UTF-8, more than the {MAX_BAD_SAMPLED:.0%} allowed")
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
        elif os.path.isdir(p) and not _has_files(p, SUFFIXES):
            missing.append(f"{p} (a folder with no {'/'.join(SUFFIXES)} files)")
    return (find_files(list(paths)) if not missing else []), missing


def _has_files(folder: str, suffixes: Sequence[str]) -> bool:
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
    if not any(_has_text(f) for f in files):
        raise ValueError(f"--data: no document in the {len(files)} file(s) found has any text "
                         f"({_listing(files)}): the files are empty or every \"text\" is \"\", "
                         f"so no batch would hold a token to learn; {fix}")
    return files


def _has_text(path: str) -> bool:
    """Whether the file holds a non-empty document (a .jsonl: a line whose "text" is not
    empty; scanning stops at the first)."""
    if not path.endswith(".jsonl"):
        return os.path.getsize(path) > 0
    with open(path, "rb") as f:
        for line in f:
            try:
                if json.loads(line).get("text"):
                    return True
            except (ValueError, AttributeError):
                continue  # the pipeline names a bad line itself
    return False


def warn_small_corpus(files: Sequence[str] | None, batch_size: int, seq_len: int) -> None:
    """Warn when ``--data`` holds fewer bytes than one batch has tokens: every batch then
    repeats the same text, and the loss falls by memorising it."""
    if not files:
        return
    total, tokens = sum(os.path.getsize(f) for f in files), batch_size * seq_len
    if total < tokens:
        import warnings
        warnings.warn(f"--data: the corpus holds {total} bytes, fewer than one batch's "
                      f"{batch_size} x {seq_len} = {tokens} tokens: every batch repeats it, so "
                      f"the loss will fall by memorising it; add text, or lower --batch-size or "
                      f"--seq-len", stacklevel=2)


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
