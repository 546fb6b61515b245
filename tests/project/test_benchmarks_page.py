"""docs/benchmarks.md (and the benchmark sections of other docs/ pages) are what
tools/benchmarks_page.py renders from docs/benchmarks/*.json: nobody edits them by hand."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


page = load(ROOT / "tools" / "benchmarks_page.py", "benchmarks_page")
record = load(ROOT / "benchmarks" / "_record.py", "benchmarks_record")


def test_pages_are_rendered_from_the_records():
    for path, text in page.rendered().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(ROOT)} is not what tools/benchmarks_page.py renders from "
            f"docs/benchmarks/*.json; run `python tools/benchmarks_page.py` (and change the "
            f"records, not the page)")


def test_every_record_has_its_provenance():
    records = page.load_records()
    assert len(records) >= 8
    for r in records:
        for key in page.REQUIRED:
            assert r[key] not in (None, "", []), (r["benchmark"], key)
        assert r["benchmark"] in page.PAGE.read_text(encoding="utf-8") or r.get("title")


def test_a_bad_record_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"benchmark": "x", "columns": ["a"],
                                                 "rows": [["1"]]}))
    with pytest.raises(ValueError, match="missing command"):
        page.load_records(tmp_path)
    (tmp_path / "x.json").write_text(json.dumps(
        {"benchmark": "x", "command": "c", "date": "d", "commit": "c", "machine": "m",
         "load_average": "1", "columns": ["a", "b"], "rows": [["1"]]}))
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        page.load_records(tmp_path)


def test_a_benchmark_table_becomes_a_record(tmp_path, monkeypatch):
    printed = ("## Memory\n\n| length | bytes |\n|---|---:|\n| 1024 | 3 MiB |\n\n"
               "## Work\n\n| cp | share |\n|---|---|\n| 8 | 0.504 |\n")
    monkeypatch.setattr("sys.argv", [str(ROOT / "benchmarks" / "x.py"), "--n", "2",
                                     "--json", str(tmp_path)])
    record.write_tables(str(tmp_path), ["memory", "work"], record.markdown_tables(printed))
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["command"] == "python benchmarks/x.py --n 2"
    assert memory["title"] == "Memory" and memory["rows"] == [["1024", "3 MiB"]]
    work = json.loads((tmp_path / "work.json").read_text())
    assert work["columns"] == ["cp", "share"]
    rendered = page.render_page(page.load_records(tmp_path))
    assert "| 8 | 0.504 |" in rendered and "python benchmarks/x.py --n 2" in rendered
