"""Faults around shared-tier restores (tee, fetch, restore_many) that a review found, against a real SeaweedFS.

A chunk read only for the background import must not fail a restore whose destination is filled;
a chain this layout cannot read is refused before it is imported; rows_from past the rows is bad
input as locally; a flush that times out on imports still reports its uploads; a batch never
evicts the chains it fetched for itself; a served chain is marked used even if its import failed.
"""
# ruff: noqa: F811 - the fixtures `bucket` and `seaweed` come from s3_fixtures by import

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from remote_helpers import LAYOUT, identity, state
from s3_fixtures import bucket, seaweed  # noqa: F401 - the fixtures

import snapstore
from snapstore.remote.keys import use_key
from snapstore.remote.s3client import S3Client

pytestmark = pytest.mark.slow  # starts a SeaweedFS cluster

LENGTHS = [600, 1300, 2100]  # 256-byte rows, 256 rows a chunk: link 0's first chunk holds rows [0, 256)


def _publish(url: str, root: Path, seed: int) -> None:
    tokens, kv, st = state(seed, LENGTHS[-1])
    with snapstore.Store.open(root, identity=identity(), layout=LAYOUT, remote=url, chunk_bytes=65536,
                              staging_bytes=4 * 65536) as a:
        for n in LENGTHS:
            a.save(tokens[:n], {"st": st + n, "kv": kv}, rows=n)
        assert a.flush().uploaded == len(LENGTHS)


def test_tee_restore_is_not_failed_by_a_chunk_it_does_not_write(bucket: str, tmp_path: Path) -> None:
    _publish(bucket, tmp_path / "a", 41)
    tokens, kv, st = state(41, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        assert type(m).__name__ == "RemoteMatch"
        first = m.remote.chain[0]  # type: ignore[union-attr]
        below = next(p for p in first.parts if p.name == "kv").chunks[0]  # rows [0, 256): below rows_from
        client = S3Client(bucket)
        key = next(i.key for i in client.list("snapstore-v1/c/") if i.key.endswith(below.id.hex()))
        client.delete([key])  # lost from the bucket: only the import would need it
        dest = {"st": np.full((8, 8), 5.0, np.float32), "kv": np.full((LENGTHS[-1], 2, 64), 5.0, np.float16)}
        res = b.restore(m, dest, rows_from=1300)  # type: ignore[arg-type]
        assert res.rows == {"kv": LENGTHS[-1]}
        assert np.array_equal(dest["kv"][1300:], kv[1300:]) and np.all(dest["kv"][:1300] == 5.0)
        assert np.array_equal(dest["st"], st + LENGTHS[-1])
        assert b.flush().ok
        remote = b.stats().remote
        assert remote["tee_restores"] == 1 and remote["import_errors"] == 1  # the import failed alone
        assert b.snapshots() == []  # nothing half-imported


def _layout(g: int) -> snapstore.Layout:
    return snapstore.Layout(rows={"kv": snapstore.Rows("float16", (2, 64))}, tokens_per_row=g)


def test_a_chain_of_another_granularity_is_refused_before_it_is_imported(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fetch mode and restore_many import before the local plan is checked: a chain this store's
    layout can never read (saved at 16 tokens per row, read at 8) must not be written into the local
    tier (where it would take the budget, evicting usable leaves, and match every later request)."""
    n = 640
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, 50_000, n, dtype=np.int64)
    kv = rng.standard_normal((n // 16, 2, 64)).astype(np.float16)
    with snapstore.Store.open(tmp_path / "a", identity=identity(), layout=_layout(16), remote=bucket) as a:
        assert a.save(tokens, {"kv": kv}).ok
        assert a.flush().uploaded == 1
    for mode in ("fetch", "tee"):
        monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", mode)
        with snapstore.Store.open(tmp_path / f"b-{mode}", identity=identity(), layout=_layout(8),
                                  remote=bucket) as b:
            m = b.match(tokens)
            assert type(m).__name__ == "RemoteMatch"
            dest = {"kv": np.full((n // 8, 2, 64), 5.0, np.float16)}
            with pytest.raises(snapstore.DestinationError, match="tokens per row"):
                if mode == "fetch":
                    b.restore(m, dest)  # type: ignore[arg-type]
                else:
                    b.restore_many([(m, dest)])  # type: ignore[list-item]
            assert (dest["kv"] == 5.0).all()
            assert b.flush().ok
            assert b.snapshots() == [], mode  # nothing imported
            assert b.stats().remote.get("fetched_chunks", 0) == 0, mode


def test_a_shared_tier_restore_refuses_rows_from_past_its_rows_as_a_local_one_does(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rows_from counts rows the engine holds: past the snapshot's rows it is bad input (the local
    restore raises InvalidInputError); a shared-tier restore returned success having written nothing."""
    _publish(bucket, tmp_path / "a", 43)
    tokens, _kv, _st = state(43, LENGTHS[-1])
    for mode in ("tee", "fetch", "stream"):
        monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", mode)
        with snapstore.Store.open(tmp_path / f"b-{mode}", identity=identity(), layout=LAYOUT, remote=bucket) as b:
            m = b.match(tokens)
            assert type(m).__name__ == "RemoteMatch"
            dest = {"st": np.full((8, 8), 5.0, np.float32), "kv": np.full((LENGTHS[-1], 2, 64), 5.0, np.float16)}
            with pytest.raises(snapstore.InvalidInputError, match="rows_from"):
                b.restore(m, dest, rows_from=LENGTHS[-1] + 1)  # type: ignore[arg-type]
            assert (dest["kv"] == 5.0).all() and (dest["st"] == 5.0).all(), mode
            assert b.flush().ok
            assert b.snapshots() == [], mode


def test_a_flush_that_times_out_on_imports_still_reports_the_uploads_it_saw(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flush() counts the uploads since the previous flush once: a flush whose timeout runs out on the
    background imports of tee'd restores must report them (uploaded, failed, errors), not drop them."""
    _publish(bucket, tmp_path / "a", 44)
    tokens, _kv, _st = state(44, LENGTHS[-1])
    monkeypatch.setenv("SNAPSTORE_TEST_REMOTE_PAUSE", "import:3")  # the background import is slow
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        other, kv2, st2 = state(45, 300)
        assert b.save(other, {"st": st2, "kv": kv2}, rows=300).ok  # one upload queued
        m = b.match(tokens)
        assert type(m).__name__ == "RemoteMatch"
        dest = {"st": np.zeros((8, 8), np.float32), "kv": np.zeros((LENGTHS[-1], 2, 64), np.float16)}
        b.restore(m, dest)  # type: ignore[arg-type]
        first = b.flush(timeout=1.0)
        assert first.timed_out  # the import is still paused
        second = b.flush()
        assert second.ok
        assert first.uploaded + second.uploaded == 1  # the upload is reported by one of them


def test_restore_many_of_two_shared_chains_that_fit_only_one_at_a_time(bucket: str, tmp_path: Path) -> None:
    """Each chain fits the local budget alone, not both: fetching the second into the local tier must
    not evict the first the same batch just fetched (the batch then failed on a snapshot "gone")."""
    n = 1000  # 256,000 bytes of rows a chain
    seeds = (51, 52)
    with snapstore.Store.open(tmp_path / "a", identity=identity(), layout=LAYOUT, remote=bucket,
                              chunk_bytes=65536, staging_bytes=4 * 65536) as a:
        for seed in seeds:
            tokens, kv, st = state(seed, n)
            a.save(tokens, {"st": st, "kv": kv}, rows=n)
        assert a.flush().uploaded == 2
    budget = snapstore.Budget(disk_bytes=400_000, ram_bytes=0, reserve_bytes=0)
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket, budget=budget) as b:
        ms = [b.match(state(seed, n)[0]) for seed in seeds]
        assert all(type(m).__name__ == "RemoteMatch" for m in ms)
        dests = [{"st": np.full((8, 8), 5.0, np.float32), "kv": np.full((n, 2, 64), 5.0, np.float16)} for _ in ms]
        try:
            out = b.restore_many(list(zip(ms, dests)))  # type: ignore[arg-type]
        except snapstore.SnapshotUnavailableError as e:  # refused as one: clearly, with nothing written
            assert "restore() it alone" in str(e) or "together" in str(e), str(e)
            assert not e.touched and all((d["kv"] == 5.0).all() for d in dests)
        else:
            assert len(out) == 2
            for seed, d in zip(seeds, dests):
                _t, kv, st = state(seed, n)
                assert np.array_equal(d["kv"], kv) and np.array_equal(d["st"], st)


def test_a_tee_restore_marks_its_use_even_when_its_import_fails(bucket: str, tmp_path: Path) -> None:
    """The bucket's gc evicts the least recently used chains by their use markers: a chain a restore
    served is used whether or not this node's background import of it succeeded."""
    _publish(bucket, tmp_path / "a", 46)
    tokens, kv, _st = state(46, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        hit = m.remote  # type: ignore[union-attr]
        below = next(p for p in hit.chain[0].parts if p.name == "kv").chunks[0]
        client = S3Client(bucket)
        client.delete([next(i.key for i in client.list("snapstore-v1/c/") if i.key.endswith(below.id.hex()))])
        marker = use_key(hit.scope, hit.chain[-1].name)
        assert client.get(marker, 1 << 10) is None  # nothing marked it yet
        dest = {"st": np.zeros((8, 8), np.float32), "kv": np.zeros((LENGTHS[-1], 2, 64), np.float16)}
        b.restore(m, dest, rows_from=1300)  # type: ignore[arg-type]
        assert np.array_equal(dest["kv"][1300:], kv[1300:])
        assert b.flush().ok
        assert b.stats().remote["import_errors"] == 1
        assert client.get(marker, 1 << 10) is not None  # the served chain counts as used
