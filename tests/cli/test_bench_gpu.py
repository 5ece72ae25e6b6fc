"""benchmarks/bench_gpu.py without a CUDA device: one line saying so, exit status 0, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root

pytestmark = pytest.mark.slow  # the GPU benchmark's child process: the slow tier

ROOT = REPO_DIR
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_gpu.py")


def test_bench_gpu_without_cuda_exits_zero_with_one_line(tmp_path: Any) -> None:
    """CPU machines (CI, developers) run the prepared GPU benchmark harmlessly: exit 0, one line."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device even where one exists
    out = tmp_path / "gpu.json"
    cp = subprocess.run([sys.executable, SCRIPT, "--json", str(out), "--dir", str(tmp_path)],
                        capture_output=True, text=True, env=env, timeout=120)
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_gpu: no CUDA") and "nothing measured" in lines[0]
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_bench_gpu_help_names_its_options() -> None:
    """The options a device session passes exist (a typo there would waste the device time)."""
    cp = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    for opt in ("--size-mib", "--repeat", "--json", "--dir"):
        assert opt in cp.stdout


def test_gpu_check_script_is_valid_bash() -> None:
    """scripts/gpu_check.sh parses (bash -n): a syntax error would surface only on the device."""
    cp = subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "gpu_check.sh")], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
