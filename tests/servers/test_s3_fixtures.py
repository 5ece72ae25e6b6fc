"""No SeaweedFS server outlives a test run (issue 47 item 12): a run ended by SIGTERM (CI's
timeout, a user's kill) tears its session down and stops the cluster; one ended by SIGKILL takes
the servers with it (parent-death signal). A child pytest run starts the cluster and is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from s3_fixtures import weed_binary

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parents[1]

CHILD = """
import os, time
from s3_fixtures import seaweed  # noqa: F401 - the fixture

def test_holds_the_cluster(seaweed):
    pids = [p.pid for p in seaweed.procs.values()]
    with open(os.environ["PIDS_OUT"] + ".tmp", "w") as f:
        f.write(" ".join(map(str, pids)))
    os.rename(os.environ["PIDS_OUT"] + ".tmp", os.environ["PIDS_OUT"])
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_killed_test_run_leaves_no_server_running(sig: str, tmp_path: Path) -> None:
    if weed_binary() is None:
        pytest.skip("SeaweedFS not available")
    (tmp_path / "test_child.py").write_text(CHILD)
    pids_out = tmp_path / "pids"
    env = dict(os.environ, PIDS_OUT=str(pids_out), PYTHONPATH=str(HERE))
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                            str(tmp_path / "test_child.py")], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not pids_out.exists():
        assert run.poll() is None, run.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the cluster did not come up"
        time.sleep(0.2)
    pids = [int(p) for p in pids_out.read_text().split()]
    assert pids and all(_alive(p) for p in pids)
    run.send_signal(getattr(signal, sig))
    run.wait(timeout=120)
    gone = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < gone:
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:  # clean up after a failure
        os.kill(p, signal.SIGKILL)
    assert not left, f"{sig}: SeaweedFS servers {left} still running after the test run ended"
