"""`text_dataset`: text files -> packed, shifted, load-balanced, per-process batches (Grain).

Stages, each a Grain dataset so the whole chain is checkpointable::

    byte ranges of files (stat only)        MapDataset.source   (corpus.index_ranges)
      -> shuffle per epoch, repeat           .shuffle(seed).repeat(num_epochs)
      -> read, keep the split, tokenize      .map(_ReadTokenize), threads via ReadOptions
      -> cut into pieces of <= L tokens      FlatMapIterDataset(_SplitPieces)
      -> shuffle pieces in windows           WindowShuffleIterDataset
      -> first-fit packing into rows of L    grain.experimental.FirstFitPackIterDataset
      -> global batch (last one padded)      .batch(batch_size) + _Finish
      -> this process's rows, shift, weights, load-balanced reorder
      -> a background thread keeps batches ready  (Grain's ThreadPrefetchDatasetIterator)

Conventions of one row of ``L`` tokens (all arrays ``[batch_size // process_count, L]``):

* ``inputs`` -- the packed tokens. A document (a file; a ``.jsonl`` line) is ``[bos] +
  tokens + [eos]``, each special only if the tokenizer has it (`ByteTokenizer`: 1 and 2); a
  text file above 8 MiB is read in line-aligned ranges, bos before the first, eos after the
  last. Empty documents are skipped. A document longer than ``L`` is cut into consecutive
  pieces of ``L`` tokens (the last shorter) *before* packing, so Grain never truncates and no
  token is dropped.
* ``segment_ids`` -- 1..n for the pieces in the row, in order; 0 marks padding.
* ``positions`` -- 0, 1, 2, ... restarting at every piece.
* ``targets`` -- ``targets[j] = inputs[j+1]`` when position ``j+1`` belongs to the same piece
  (same non-zero segment id), else ``pad_id``. The last token of each piece has no target.
* ``loss_weights`` -- float32, 1.0 exactly where a target exists, else 0.0.

With ``context_parallel=cp > 1`` all five arrays are finally reordered along the length axis
by `zoo.data.load_balance` with ``balance`` (default ``"auto"``: per row, the permutation whose
busiest context shard computes the fewest kernel tiles; see `zoo.data.reorder`); attention
masks come from ``positions``/``segment_ids``, so the model never un-permutes and the loss (a
weighted mean) needs no inverse. `zoo.data.restore_order` with the batch's positions and
segment ids gives packing order back.

``validation_fraction=f`` holds out the documents whose text hashes below ``f``
(`zoo.data.split`): ``split="train"`` (default) never yields them, ``split="validation"``
yields only them, so the two streams share no document whatever the seed or file order.

``corpus_docs="short"`` cuts every ``.py`` file into one document per top-level function or
class (`corpus.split_short`), so rows pack many documents of skewed lengths -- like web or code
pre-training text -- instead of one long file; ``.jsonl`` lines are documents either way.

Every process builds the same global batch stream (same seed, same files) and keeps rows
``[i*b, (i+1)*b)``, ``b = batch_size // process_count``. ``num_epochs=1`` visits every token
once; the final batch is padded with empty rows (``segment_ids`` 0, weights 0), never dropped.
``it.get_state()`` is a JSON-serialisable dict; ``set_state`` on a fresh iterator built with the
same arguments repeats exactly the batches that followed. The state records the arguments that
shape the stream (seq_len, context_parallel, balance, tile, corpus_docs, seed, shuffle, the
tokenizer's identity, the paths, the files found with their sizes, and a digest of their
contents: each file's first and last MiB, so an edit that keeps a file's size is seen);
``set_state`` with a state saved under other ones raises `PipelineStateMismatch` naming each
difference (`argument_changes`; ``batch_size``, ``rows_per_device``, ``num_epochs`` and the
process layout may change).

Legend: B rows per process, L ``seq_len``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import weakref
from collections.abc import Sequence

import grain
import numpy as np
from grain import experimental as gx

from zoo.data import corpus
from zoo.data import split as split_lib
from zoo.data import work
from zoo.data.reorder import STRATEGIES, check_length, load_balance as _load_balance
from zoo.data.tokenizer import ByteTokenizer, identity

__all__ = ["text_dataset", "PipelineStateMismatch", "argument_changes", "CORPUS_DOCS",
           "PACKING_BINS", "SHUFFLE_WINDOW"]

CORPUS_DOCS = ("file", "short")  # a document per file (jsonl: per line) / per top-level def

# First-fit packs this many rows at once: more rows, fuller rows (fill is measured by
# benchmarks/data.py and asserted >= 97% on the built-in corpus by the tests).
PACKING_BINS = 64
# Pieces are shuffled in windows of this many, so one large file's pieces do not fill
# consecutive batches. Resuming re-reads at most one window.
SHUFFLE_WINDOW = 256
_READ_THREADS = 4
_READ_BUFFER = 64
_PREFETCH_BATCHES = 8


# Iterators still open at exit are closed by atexit, while the interpreter is whole: Grain's
# prefetch iterator otherwise closes itself in __del__ during teardown and prints an ignored
# AttributeError (google/grain#1196).
_OPEN_ITERATORS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_iterators() -> None:
    for it in list(_OPEN_ITERATORS):
        it.close()


class PipelineStateMismatch(ValueError):
    """A saved pipeline state was made with other arguments than this pipeline's."""


_STATE_KEY = "zoo_data_arguments"
# arguments a state saved before they were recorded lacks: not compared then
_LATER_ARGUMENTS = frozenset({"contents"})
_DIGEST_BYTES = 1 << 20  # the contents digest reads this much at each end of a file


def argument_changes(saved: dict, now: dict) -> list[str]:
    """``"name: saved X, now Y"`` for each pipeline argument of `now` that differs in `saved`
    (an argument recorded only by newer versions, absent from `saved`, is not a change)."""
    return [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in now.items()
            if saved.get(k) != v and (k in saved or k not in _LATER_ARGUMENTS)]


class _PrefetchIterator(gx.ThreadPrefetchDatasetIterator):
    """Grain's thread prefetch whose state carries the pipeline's arguments (checked on
    `set_state`), with a `close` that is safe to call twice (atexit, then __del__)."""

    def __init__(self, parent, buffer_size: int, arguments: dict):
        super().__init__(parent, buffer_size)
        self.arguments = arguments

    def get_state(self):
        return {**super().get_state(), _STATE_KEY: dict(self.arguments)}

    def set_state(self, state) -> None:
        state = dict(state)
        saved = state.pop(_STATE_KEY, None)  # None: a state from before arguments were saved
        if saved is not None:
            diffs = argument_changes(saved, self.arguments)
            if diffs:
                raise PipelineStateMismatch(
                    "the data pipeline state was saved with other arguments: "
                    + "; ".join(diffs) + ". Resume with the saved arguments, or start a new "
                    "run (another --run-dir) to use the new ones")
        super().set_state(state)

    def close(self) -> None:
        if not self._closed:
            super().close()


class _ReadTokenize:
    """Byte range -> list of token arrays, ``[bos] + encode(text) + [eos]`` per document of
    the split (`zoo.data.split`: documents held out by ``fraction`` are the validation ones)."""

    def __init__(self, tokenizer, short: bool = False, fraction: float = 0.0,
                 split: str = "train"):
        self.tokenizer = tokenizer
        self.short = short
        self.fraction, self.validation = fraction, split == "validation"
        self.bos = getattr(tokenizer, "bos_id", None)
        self.eos = getattr(tokenizer, "eos_id", None)

    def __call__(self, rng: corpus.Range) -> list[np.ndarray]:
        out = []
        docs = split_lib.range_documents(rng, self.short)  # .py short: a doc per definition
        if self.fraction > 0:
            docs = [d for d in docs if split_lib.held_out(d[0], self.fraction) == self.validation]
        for text, starts, ends in docs:
            parts = [np.asarray(self.tokenizer.encode(text), dtype=np.int32).reshape(-1)]
            if not parts[0].size:
                continue  # an empty document ({"text": ""}) has nothing to learn from
            if starts and self.bos is not None:
                parts.insert(0, np.array([self.bos], np.int32))
            if ends and self.eos is not None:
                parts.append(np.array([self.eos], np.int32))
            out.append(np.concatenate(parts))
        return out


class _SplitPieces(gx.FlatMapTransform):
    """Documents -> pieces of at most ``seq_len`` tokens, in order; nothing is dropped."""

    max_fan_out = 1 << 30  # only used by MapDataset flat maps; the iterator version is unbounded

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def flat_map(self, docs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [{"tokens": doc[i:i + self.seq_len]}
                for doc in docs for i in range(0, len(doc), self.seq_len)]


class _Finish:
    """Global packed batch -> this process's rows with targets, weights, reorder (all int32)."""

    def __init__(self, *, global_batch, process_index, process_count, pad_id, cp, balance,
                 tile, rows_per_device):
        self.global_batch = global_batch
        self.rows = slice(process_index * (global_batch // process_count),
                          (process_index + 1) * (global_batch // process_count))
        self.pad_id = pad_id
        self.cp = cp
        self.balance = balance if cp > 1 else "none"
        self.tile = tile
        self.rows_per_device = rows_per_device

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tokens = batch["tokens"].astype(np.int32)  # [rows<=global, L]
        segments = batch["tokens_segment_ids"].astype(np.int32)
        positions = batch["tokens_positions"].astype(np.int32)
        missing = self.global_batch - tokens.shape[0]
        if missing:  # the last batch of a finite run: pad with empty rows, drop nothing
            def pad(x, value):
                return np.concatenate([x, np.full((missing, x.shape[1]), value, x.dtype)])
            tokens = pad(tokens, self.pad_id)
            segments, positions = pad(segments, 0), pad(positions, 0)
        tokens, segments, positions = tokens[self.rows], segments[self.rows], positions[self.rows]

        # j has a target iff j+1 is in the same piece: same non-zero segment id.
        has_next = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)  # [B, L-1]
        targets = np.full_like(tokens, self.pad_id)
        targets[:, :-1] = np.where(has_next, tokens[:, 1:], self.pad_id)
        weights = np.zeros(tokens.shape, np.float32)
        weights[:, :-1] = has_next
        out = {"inputs": tokens, "targets": targets, "positions": positions,
               "segment_ids": segments, "loss_weights": weights}
        if self.balance != "none":  # one permutation per row, computed from this batch
            out = _load_balance(out, self.cp, axis=1, strategy=self.balance, tile=self.tile,
                                rows_per_device=self.rows_per_device)
        return out


def _paths_text(paths) -> list[str] | None:
    """The ``paths`` argument as absolute strings (None: the built-in corpus)."""
    if paths is None:
        return None
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    return [os.path.abspath(os.path.expanduser(os.fspath(p))) for p in paths]


def _files_digest(ranges) -> str:
    """Which files (and sizes) the paths found: a changed corpus changes the stream."""
    h = hashlib.sha256()
    for path, start, _, size, _ in ranges:
        if start == 0:
            h.update(f"{path}\0{size}\n".encode())
    return f"{sum(r[1] == 0 for r in ranges)} files, sha256 {h.hexdigest()[:16]}"


def _contents_digest(ranges) -> str:
    """A digest of every file's first and last MiB (all of a file up to 2 MiB) and size: an
    edit in place that keeps the size changes it, a copy or a ``touch`` does not."""
    h = hashlib.sha256()
    for path, start, _, size, _ in ranges:
        if not start:
            h.update(f"{size}\n".encode() + _file_digest(path))
    return f"sha256 of the first and last MiB of each file {h.hexdigest()[:16]}"


# path -> (size, mtime, ctime, inode), digest: a file is read again only once it changed (any
# write changes its ctime), so listing a corpus twice in a process reads it once
_FILE_DIGESTS: dict[str, tuple[tuple[int, ...], bytes]] = {}


def _file_digest(path: str) -> bytes:
    try:
        st = os.stat(path)
        key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        cached = _FILE_DIGESTS.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            h.update(f.read(_DIGEST_BYTES))
            if st.st_size > _DIGEST_BYTES:
                f.seek(max(_DIGEST_BYTES, st.st_size - _DIGEST_BYTES))
                h.update(f.read(_DIGEST_BYTES))
    except OSError as e:
        raise ValueError(f"text_dataset: {path} cannot be read ({e}); pass readable "
                         f"files") from None
    _FILE_DIGESTS[path] = key, h.digest()
    return h.digest()


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"text_dataset: {name}={value!r} must be a positive integer")
    return int(value)


def text_dataset(paths: str | os.PathLike | Sequence[str | os.PathLike] | None = None, *,
                 seq_len: int, batch_size: int, context_parallel: int = 1,
                 balance: str = "auto", load_balance: bool = True,
                 balance_tile: int | None = None, rows_per_device: int = 1,
                 corpus_docs: str = "file",
                 validation_fraction: float = 0.0, split: str = "train",
                 tokenizer=None, seed: int = 0,
                 shuffle: bool = True, num_epochs: int | None = None,
                 process_index: int | None = None,
                 process_count: int | None = None) -> grain.DatasetIterator:
    """A checkpointable iterator of packed batches; see the module docstring for conventions.

    Args:
      paths: files, globs or folders of ``.txt``/``.md``/``.py``/``.jsonl`` (``"text"`` field)
        text; ``None`` is the built-in corpus (the Python standard library's sources).
      seq_len: row length ``L``.
      batch_size: *global* rows per step; each process gets ``batch_size // process_count``.
      context_parallel: the CP degree the attention sees; every array is reordered for it by
        ``balance`` (``seq_len`` must then be divisible by ``2*context_parallel``).
      balance: ``"auto"`` (default), ``"row"``, ``"document"`` or ``"none"``; see
        `zoo.data.reorder`. ``load_balance=False`` is the older spelling of ``"none"``.
      balance_tile: the attention kernel's tile that ``"auto"`` counts work in (default
        `zoo.data.work.TILE` = 64, zoo's flash kernel on CPU).
      rows_per_device: consecutive rows of this process's batch that one device's attention
        holds; ``"auto"`` balances them together, since the kernels skip a tile only when it is
        empty in every row (the recipes pass their batch sharding's rows per device).
      corpus_docs: ``"file"`` (a document per file, per ``.jsonl`` line) or ``"short"`` (``.py``
        files cut into one document per top-level function or class).
      validation_fraction, split: hold out the documents whose text hashes below this fraction
        (`zoo.data.split`); ``split="train"`` yields the others, ``"validation"`` the held-out
        ones. A split that would be empty is a `ValueError` here. 0 (default): no holdout.
      tokenizer: anything with ``encode``/``bos_id``/``eos_id``/``pad_id``; default
        `ByteTokenizer`.
      seed, shuffle: file order (reshuffled each epoch), piece windows and packed rows are
        shuffled with ``seed``; ``shuffle=False`` keeps the sorted file order throughout.
      num_epochs: ``None`` repeats forever; ``n`` stops after ``n`` passes (last batch padded).
      process_index, process_count: default `jax.process_index()` / `jax.process_count()`.

    Returns:
      A `grain.DatasetIterator` of dicts ``inputs``, ``targets``, ``positions``,
      ``segment_ids`` (int32) and ``loss_weights`` (float32), each ``[B, seq_len]``, with
      ``get_state()``/``set_state(state)``.
    """
    seq_len = _positive_int("seq_len", seq_len)
    batch_size = _positive_int("batch_size", batch_size)
    context_parallel = _positive_int("context_parallel", context_parallel)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**31:
        raise ValueError(f"text_dataset: seed={seed!r} must be an integer in [0, 2**31)")
    if num_epochs is not None:
        num_epochs = _positive_int("num_epochs", num_epochs)
    if process_index is None or process_count is None:
        import jax  # only for the defaults; the pipeline itself is numpy

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    process_count = _positive_int("process_count", process_count)
    if isinstance(process_index, bool) or not isinstance(process_index, (int, np.integer)) \
            or not 0 <= process_index < process_count:
        raise ValueError(f"text_dataset: process_index={process_index!r} must be in "
                         f"[0, process_count={process_count})")
    if batch_size % process_count:
        lower = batch_size // process_count * process_count
        raise ValueError(
            f"text_dataset: batch_size={batch_size} is not divisible by process_count="
            f"{process_count} (every process takes an equal slice of the global batch); use "
            f"{lower + process_count}" + (f" or {lower}" if lower else ""))
    if balance not in STRATEGIES:
        raise ValueError(f"text_dataset: balance={balance!r} must be one of "
                         f"{', '.join(map(repr, STRATEGIES))}")
    if corpus_docs not in CORPUS_DOCS:
        raise ValueError(f"text_dataset: corpus_docs={corpus_docs!r} must be one of "
                         f"{', '.join(map(repr, CORPUS_DOCS))}")
    if split not in split_lib.SPLITS:
        raise ValueError(f"text_dataset: split={split!r} must be one of "
                         f"{', '.join(map(repr, split_lib.SPLITS))}")
    if isinstance(validation_fraction, bool) or not isinstance(
            validation_fraction, (int, float)) or not 0 <= validation_fraction < 1:
        raise ValueError(f"text_dataset: validation_fraction={validation_fraction!r} must be a "
                         f"number in [0, 1), e.g. 0.02")
    if split == "validation" and not validation_fraction:
        raise ValueError("text_dataset: split='validation' needs validation_fraction > 0 (the "
                         "share of documents held out), e.g. 0.02")
    balance_tile = work.TILE if balance_tile is None else _positive_int("balance_tile",
                                                                        balance_tile)
    balance = balance if load_balance else "none"
    rows_per_device = _positive_int("rows_per_device", rows_per_device)
    if (batch_size // process_count) % rows_per_device:
        raise ValueError(f"text_dataset: rows_per_device={rows_per_device} does not divide the "
                         f"{batch_size // process_count} rows of each process")
    if balance != "none" and context_parallel > 1:
        check_length(seq_len, context_parallel, what="text_dataset: seq_len")
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if not callable(getattr(tokenizer, "encode", None)):
        raise ValueError(f"text_dataset: tokenizer {tokenizer!r} has no encode(text) method")
    pad_id = getattr(tokenizer, "pad_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)

    files = corpus.find_files(paths)
    ranges = corpus.index_ranges(files)
    if validation_fraction:
        split_lib.check_split(ranges, validation_fraction, split, short=corpus_docs == "short")
    arguments = dict(  # what shapes the stream; a resume must match (see the module docstring)
        seq_len=seq_len, context_parallel=context_parallel, balance=balance,
        balance_tile=balance_tile, corpus_docs=corpus_docs, seed=int(seed), shuffle=shuffle,
        tokenizer=identity(tokenizer), paths=_paths_text(paths), files=_files_digest(ranges),
        contents=_contents_digest(ranges))
    if validation_fraction:  # absent when 0, so a state saved before holdouts still matches
        arguments.update(validation_fraction=float(validation_fraction), split=split)
    ds = grain.MapDataset.source(ranges)
    if shuffle:
        ds = ds.shuffle(seed=seed)  # a fresh permutation every epoch (seed + epoch)
    ds = ds.repeat(num_epochs).map(_ReadTokenize(tokenizer, short=corpus_docs == "short",
                                                 fraction=validation_fraction, split=split))
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=_READ_THREADS,
                                              prefetch_buffer_size=_READ_BUFFER))
    ds = gx.FlatMapIterDataset(ds, _SplitPieces(seq_len))
    if shuffle:
        ds = gx.WindowShuffleIterDataset(ds, window_size=SHUFFLE_WINDOW, seed=seed + 1)
    ds = gx.FirstFitPackIterDataset(
        ds, length_struct={"tokens": seq_len}, num_packing_bins=max(PACKING_BINS, batch_size),
        seed=seed + 2, shuffle_bins=shuffle, padding_struct={"tokens": pad_id})
    ds = ds.batch(batch_size, drop_remainder=False)
    ds = ds.map(_Finish(global_batch=batch_size, process_index=int(process_index),
                        process_count=process_count, pad_id=pad_id, cp=context_parallel,
                        balance=balance, tile=balance_tile, rows_per_device=rows_per_device))
    it = _PrefetchIterator(iter(ds), _PREFETCH_BATCHES, arguments)  # packing runs ahead
    _OPEN_ITERATORS.add(it)
    return it
