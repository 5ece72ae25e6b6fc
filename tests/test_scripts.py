"""The README's commands as a new user runs them: ``./test.sh`` with a path runs only what it
names; with options only it runs every tier (tests/ and fuzz/). Collection only (``--co``): the
script's choice of what to run is what is tested, not the tests it runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _collected(*args: str) -> set[str]:
    """The test files ``./test.sh --co ARGS`` collects (the script's own pytest run)."""
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    out = subprocess.run([str(ROOT / "test.sh"), "--co", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}


def test_a_path_runs_only_that_file() -> None:
    assert _collected("tests/test_read_only.py") == {"tests/test_read_only.py"}
    # an option's value that names no path (-k, -m) leaves the choice to the path argument
    assert _collected("-k", "drops or says_why", "tests/test_read_only.py::test_open_that_cannot_write_says_why") \
        == {"tests/test_read_only.py"}


@pytest.mark.slow
def test_options_only_run_every_tier() -> None:
    everything = _collected("-m", "not slow")
    assert any(f.startswith("fuzz/") for f in everything) and any(f.startswith("tests/") for f in everything)
