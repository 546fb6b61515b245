"""The held-out validation split: whole documents chosen by a hash of their text.

A document (a file, a ``.jsonl`` line, a ``corpus_docs="short"`` definition; a plain-text file
above `zoo.data.corpus.RANGE_BYTES` is one document per range) is held out when the first 8
bytes of the BLAKE2b digest of its UTF-8 text, read as a fraction of 2**64, fall below
``validation_fraction``. The choice depends on the text alone: not on the seed, the file order,
the batch or the machine, so the training stream (``split="train"``) and the validation stream
(``split="validation"``) never share a document, and identical documents fall on the same side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from zoo.data import corpus

__all__ = ["SPLITS", "document_digest", "held_out", "check_split", "range_documents"]

SPLITS = ("train", "validation")
_SCALE = float(1 << 64)


def document_digest(text: str) -> bytes:
    """The 8-byte BLAKE2b digest of a document's text (lone surrogates from JSON kept)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def held_out(text: str, fraction: float) -> bool:
    """Whether the document `text` belongs to the validation split of `fraction`."""
    return fraction > 0 and int.from_bytes(document_digest(text), "big") / _SCALE < fraction


def range_documents(rng: corpus.Range, short: bool) -> list[tuple[str, bool, bool]]:
    """``[(text, starts, ends), ...]``: the documents of one byte range as the pipeline sees
    them (``short``: ``.py`` files cut into top-level definitions)."""
    docs = corpus.read_documents(*rng)
    if short and not rng[4] and rng[0].endswith(".py"):
        docs = [(piece, True, True) for text, _, _ in docs for piece in corpus.split_short(text)]
    return docs


def _documents(ranges: Sequence[corpus.Range], short: bool) -> Iterator[str]:
    for rng in ranges:
        for text, _, _ in range_documents(rng, short):
            if text:
                yield text


def check_split(ranges: Sequence[corpus.Range], fraction: float, split: str, *,
                short: bool = False) -> None:
    """Raise `ValueError` when `split` of the corpus `ranges` would hold no document. Reads
    documents in order only until one of `split` is found."""
    want = split == "validation"
    if any(held_out(text, fraction) == want for text in _documents(ranges, short)):
        return
    files = len({r[0] for r in ranges})
    if want:
        raise ValueError(
            f"--validation-fraction {fraction:g} holds out none of the documents of the {files} "
            f"file(s): the validation split would be empty; raise --validation-fraction or "
            f"pass a larger --data")
    raise ValueError(
        f"--validation-fraction {fraction:g} holds out every document of the {files} file(s), "
        f"leaving nothing to train on; lower --validation-fraction or pass more --data")
