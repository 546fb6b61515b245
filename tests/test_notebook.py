"""notebooks/inspect_sharding.ipynb ships executed: a fresh run gives the stored outputs.

The text of every code cell's outputs is compared with what is stored (volatile parts such as
addresses and durations masked, HTML renderings ignored: `zoo.notebooks.cell_texts`). When the
code changes what the notebook prints, refresh it with ``python -m zoo.notebooks``.
"""

import pathlib

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "inspect_sharding.ipynb"


def test_stored_outputs_are_current():
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from zoo import notebooks

    stored = nbformat.read(NOTEBOOK, as_version=4)
    texts = notebooks.cell_texts(stored)
    assert all(texts), "cells without stored outputs: run python -m zoo.notebooks"
    fresh = notebooks.execute(NOTEBOOK)
    diffs = notebooks.differences(stored, fresh)
    assert not diffs, ("the stored outputs are stale; refresh them with "
                       "`python -m zoo.notebooks`:\n" + "\n\n".join(diffs))
    outputs = "\n".join(texts)
    assert "671,026,404,352 parameters" in outputs  # the full model, built abstractly
    assert "P('fsdp', ('context', 'expert')" in outputs  # ep_as_cp activations
    assert "GiB per device on 256 devices" in outputs
    # the strategies: same parameter bytes per device, differently cut activations
    prose = "\n".join(c.source for c in stored.cells if c.cell_type == "markdown")
    assert "activations" in prose and "parameters" in prose


def test_masking_keeps_what_matters():
    from zoo.notebooks import _mask
    assert _mask("<obj at 0x7f3a2b>  \ncompiled in 12.5s, 30 ms") == \
        "<obj at 0x?>\ncompiled in <duration>, <duration>"
    assert _mask("8 devices, 256 steps, 0.56 MiB") == "8 devices, 256 steps, 0.56 MiB"


def test_a_changed_output_is_reported():
    nbformat = pytest.importorskip("nbformat")
    from zoo.notebooks import differences

    stored = nbformat.read(NOTEBOOK, as_version=4)
    changed = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in changed.cells if c.cell_type == "code" and "671," in str(c.outputs))
    out = next(o for o in cell.outputs if o.output_type == "stream")
    out.text = out.text.replace("671,026,404,352", "671,026,404,353")
    assert differences(stored, stored) == []
    (diff,) = differences(stored, changed)
    assert "-671,026,404,352 parameters" in diff and "+671,026,404,353 parameters" in diff
