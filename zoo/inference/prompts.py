"""Prompts into a batch: checked (`checked_prompts`), left-padded to what the partitioner
divides (`pad_prompts`), and continuations back as the caller gave the prompts (`decoded`)."""

from __future__ import annotations

import numpy as np

from zoo.inference.sampling import check_sampling
from zoo.models.decoder import nominal_inputs_shape

__all__ = ["checked_prompts", "decoded", "pad_prompts", "round_up"]


def _as_prompts(model, prompts, tokenizer) -> list[list[int]]:
    if tokenizer is not None:
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        prompts = [[int(t) for t in tokenizer.encode(text)] for text in texts]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("generate: prompts must be a non-empty list of token-id lists (or of "
                         "strings, with tokenizer=)")
    V = model.config.vocab_size
    out = []
    for i, ids in enumerate(prompts):
        ids = [int(t) for t in np.asarray(ids).ravel()] if not isinstance(ids, str) else None
        if ids is None:
            raise ValueError("generate: prompts are text; pass tokenizer= to encode them")
        if not ids:
            raise ValueError(f"generate: prompt {i} is empty; give it at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"generate: prompt {i} holds ids {bad[:5]} outside the "
                             f"vocabulary [0, {V})")
        out.append(ids)
    return out


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_prompts(model, ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ``tokens [B, L]`` and ``segment_ids`` (1 on tokens) with B and L rounded up
    to what the model's partitioner divides: every row's last token in the last slot."""
    nb, nl = nominal_inputs_shape(model.partitioner)
    B, L = round_up(len(ids), nb), round_up(max(map(len, ids)), nl)
    tokens = np.zeros((B, L), np.int32)
    segs = np.zeros((B, L), np.int32)
    for i, row in enumerate(ids):
        tokens[i, L - len(row):], segs[i, L - len(row):] = row, 1
    return tokens, segs


def checked_prompts(model, prompts, tokenizer, max_new_tokens, temperature, top_k, top_p,
                    stop, seed=0) -> tuple[list[list[int]], set[int]]:
    """(prompt ids, stop ids) after checking the sampling arguments and the model's room."""
    check_sampling(max_new_tokens, temperature, top_k, top_p, model.config.vocab_size, seed)
    ids = _as_prompts(model, prompts, tokenizer)
    stops = set() if stop is None else {int(stop)} if isinstance(stop, (int, np.integer)) \
        else {int(s) for s in stop}
    longest = max(map(len, ids))
    limit = model.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(f"generate: the longest prompt ({longest} tokens) plus max_new_tokens="
                         f"{max_new_tokens} exceeds the model's {limit} positions "
                         f"(max_position_embeddings); shorten the prompt or generate fewer")
    return ids, stops


def decoded(ids: list[list[int]], prompts, tokenizer):
    """Token ids as the caller gave the prompts: ids, or text (one string for one string)."""
    if tokenizer is None:
        return ids
    texts = [tokenizer.decode(row) for row in ids]
    return texts[0] if isinstance(prompts, str) else texts
