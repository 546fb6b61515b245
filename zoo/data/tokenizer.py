"""Tokenizers for the data pipeline: a byte-level default and a `tokenizer.json` adapter.

* `ByteTokenizer` -- no files, no training: ids 0..2 are special (``pad``, ``bos``, ``eos``)
  and byte ``b`` of the UTF-8 text is id ``b + 3``, so ``vocab_size == 259``.
* `HFTokenizer` -- wraps a local ``tokenizer.json`` (the `tokenizers` package, the format of
  Hugging Face checkpoints); special ids come from arguments, from a ``tokenizer_config.json``
  beside it, or stay ``None``.

Both expose ``encode(text) -> np.ndarray[int32]`` (no special tokens added), ``decode(ids)``,
``vocab_size``, ``pad_id``, ``bos_id`` and ``eos_id`` (``None`` when the tokenizer has none).
`identity(tokenizer)` names a tokenizer for the pipeline's saved state: class, vocabulary size,
special ids and, for a file-backed one, the file and a digest of its bytes.
The pipeline (`zoo.data.text_dataset`) wraps every document as ``[bos] + encode(text) + [eos]``
(each only when not ``None``) and fills padding with ``pad_id`` (0 when ``None``); padding is
marked by ``segment_ids == 0`` and weight 0 anyway, so its value never matters.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "identity"]


class ByteTokenizer:
    """UTF-8 bytes offset by 3 special ids: ``pad=0``, ``bos=1``, ``eos=2``, byte b -> b+3."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    offset = 3
    vocab_size = 256 + 3

    def encode(self, text: str) -> np.ndarray:
        raw = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
        return raw.astype(np.int32) + self.offset

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1)
        ids = ids[(ids >= self.offset) & (ids < self.vocab_size)]
        return (ids - self.offset).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259, pad=0, bos=1, eos=2)"


def _special_from_config(config: dict, key: str):
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A local ``tokenizer.json`` through the `tokenizers` package.

    ``path`` is the ``tokenizer.json`` file or a folder holding one. ``bos``/``eos``/``pad`` are
    token strings (e.g. ``"<s>"``); when omitted they are read from ``tokenizer_config.json``
    next to the file (``bos_token``, ``eos_token``, ``pad_token``) if it exists. A token string
    missing from the vocabulary is a `ValueError`.
    """

    def __init__(self, path: str | os.PathLike, *, bos: str | None = None,
                 eos: str | None = None, pad: str | None = None):
        import tokenizers  # the package, imported lazily: only this adapter needs it

        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} does not exist; pass a tokenizer.json "
                             "or a folder containing one")
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(path)
        config = {}
        config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        self.bos_id = self._token_id(bos if bos is not None
                                     else _special_from_config(config, "bos_token"))
        self.eos_id = self._token_id(eos if eos is not None
                                     else _special_from_config(config, "eos_token"))
        self.pad_id = self._token_id(pad if pad is not None
                                     else _special_from_config(config, "pad_token"))

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary of {self.path}")
        return int(idx)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        ids = ids.tolist() if isinstance(ids, np.ndarray) else [int(i) for i in ids]
        return self._tok.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, pad={self.pad_id})")


def identity(tokenizer) -> str:
    """A short string that changes when the tokenizer's output could (see module docstring)."""
    cls = type(tokenizer)
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    parts += [f"{k}={getattr(tokenizer, k, None)}"
              for k in ("vocab_size", "bos_id", "eos_id", "pad_id")]
    path = getattr(tokenizer, "path", None)
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        parts.append(f"{os.path.abspath(path)} sha256 {digest}")
    return " ".join(parts)
