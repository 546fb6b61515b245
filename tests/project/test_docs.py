"""Every ```python block of README.md and docs/*.md runs as written.

Each block runs in a fresh interpreter (`sys.executable`), started in an empty temporary
directory, with 8 virtual CPU devices and ``JAX_PLATFORMS=cpu``, within `TIMEOUT` seconds. A
block that is not meant to run is fenced as ``text`` or ``bash``, not ``python``.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 240
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(path: pathlib.Path) -> list[str]:
    """The bodies of the page's ```python fences, in order."""
    return FENCE.findall(path.read_text(encoding="utf-8"))


BLOCKS = [(f"{page.relative_to(ROOT)}:{i}", code)
          for page in PAGES for i, code in enumerate(python_blocks(page))]


def test_enough_blocks():
    assert len(BLOCKS) >= 8, [name for name, _ in BLOCKS]


def block_env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUM_CPU_DEVICES"] = "8"
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
    # The block imports the checkout's zoo even when the package is installed elsewhere.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.e2e
@pytest.mark.parametrize("name,code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_block_runs(name, code, tmp_path):
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=block_env(),
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(f"{name} ran past {TIMEOUT} s\n--- stderr ---\n{(err or '')[-6000:]}")
    if done.returncode != 0:
        pytest.fail(f"{name} exited {done.returncode}\n--- block ---\n{code}"
                    f"--- stderr ---\n{done.stderr[-6000:]}", pytrace=False)
