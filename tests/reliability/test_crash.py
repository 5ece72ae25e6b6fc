"""Crash campaign: a real child process works on a store and is SIGKILLed at random moments and at
injected points between the fsync / link / unlink / COMMIT steps of the save path (invariant 4).

After every kill the parent reopens the same store (it is reused across kills) and checks:
verify(deep=True) is ok (only orphans / temp files / dead pending captures, which gc cleans);
no pending capture survives; every visible snapshot restores byte-exact against the workload
model (so nothing half-written is visible); every acknowledged snapshot either restores exact or is
legitimately gone (restore raises SnapshotUnavailableError / NotFoundError, never wrong bytes, and
the number gone stays within the evictions + supersedes counters).

CI: 200 kills (``SNAPSTORE_CRASH_KILLS`` overrides; ``SNAPSTORE_LONG=1`` runs 2000).
Run alone: ``python tests/reliability/test_crash.py [KILLS]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import snapstore as ss

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
HERE = TESTS_DIR
sys.path.insert(0, HERE)
import helpers_proc as hp  # noqa: E402

HELPER = os.path.join(HERE, "helpers_proc.py")
POINTS = ["fsync", "write", "link", "unlink", "txn", "dbwrite"]


def default_kills() -> int:
    if os.environ.get("SNAPSTORE_CRASH_KILLS"):
        return int(os.environ["SNAPSTORE_CRASH_KILLS"])
    return 2000 if os.environ.get("SNAPSTORE_LONG") else 200


def _spawn(path: str, seed: int, spec: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["SNAPSTORE_TEST_CRASH_AT"] = spec
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(HERE), env.get("PYTHONPATH", "")] if p)
    return subprocess.Popen([sys.executable, HELPER, "crash", path, str(seed)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)


def check_after_crash(path: str, acked: dict[int, tuple[int, int]], gone: set[int]) -> dict[str, int]:
    """Reopen the store and check everything the module docstring promises. Returns small counts."""
    st = hp.open_store(path)
    try:
        rep = st.verify(deep=True)
        assert rep.ok, f"verify after crash: {rep.problems[:5]} {rep.sqlite_errors[:3]}"
        infos = {i.snapshot_id: i for i in st.snapshots()}
        assert not any(i.pending for i in infos.values()), "a pending capture of a dead process is visible"
        restored = 0
        for sid, info in infos.items():
            kn = hp.identify(hp.snapshot_tokens(st, sid))
            assert kn is not None and kn[1] == info.n_tokens, f"snapshot {sid} has tokens of no save"
            if info.matchable:
                hp.check_restore(st, sid, *kn)
                restored += 1
        for sid, (k, n) in acked.items():
            info = infos.get(sid)
            if info is not None and info.matchable:
                assert hp.identify(hp.snapshot_tokens(st, sid)) == (k, n)
                continue
            gone.add(sid)
            want = hp.expected_state(k, n)
            into = {name: np.zeros_like(v) for name, v in want.items()}
            with pytest.raises((ss.SnapshotUnavailableError, ss.NotFoundError)) as ei:
                st.restore(sid, into=into)
            if isinstance(ei.value, ss.RestoreError):
                assert not ei.value.touched
        s = st.stats()
        assert len(gone) <= s.evictions + s.supersedes, (len(gone), s.evictions, s.supersedes)
        assert s.stored_bytes <= hp.DISK
        for k in range(hp.N_CONV):
            m = st.match(hp.conv_tokens(k))
            if m is not None:
                hp.check_restore(st, m, k, m.n_tokens)
        return {"visible": len(infos), "restored": restored, "orphans": len(rep.orphan_files),
                "temps": len(rep.temp_files)}
    finally:
        st.close()


def run_campaign(path: str, kills: int, seed: int = 1) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    acked: dict[int, tuple[int, int]] = {}
    gone: set[int] = set()
    fig: dict[str, Any] = {"kills": 0, "random_kills": 0, "injected_kills": 0, "injected_by_point": {},
                           "acked": 0, "acked_gone_legitimately": 0, "leftover_orphans": 0, "leftover_temps": 0,
                           "max_visible": 0}
    t0 = time.monotonic()
    hp.open_store(path).close()
    for i in range(kills):
        spec = ""
        if rng.random() < 0.5:
            point = POINTS[int(rng.integers(len(POINTS)))]
            spec = f"{point}:{int(rng.integers(1, 40))}:{'before' if rng.random() < 0.5 else 'after'}"
        p = _spawn(path, int(rng.integers(1 << 30)), spec)
        assert p.stdout is not None
        ready = p.stdout.readline()
        if not spec:
            if ready == b"R\n":
                time.sleep(float(rng.uniform(0.0, 0.4)))
            p.send_signal(signal.SIGKILL)
        fired = False
        if spec:
            try:
                p.wait(timeout=float(rng.uniform(0.3, 1.0)))  # the crash point fires, or a random kill
                fired = True
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL, f"child exited {p.returncode} (spec {spec!r}):\n{err.decode()[-3000:]}"
        for line in (ready + out).decode().splitlines():
            if line.startswith("A "):
                _, sid, k, n = line.split()
                acked[int(sid)] = (int(k), int(n))
        fig["kills"] += 1
        if fired:
            fig["injected_kills"] += 1
            name = spec.split(":")[0]
            fig["injected_by_point"][name] = fig["injected_by_point"].get(name, 0) + 1
        else:
            fig["random_kills"] += 1
        counts = check_after_crash(path, acked, gone)
        fig["max_visible"] = max(fig["max_visible"], counts["visible"])
        fig["leftover_orphans"] += counts["orphans"]
        fig["leftover_temps"] += counts["temps"]
    st = hp.open_store(path)
    try:
        st.gc(grace=0)
        rep = st.verify(deep=True)
        assert rep.ok and not rep.orphan_files and not rep.temp_files and not rep.dead_pending
        fig["final_snapshots"] = len(st.snapshots())
    finally:
        st.close()
    fig["acked"] = len(acked)
    fig["acked_gone_legitimately"] = len(gone)
    fig["seconds"] = round(time.monotonic() - t0, 1)
    return fig


def _inject_fired_count(spec_fired: dict[str, int]) -> int:
    return sum(spec_fired.values())


def test_crash_campaign(tmp_path: Any) -> None:
    kills = default_kills()
    fig = run_campaign(str(tmp_path / "store"), kills, seed=int(os.environ.get("SNAPSTORE_CRASH_SEED", "1")))
    print("crash campaign:", json.dumps(fig))
    assert fig["kills"] == kills >= 1
    assert fig["acked"] > 0
    assert _inject_fired_count(fig["injected_by_point"]) > 0


def test_kill_before_commit_leaves_nothing_visible(tmp_path: Any) -> None:
    """A save killed inside its metadata transaction is invisible, its chunk files are orphans gc removes."""
    path = str(tmp_path / "store")
    hp.open_store(path).close()
    # txn #1 is the child's identity at open, #2 its housekeeping; the 3rd is the first save's catalog insert
    p = _spawn(path, 5, "txn:3:after")
    out, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, err.decode()
    st = hp.open_store(path)
    try:
        rep = st.verify(deep=True)
        assert rep.ok
        assert st.snapshots() == [] or all(not i.pending for i in st.snapshots())
        st.gc(grace=0)
        rep = st.verify(deep=True)
        assert not rep.orphan_files and not rep.temp_files
    finally:
        st.close()


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        n = int(sys.argv[1]) if len(sys.argv) > 1 else default_kills()
        print(json.dumps(run_campaign(os.path.join(d, "store"), n), indent=1))
