"""notebooks/inspect_sharding.ipynb executes top to bottom without errors (nbclient)."""

import os
import pathlib

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "inspect_sharding.ipynb"


def test_inspect_sharding_notebook_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_flags = os.environ.get("XLA_FLAGS", "")
    assert "xla_force_host_platform_device_count=8" in env_flags  # inherited by the kernel
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "\n".join(
        out.get("text", "") + "".join(str(v) for v in out.get("data", {}).values())
        for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []))
    assert "671,026,404,352 parameters" in outputs  # the full model, built abstractly
    assert "P('fsdp', ('context', 'expert')" in outputs  # ep_as_cp activations/parameters
    assert "GiB per device on 256 devices" in outputs
