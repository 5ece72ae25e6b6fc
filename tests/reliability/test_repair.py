"""verify --repair beside a running engine drops only damage it re-confirmed under the write lock (issue 9, item 5).

The window is forced with real processes: verify's progress callback (called between chunk
checks, outside any transaction) runs an engine process that evicts the snapshot the scan is
looking at and saves the same bytes again, so the chunk row is back — healthy — before the
repair transaction starts. No mock: real SQLite, real files, a real second process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from snapstore.check.verify import verify
from snapstore.chunks.repo import Repo

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
HERE = TESTS_DIR
sys.path.insert(0, HERE)
import helpers_owner as ho  # noqa: E402
import helpers_proc as hp  # noqa: E402

ROOT = os.path.dirname(HERE)
N = 200


def _engine_resaves(path: str, codec: str) -> int:
    """Another process evicts everything and saves the same state again; returns its new snapshot id."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    r = subprocess.run([sys.executable, os.path.join(HERE, "helpers_owner.py"), "resave", path, str(N), codec],
                       capture_output=True, text=True, env=env, timeout=120, check=True)
    tag, sid = r.stdout.split()
    assert tag == "S" and sid != "None", r.stdout
    return int(sid)


def _restores_exactly(path: str, sid: int) -> None:
    want = ho.compressible_state(N)
    with hp.open_store(path, drop_stale=False) as s:
        m = s.match(hp.conv_tokens(0)[:N])
        assert m is not None and m.snapshot_id == sid
        into = {k: np.zeros_like(v) for k, v in want.items()}
        s.restore(m, into=into)
        for k, v in want.items():
            assert into[k].tobytes() == v.tobytes(), k


@pytest.mark.parametrize("repair", [False, True], ids=["verify", "repair"])
@pytest.mark.parametrize("deep", [False, True])
def test_repair_keeps_a_chunk_evicted_and_saved_again_during_the_scan(tmp_path: Any, deep: bool,
                                                                      repair: bool) -> None:
    """Listed raw, evicted, saved again compressed (another size) while verify scans: not damage —
    neither for repair (nothing removed) nor for a plain verify (no false alarm, exit 0)."""
    path = str(tmp_path / "store")
    with hp.open_store(path, codec="raw") as s:
        assert s.save(hp.conv_tokens(0)[:N], ho.compressible_state(N)).snapshot_id is not None
    resaved: list[int] = []

    def progress(done: int, total: int) -> None:
        if not resaved:  # after the listing, before the first chunk file is checked
            resaved.append(_engine_resaves(path, "zstd"))

    repo = Repo.open(path)
    try:
        rep = verify(repo, deep=deep, repair=repair, progress=progress)
    finally:
        repo.close()
    assert resaved
    assert rep.removed_snapshots == [] and rep.damaged_snapshots == [] and rep.ok, rep.problems
    _restores_exactly(path, resaved[0])
    repo = Repo.open(path)
    try:
        assert verify(repo, deep=True).ok
    finally:
        repo.close()


def test_repair_keeps_a_snapshot_that_healed_damage_after_the_scan(tmp_path: Any) -> None:
    """A chunk really damaged when scanned, then evicted and saved again correctly: the new snapshot stays."""
    path = str(tmp_path / "store")
    with hp.open_store(path, codec="raw") as s:
        assert s.save(hp.conv_tokens(0)[:N], ho.compressible_state(N)).snapshot_id is not None
        _cid, victim = next(iter(s._repo.blob_files()))
    with open(victim, "r+b") as f:  # bit rot in the payload
        f.seek(os.path.getsize(victim) - 1)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    resaved: list[int] = []

    def progress(done: int, total: int) -> None:
        if done == total and not resaved:  # every chunk checked, the damage found; repair not yet begun
            resaved.append(_engine_resaves(path, "raw"))

    repo = Repo.open(path)
    try:
        rep = verify(repo, deep=True, repair=True, progress=progress)
    finally:
        repo.close()
    assert resaved
    assert rep.removed_snapshots == [] and rep.damaged_chunks == [], rep.problems
    _restores_exactly(path, resaved[0])


def test_repair_still_removes_damage_that_is_still_there(tmp_path: Any) -> None:
    path = str(tmp_path / "store")
    with hp.open_store(path, codec="raw") as s:
        sid = s.save(hp.conv_tokens(0)[:N], ho.compressible_state(N)).snapshot_id
        _cid, victim = next(iter(s._repo.blob_files()))
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 1)
    repo = Repo.open(path)
    try:
        rep = verify(repo, deep=False, repair=True)
        assert rep.repaired and rep.removed_snapshots == [sid] and len(rep.damaged_chunks) == 1
        assert verify(repo, deep=True).ok
    finally:
        repo.close()
