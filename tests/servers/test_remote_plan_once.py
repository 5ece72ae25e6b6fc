"""Issue 51 item 4 on the shared tier: a restore from the bucket checks its plan once, against a real
SeaweedFS on loopback.

A tee'd or streamed restore checks the chain's plan from its manifests once (before: a tee checked it
two times, three with a callable ``into``; a stream with a callable twice) and binds that one checked
plan to the destinations — the callable's mapping included — each destination still checked before
a byte is written.
"""
# ruff: noqa: F811 - the fixtures `bucket` and `seaweed` come from s3_fixtures by import

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from remote_helpers import LAYOUT, identity, state
from s3_fixtures import bucket, seaweed  # noqa: F401 - the fixtures

import snapstore
from snapstore.plan import restore_plan
from snapstore.remote import bucket_restore

LENGTHS = [600, 1300, 2100]  # 256-byte rows: a three-link chain


def _publish(url: str, root: Path, seed: int) -> None:
    """Node A: save the three-link chain and upload it."""
    tokens, kv, st = state(seed, LENGTHS[-1])
    with snapstore.Store.open(root, identity=identity(), layout=LAYOUT, remote=url, chunk_bytes=65536) as a:
        for n in LENGTHS:
            a.save(tokens[:n], {"st": st + n, "kv": kv}, rows=n)
        assert a.flush().uploaded == 3


def _dest() -> dict[str, np.ndarray]:
    return {"st": np.full((8, 8), 5.0, np.float32), "kv": np.full((LENGTHS[-1], 2, 64), 5.0, np.float16)}


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the plan checks of shared-tier chains: ``check_plan`` wherever the remote restore reaches it
    (the plan module's own name, which ``build_plan`` calls, and the bucket restore's import of it)."""
    calls: list[int] = []
    real = restore_plan.check_plan

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(restore_plan, "check_plan", counted)
    if hasattr(bucket_restore, "check_plan"):
        monkeypatch.setattr(bucket_restore, "check_plan", counted)
    return calls


@pytest.mark.parametrize("mode", ["tee", "stream"])
def test_a_shared_tier_restore_checks_its_plan_once(bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    mode: str) -> None:
    _publish(bucket, tmp_path / "a", 31)
    tokens, kv, st = state(31, LENGTHS[-1])
    monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", mode)
    for i, callable_into in enumerate([False, True]):
        with snapstore.Store.open(tmp_path / f"b{i}", identity=identity(), layout=LAYOUT, remote=bucket) as b:
            m = b.match(tokens)
            assert m is not None and type(m).__name__ == "RemoteMatch"
            dest = _dest()
            seen: list[snapstore.MatchDetails] = []

            def allocate(d: snapstore.MatchDetails, dest: dict[str, np.ndarray] = dest) -> dict[str, np.ndarray]:
                seen.append(d)
                return dest

            with monkeypatch.context() as mp:
                checks = _count_checks(mp)
                res = b.restore(m, allocate if callable_into else dest)
            assert len(checks) == 1, (mode, callable_into)  # before: tee 2 (3 with a callable), stream 1 (2)
            assert np.array_equal(dest["kv"], kv) and np.array_equal(dest["st"], st + LENGTHS[-1])
            assert res.n_tokens == LENGTHS[-1] and res.rows == {"kv": LENGTHS[-1]}
            if callable_into:  # handed the checked plan's description
                assert len(seen) == 1 and seen[0].rows == {"kv": LENGTHS[-1]}
                assert seen[0].nbytes == kv.nbytes + st.nbytes
            b.flush()
            counter = "tee_restores" if mode == "tee" else "streamed_restores"
            assert b.stats().remote[counter] == 1


@pytest.mark.parametrize("mode", ["tee", "stream"])
def test_a_callable_into_from_the_bucket_is_still_checked_before_a_byte_is_written(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    _publish(bucket, tmp_path / "a", 32)
    tokens, _kv, _st = state(32, LENGTHS[-1])
    monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", mode)
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        assert m is not None
        short = {"st": np.full((8, 8), 7.0, np.float32), "kv": np.full((LENGTHS[-1] - 1, 2, 64), 7.0, np.float16)}
        with pytest.raises(snapstore.DestinationError) as e:
            b.restore(m, lambda d: short)  # one row short: refused by the bind, before any read
        assert not e.value.touched and all((v == 7.0).all() for v in short.values())
        with pytest.raises(snapstore.InvalidInputError, match="must return a mapping"):
            b.restore(m, lambda d: [1])
        assert b.snapshots() == [] and "fetched_bytes" not in b.stats().remote  # nothing read, nothing imported
