"""notebooks/inspect_sharding.ipynb ships executed: a fresh run gives the stored outputs.

The text of every code cell's outputs is compared with what is stored (volatile parts such as
addresses and durations masked, HTML renderings ignored: `cell_texts` in `tools/notebooks.py`,
a script loaded here by its path). When the code changes what the notebook prints, refresh it
with ``python tools/notebooks.py``.
"""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "inspect_sharding.ipynb"


@pytest.fixture(scope="module")
def notebooks():
    spec = importlib.util.spec_from_file_location("notebooks", ROOT / "tools" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e  # a Jupyter kernel in its own process runs the whole notebook
def test_stored_outputs_are_current(notebooks):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")

    stored = nbformat.read(NOTEBOOK, as_version=4)
    texts = notebooks.cell_texts(stored)
    assert all(texts), "cells without stored outputs: run python tools/notebooks.py"
    fresh = notebooks.execute(NOTEBOOK)
    diffs = notebooks.differences(stored, fresh)
    assert not diffs, ("the stored outputs are stale; refresh them with "
                       "`python tools/notebooks.py`:\n" + "\n\n".join(diffs))
    outputs = "\n".join(texts)
    assert "671,026,404,352 parameters" in outputs  # the full model, built abstractly
    assert "P('fsdp', ('context', 'expert')" in outputs  # ep_as_cp activations
    assert "GiB per device on 256 devices" in outputs
    # the strategies: same parameter bytes per device, differently cut activations
    prose = "\n".join(c.source for c in stored.cells if c.cell_type == "markdown")
    assert "activations" in prose and "parameters" in prose


def test_masking_keeps_what_matters(notebooks):
    assert notebooks._mask("<obj at 0x7f3a2b>  \ncompiled in 12.5s, 30 ms") == \
        "<obj at 0x?>\ncompiled in <duration>, <duration>"
    assert notebooks._mask("8 devices, 256 steps, 0.56 MiB") == "8 devices, 256 steps, 0.56 MiB"


def test_a_changed_output_is_reported(notebooks):
    nbformat = pytest.importorskip("nbformat")
    differences = notebooks.differences

    stored = nbformat.read(NOTEBOOK, as_version=4)
    changed = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in changed.cells if c.cell_type == "code" and "671," in str(c.outputs))
    out = next(o for o in cell.outputs if o.output_type == "stream")
    out.text = out.text.replace("671,026,404,352", "671,026,404,353")
    assert differences(stored, stored) == []
    (diff,) = differences(stored, changed)
    assert "-671,026,404,352 parameters" in diff and "+671,026,404,353 parameters" in diff
