"""zoo.data: reorder, tokenizers, corpus ranges and the packed Grain pipeline.

References are independent of the code under test: the reorder against a per-shard loop over
chunk indices, tokens against the files' own bytes split by hand, targets/weights/positions
against a plain Python loop over each row, process slices against the one-process batch,
load-balanced batches against the same pipeline without reordering.
"""

import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo.data import (ByteTokenizer, HFTokenizer, PipelineStateMismatch, load_balance,
                      restore_order, text_dataset)
from zoo.data import corpus

L = 32  # row length of the small-corpus tests
ONE = dict(process_index=0, process_count=1)


# ----------------------------------------------------------------------------- reorder

def _reference_order(length, cp):
    """Token indices after load balancing, by the definition: shard r = chunks r, 2cp-1-r."""
    chunk = length // (2 * cp)
    out = []
    for r in range(cp):
        for c in (r, 2 * cp - 1 - r):
            out += list(range(c * chunk, (c + 1) * chunk))
    return out


def test_known_permutation():
    x = np.arange(16)[None]
    want = [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    np.testing.assert_array_equal(load_balance(x, 4), [want])
    np.testing.assert_array_equal(restore_order(load_balance(x, 4), 4), x)
    got = jax.jit(lambda a: load_balance(a, 4))(jnp.asarray(x))
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), [want])


def test_cp1_is_identity():
    x = np.arange(15).reshape(3, 5)  # any length works at cp=1
    assert load_balance(x, 1) is x and restore_order(x, 1) is x


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 6), chunk=st.integers(1, 4), rank=st.integers(1, 4),
       data=st.data())
def test_reorder_property(cp, chunk, rank, data):
    length = 2 * cp * chunk
    axis = data.draw(st.integers(-rank, rank - 1))
    shape = [data.draw(st.integers(1, 3)) for _ in range(rank)]
    shape[axis] = length
    x = np.random.default_rng(cp * 100 + chunk).integers(0, 1000, size=shape)
    y = load_balance(x, cp, axis=axis)
    np.testing.assert_array_equal(y, np.take(x, _reference_order(length, cp), axis=axis))
    np.testing.assert_array_equal(restore_order(y, cp, axis=axis), x)
    np.testing.assert_array_equal(load_balance(restore_order(x, cp, axis), cp, axis), x)


def test_reorder_jax_matches_numpy_and_has_gradient():
    x = np.random.default_rng(0).normal(size=(2, 24, 3)).astype(np.float32)
    for cp in (2, 3):
        y = jax.jit(lambda a, cp=cp: load_balance(a, cp, axis=1))(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(y), load_balance(x, cp, axis=1))
        np.testing.assert_array_equal(np.asarray(restore_order(y, cp, axis=1)), x)
    # A permutation's gradient is the inverse permutation of the cotangent.
    w = jnp.asarray(np.arange(24, dtype=np.float32))
    g = jax.grad(lambda a: jnp.sum(load_balance(a, 3, axis=1) * w[None, :, None]))(
        jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(g)[0, :, 0],
                                  restore_order(np.arange(24.0)[None], 3)[0])


def test_reorder_errors():
    with pytest.raises(ValueError, match=r"length 30 .*2\*context_parallel = 8.*nearest valid "
                                         r"length is 32"):
        load_balance(np.zeros((1, 30)), 4)
    with pytest.raises(ValueError, match="nearest valid length is 24"):
        restore_order(np.zeros((1, 25)), 3)
    with pytest.raises(ValueError, match="context_parallel=0"):
        load_balance(np.zeros((1, 8)), 0)


# ----------------------------------------------------------------------------- tokenizers

@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8", "replace"),
                                                     np.uint8).astype(np.int32) + 3)
    assert ids.size == 0 or (ids.min() >= 3 and ids.max() < tok.vocab_size)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text.encode(
        "utf-8", "replace").decode("utf-8")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}))
    return d, vocab


def test_hf_tokenizer(hf_dir, tmp_path):
    d, vocab = hf_dir
    tok = HFTokenizer(d)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 0, len(vocab))
    np.testing.assert_array_equal(tok.encode("the cat sat"), [4, 5, 6])
    assert tok.encode("the zebra").tolist() == [4, vocab["[UNK]"]]
    assert HFTokenizer(d / "tokenizer.json", bos="the").bos_id == 4
    with pytest.raises(ValueError, match="'<bos>' is not in the vocabulary"):
        HFTokenizer(d, bos="<bos>")
    with pytest.raises(ValueError, match="does not exist"):
        HFTokenizer(tmp_path / "nope")

    # Through the pipeline: every document is [bos] + ids + [eos], cut into rows of 4.
    texts = ["the cat sat on the mat", "a dog", "the dog sat on a cat on a mat the end"]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    batches = list(text_dataset(tmp_path / "docs.jsonl", seq_len=4, batch_size=2, num_epochs=1,
                                tokenizer=tok, **ONE))
    want = []
    for t in texts:
        ids = [1] + [vocab.get(w, 3) for w in t.split()] + [2]
        want += [tuple(ids[i:i + 4]) for i in range(0, len(ids), 4)]
    assert sorted(_pieces(batches)) == sorted(want)


# ----------------------------------------------------------------------------- corpus ranges

@settings(max_examples=40, deadline=None)
@given(lines=st.lists(st.text(st.characters(blacklist_characters="\n",
                                                   blacklist_categories=("Cs",)), max_size=30),
                      min_size=1, max_size=12),
       trailing=st.booleans(), range_bytes=st.integers(1, 40))
def test_ranges_cover_every_line_once(tmp_path_factory, lines, trailing, range_bytes):
    d = tmp_path_factory.mktemp("ranges")
    raw = "\n".join(lines) + ("\n" if trailing else "")
    (d / "a.txt").write_bytes(raw.encode())
    (d / "b.jsonl").write_bytes(("\n".join(json.dumps({"text": t}) for t in lines)
                                 + ("\n" if trailing else "")).encode())
    files = [str(d / "a.txt"), str(d / "b.jsonl")]
    if not raw:
        with pytest.raises(ValueError):
            corpus.index_ranges(files[:1], range_bytes)
        return
    text_docs, json_docs = [], []
    for rng in corpus.index_ranges(files, range_bytes):
        (json_docs if rng[4] else text_docs).append(corpus.read_documents(*rng))
    flat = [doc for docs in text_docs for doc in docs]
    assert "".join(t for t, _, _ in flat) == raw
    assert [s for _, s, _ in flat] == [True] + [False] * (len(flat) - 1)
    assert [e for _, _, e in flat] == [False] * (len(flat) - 1) + [True]
    assert [t for docs in json_docs for t, _, _ in docs] == lines


# ----------------------------------------------------------------------------- pipeline

def _check_rows(b, pad_id=0):
    """Plain-loop reference for targets/weights/positions from inputs and segment ids."""
    inputs, seg = b["inputs"], b["segment_ids"]
    assert all(v.dtype == np.int32 for k, v in b.items() if k != "loss_weights")
    assert b["loss_weights"].dtype == np.float32
    for r in range(inputs.shape[0]):
        pos = 0
        for j in range(inputs.shape[1]):
            s = seg[r, j]
            if s == 0:
                assert inputs[r, j] == pad_id and b["positions"][r, j] == 0
            else:
                pos = pos + 1 if j and seg[r, j - 1] == s else 0
                assert b["positions"][r, j] == pos
            same = j + 1 < inputs.shape[1] and s > 0 and seg[r, j + 1] == s
            assert b["loss_weights"][r, j] == float(same)
            assert b["targets"][r, j] == (inputs[r, j + 1] if same else pad_id)
        used = seg[r][seg[r] > 0]  # segments 1..n in order, padding only at the end
        assert list(np.unique(used)) == list(range(1, len(np.unique(used)) + 1))
        assert np.all(np.diff(seg[r][: len(used)]) >= 0) and np.all(seg[r][len(used):] == 0)


def _pieces(batches):
    out = []
    for b in batches:
        for r in range(b["inputs"].shape[0]):
            for s in np.unique(b["segment_ids"][r]):
                if s:
                    out.append(tuple(b["inputs"][r][b["segment_ids"][r] == s].tolist()))
    return out


def _expected_pieces(docs_bytes, seq_len=L):
    out = []
    for raw in docs_bytes:
        ids = [1] + [c + 3 for c in raw] + [2]
        out += [tuple(ids[i:i + seq_len]) for i in range(0, len(ids), seq_len)]
    return out


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """Documents shorter than, equal to, and many times longer than a row (L=32 tokens)."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    alphabet = [*"abcdefgh ijkl\nmnop", "é", "日本", "→"]

    def text(n):  # n characters, some multi-byte
        return "".join(rng.choice(alphabet, size=n))

    docs = {"short.txt": "hi there", "equal.md": "x" * (L - 2),
            "long.py": text(700), "two.txt": "y" * (2 * L - 2), "sub/deep.txt": text(150),
            "sub/notes.md": text(40), "empty.txt": "", "ignored.csv": "a,b"}
    for name, t in docs.items():
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_bytes(t.encode())
    lines = [text(5), text(90), "", text(31)]  # the empty document is skipped
    (d / "lines.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines)
                                   + "\n\n  \n")  # so are blank lines
    expected = [docs[n].encode() for n in docs if n not in ("empty.txt", "ignored.csv")]
    expected += [t.encode() for t in lines if t]
    return d, _expected_pieces(expected)


def test_one_epoch_accounts_for_every_token(small_corpus):
    d, want = small_corpus
    batches = list(text_dataset(d, seq_len=L, batch_size=4, num_epochs=1, seed=3, **ONE))
    for b in batches:
        assert set(b) == {"inputs", "targets", "positions", "segment_ids", "loss_weights"}
        assert all(v.shape == (4, L) for v in b.values())
        _check_rows(b)
    assert sorted(_pieces(batches)) == sorted(want)  # nothing dropped, nothing twice
    n_tokens = sum(len(p) for p in want)
    assert sum(int((b["segment_ids"] > 0).sum()) for b in batches) == n_tokens
    # one target per token except the last of each piece
    assert sum(b["loss_weights"].sum() for b in batches) == n_tokens - len(want)
    rows_used = [(b["segment_ids"] > 0).any(axis=1) for b in batches]
    assert all(r.all() for r in rows_used[:-1]) and rows_used[-1][0]  # only the end is padded

    two = list(text_dataset(d, seq_len=L, batch_size=4, num_epochs=2, seed=3, **ONE))
    assert sorted(_pieces(two)) == sorted(want * 2)
    assert _pieces(two)[: len(want)] != _pieces(two)[len(want):2 * len(want)]  # reshuffled


def test_last_partial_batch_is_padded_not_dropped(tmp_path):
    (tmp_path / "a.txt").write_text("z" * (3 * L - 2))  # exactly 3 full rows
    batches = list(text_dataset(tmp_path, seq_len=L, batch_size=2, num_epochs=1, **ONE))
    assert len(batches) == 2
    assert (batches[1]["segment_ids"][1] == 0).all() and batches[1]["loss_weights"][1].sum() == 0
    assert sorted(_pieces(batches)) == sorted(_expected_pieces([b"z" * (3 * L - 2)]))


def test_deterministic_and_seeded(small_corpus):
    d, _ = small_corpus
    a = list(text_dataset(d, seq_len=L, batch_size=4, num_epochs=1, seed=1, **ONE))
    b = list(text_dataset(d, seq_len=L, batch_size=4, num_epochs=1, seed=1, **ONE))
    c = list(text_dataset(d, seq_len=L, batch_size=4, num_epochs=1, seed=2, **ONE))
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))


def test_load_balanced_rows_are_valid_after_restore(small_corpus):
    """Every strategy's batches are per-row permutations of the plain ones (`load_balance` of the
    plain batch, by positions and segments) and `restore_order` gives the plain batch back."""
    d, want = small_corpus
    kw = dict(seq_len=L, batch_size=4, num_epochs=1, seed=5, **ONE)
    plain = list(text_dataset(d, context_parallel=4, load_balance=False, **kw))
    assert plain and all(_same(a, b) for a, b in zip(
        plain, text_dataset(d, context_parallel=4, balance="none", **kw)))
    for strategy in ("auto", "row", "document"):
        balanced = list(text_dataset(d, context_parallel=4, balance=strategy, **kw))
        assert len(balanced) == len(plain)
        for bal, ref in zip(balanced, plain):
            restored = restore_order(bal, 4)  # positions/segment_ids from the batch
            for k in ref:
                np.testing.assert_array_equal(restored[k], ref[k])
            np.testing.assert_array_equal(bal["inputs"], load_balance(ref, 4, strategy=strategy)[
                "inputs"])
            if strategy == "row":
                np.testing.assert_array_equal(bal["inputs"], load_balance(ref["inputs"], 4))
            _check_rows(restored)
    assert sorted(_pieces(plain)) == sorted(want)


def test_process_slices_concatenate_to_global_batch(small_corpus):
    d, _ = small_corpus
    kw = dict(seq_len=L, batch_size=4, num_epochs=1, context_parallel=2, seed=7)
    whole = list(text_dataset(d, process_index=0, process_count=1, **kw))
    parts = [list(text_dataset(d, process_index=i, process_count=2, **kw)) for i in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(whole)
    for g, p0, p1 in zip(whole, *parts):
        for k in g:
            assert p0[k].shape == (2, L)
            np.testing.assert_array_equal(np.concatenate([p0[k], p1[k]]), g[k])


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in a)


def test_state_restore_repeats_following_batches(small_corpus):
    d, _ = small_corpus
    kw = dict(seq_len=L, batch_size=2, num_epochs=2, context_parallel=2, seed=11, **ONE)
    it = text_dataset(d, **kw)
    states, batches = [], []
    while True:
        states.append(json.loads(json.dumps(it.get_state())))  # must survive JSON
        try:
            batches.append(next(it))
        except StopIteration:
            break
    n = len(batches)
    for k in (0, 1, n // 2 - 1, n // 2, n // 2 + 1, n - 1):  # includes the epoch boundary
        fresh = text_dataset(d, **kw)
        fresh.set_state(states[k])
        rest = list(fresh)
        assert len(rest) == n - k and all(_same(a, b) for a, b in zip(rest, batches[k:]))


def test_resume_with_other_arguments_is_refused(small_corpus, tmp_path):
    """A state saved under other seq_len/balance/cp/corpus/paths/tokenizer is refused, naming
    each difference; the same arguments (and a state from before arguments were saved) pass."""
    d, _ = small_corpus
    kw = dict(seq_len=L, batch_size=2, context_parallel=2, seed=4, **ONE)
    it = text_dataset(d, **kw)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = next(it)
    other = tmp_path / "other.txt"
    other.write_text("another corpus")
    changes = [(dict(seq_len=2 * L), "seq_len: saved 32, now 64"),
               (dict(balance="row"), "balance: saved 'auto', now 'row'"),
               (dict(context_parallel=4), "context_parallel: saved 2, now 4"),
               (dict(corpus_docs="short"), "corpus_docs"),
               (dict(tokenizer=_HalfTokenizer()), "tokenizer: saved 'zoo.data.tokenizer")]
    for change, message in changes:
        fresh = text_dataset(d, **kw | change)
        with pytest.raises(PipelineStateMismatch, match=re.escape(message)):
            fresh.set_state(state)
    with pytest.raises(PipelineStateMismatch, match=r"paths: saved .*; files: saved"):
        text_dataset(other, **kw).set_state(state)
    for saved in (state, {k: v for k, v in state.items() if k != "zoo_data_arguments"}):
        fresh = text_dataset(d, **kw | dict(batch_size=2))
        fresh.set_state(saved)
        assert _same(next(fresh), want)


class _HalfTokenizer(ByteTokenizer):
    """Another tokenizer with the same vocabulary: only its identity differs."""


def test_state_restore_infinite_builtin_corpus():
    kw = dict(seq_len=128, batch_size=4, context_parallel=2, **ONE)
    it = text_dataset(**kw)
    for _ in range(40):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    ref = [next(it) for _ in range(30)]
    fresh = text_dataset(**kw)
    next(fresh)  # a used iterator restores too
    fresh.set_state(state)
    assert all(_same(a, next(fresh)) for a in ref)


def test_builtin_corpus_fills_rows_and_starts_fast():
    start = time.perf_counter()
    it = text_dataset(seq_len=1024, batch_size=8, **ONE)
    first = next(it)
    assert time.perf_counter() - start < 5.0, "first batch of the built-in corpus is slow"
    batches = [first] + [next(it) for _ in range(39)]
    fill = np.mean([(b["segment_ids"] > 0).mean() for b in batches])
    assert fill >= 0.97, f"fill {fill:.4f}"
    _check_rows(batches[0])
    text = ByteTokenizer().decode(batches[0]["inputs"][0])
    assert "def " in text or "import " in text or "class " in text  # real Python source


def test_errors(tmp_path, small_corpus):
    d, _ = small_corpus
    with pytest.raises(ValueError, match=r"'.*nope\.txt' \(does not exist\)"):
        text_dataset([d, tmp_path / "nope.txt"], seq_len=L, batch_size=4, **ONE)
    with pytest.raises(ValueError, match="glob matched nothing"):
        text_dataset(str(tmp_path / "*.zzz"), seq_len=L, batch_size=4, **ONE)
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.md").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        text_dataset(tmp_path, seq_len=L, batch_size=4, **ONE)
    with pytest.raises(ValueError, match=r"batch_size=6 is not divisible by process_count=4.*"
                                         r"use 8 or 4"):
        text_dataset(d, seq_len=L, batch_size=6, process_index=0, process_count=4)
    with pytest.raises(ValueError, match=r"seq_len 100 is not divisible by 2\*context_parallel = 8"
                                         r".*nearest valid length is 96"):
        text_dataset(d, seq_len=100, batch_size=4, context_parallel=4, **ONE)
    text_dataset(d, seq_len=100, batch_size=4, context_parallel=4, load_balance=False, **ONE)
    with pytest.raises(ValueError, match="process_index=2"):
        text_dataset(d, seq_len=L, batch_size=4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="seq_len=0"):
        text_dataset(d, seq_len=0, batch_size=4, **ONE)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text('{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl: line at byte 0 has no string 'text'"):
        text_dataset(bad, seq_len=L, batch_size=4, **ONE)


def test_default_process_index_and_explicit_file_list(small_corpus):
    d, _ = small_corpus
    assert jax.process_count() == 1
    files = [d / "short.txt", os.path.join(d, "sub", "*.md")]
    batches = list(text_dataset(files, seq_len=L, batch_size=2, shuffle=False, num_epochs=1))
    assert batches[0]["inputs"].shape == (2, L)
    assert sorted(_pieces(batches)) == sorted(_expected_pieces(
        [b"hi there", (d / "sub" / "notes.md").read_bytes()]))
