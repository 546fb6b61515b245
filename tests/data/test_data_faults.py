"""Data folders that could mislead the pipeline: symlinks that loop or name a file twice, and
files edited in place keeping their size.

* A folder holding ``self -> .`` (and a link to a sibling folder, and a second name of a file)
  gives exactly the tokens of the same folder without the links, with one warning that counts
  what was skipped.
* The pipeline's recorded arguments cover the files' contents: a same-size edit is refused on
  resume (`PipelineStateMismatch` naming ``contents``; the trainer compares the same arguments
  with `argument_changes` and exits 2, see tests/train/test_faults.py), while a ``touch`` is
  not; a state saved before contents were recorded still resumes.
"""

import json
import os
import pathlib
import warnings

import numpy as np
import pytest

from zoo.data import PipelineStateMismatch, argument_changes, corpus, text_dataset

ONE = dict(process_index=0, process_count=1)
L = 32


def write_corpus(d: pathlib.Path) -> None:
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("the quick brown fox " * 20)
    (d / "b.jsonl").write_text("\n".join(json.dumps({"text": f"line {i} " * (i + 3)})
                                         for i in range(6)))
    (d / "sub" / "c.md").write_text("# notes\n" + "jumps over the lazy dog\n" * 9)


def all_tokens(path) -> list[int]:
    """Every token of one epoch in file order, padding dropped."""
    out = []
    for b in text_dataset(path, seq_len=L, batch_size=2, num_epochs=1, shuffle=False,
                          balance="none", **ONE):
        out += b["inputs"][b["segment_ids"] > 0].tolist()
    return out


def test_symlink_loops_and_second_names_are_read_once(tmp_path):
    plain, linked = tmp_path / "plain", tmp_path / "linked"
    write_corpus(plain)
    write_corpus(linked)
    os.symlink(".", linked / "self")  # a loop: os.walk(followlinks=True) went 40 deep
    os.symlink("..", linked / "sub" / "up")
    os.symlink("sub", linked / "again")  # the same folder under a second name
    os.symlink("a.txt", linked / "alias.txt")  # the same file under a second name
    want = all_tokens(plain)
    assert len(want) > 500
    with pytest.warns(UserWarning) as record:
        files = corpus.find_files(linked)
    assert [os.path.relpath(f, linked) for f in files] == ["a.txt", "b.jsonl",
                                                           os.path.join("sub", "c.md")]
    message = str(record[0].message)
    assert "skipped 1 second name(s) of a file and 3 folder(s) already walked" in message
    assert "each of the 3 files is read once" in message
    with warnings.catch_warnings():  # noted once per process, not per listing
        warnings.simplefilter("error")
        got = all_tokens(linked)
    assert len(got) == len(want)
    assert sorted(got) == sorted(want)


def edit_keeping_size(path: pathlib.Path, keep_mtime: bool) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the middle
    path.write_bytes(bytes(data))
    assert path.stat().st_size == st.st_size
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_same_size_edit_is_refused_on_resume_and_a_touch_is_not(tmp_path):
    d = tmp_path / "data"
    write_corpus(d)
    kw = dict(seq_len=L, batch_size=2, seed=1, **ONE)
    it = text_dataset(d, **kw)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = next(it)
    os.utime(d / "a.txt")  # a touch: the same bytes
    fresh = text_dataset(d, **kw)
    fresh.set_state(state)
    assert all(np.array_equal(v, want[k]) for k, v in next(fresh).items())
    # a state saved before the contents were recorded resumes as it did
    old = {**state, "zoo_data_arguments": {k: v for k, v in state["zoo_data_arguments"].items()
                                           if k != "contents"}}
    text_dataset(d, **kw).set_state(old)
    for keep_mtime in (False, True):
        edit_keeping_size(d / "sub" / "c.md", keep_mtime)
        with pytest.raises(PipelineStateMismatch, match=r"contents: saved 'sha256 of the "
                                                        r"first and last MiB of each file"):
            text_dataset(d, **kw).set_state(state)
        edit_keeping_size(d / "sub" / "c.md", keep_mtime)  # back as it was
        text_dataset(d, **kw).set_state(state)


def test_the_contents_digest_reads_both_ends_of_a_large_file(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    (d / "big.txt").write_bytes(b"abcdefgh\n" * (300_000))  # 2.7 MB: head and tail are read
    args = text_dataset(d, seq_len=L, batch_size=2, **ONE).arguments
    for offset in (10, os.path.getsize(d / "big.txt") - 10):
        data = bytearray((d / "big.txt").read_bytes())
        data[offset] = ord("X")
        (d / "big.txt").write_bytes(bytes(data))
        now = text_dataset(d, seq_len=L, batch_size=2, **ONE).arguments
        assert [c.split(":")[0] for c in argument_changes(args, now)] == ["contents"]
        args = now
