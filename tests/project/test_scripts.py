"""The README's commands as a new user runs them: ``./test.sh`` with a path runs only what it
names; with options only it runs every tier (tests/ and fuzz/) — collection only (``--co``): the
script's choice of what to run is what is tested, not the tests it runs; ``./demo.sh``'s program
reports a median time to first token after a warm-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _collected(*args: str) -> set[str]:
    """The test files ``./test.sh --co ARGS`` collects (the script's own pytest run)."""
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    out = subprocess.run([str(ROOT / "test.sh"), "--co", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}


def test_a_path_runs_only_that_file() -> None:
    assert _collected("tests/lifecycle/test_read_only.py") == {"tests/lifecycle/test_read_only.py"}
    # an option's value that names no path (-k, -m) leaves the choice to the path argument
    one = "tests/lifecycle/test_read_only.py::test_open_that_cannot_write_says_why"
    assert _collected("-k", "drops or says_why", one) == {"tests/lifecycle/test_read_only.py"}


@pytest.mark.slow
def test_options_only_run_every_tier() -> None:
    everything = _collected("-m", "not slow")
    assert any(f.startswith("fuzz/") for f in everything) and any(f.startswith("tests/") for f in everything)


@pytest.mark.slow
def test_the_demo_reports_a_median_after_a_warm_up(tmp_path: Path) -> None:
    """examples/demo.py (what ./demo.sh runs), on a shorter system prompt: the second phase times
    several calls each way after a warm-up and reports their median (one timed call, warm-up
    included, swung the ratio 3.6-28x between runs), every call byte-identical."""
    env = dict(os.environ, SNAPSTORE_DIR=str(tmp_path / "store"))
    demo = [sys.executable, str(ROOT / "examples" / "demo.py"), "--system", "256", "--threads", "1"]
    first = subprocess.run([*demo, "--phase", "first"], capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    second = subprocess.run([*demo, "--phase", "second", "--runs", "3"], capture_output=True, text=True,
                            timeout=600, env=env)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "restored 256 (the system prompt)" in second.stdout
    assert "time to first token (median of 3 calls each way, after a warm-up)" in second.stdout
    assert "every token and score, every call): True" in second.stdout
