"""The maintenance scan of the shared tier reads manifests through a bounded pool (issue 52: gc's
one-at-a-time manifest GETs were the first thing to break at 100 nodes), against a real SeaweedFS."""
# ruff: noqa: F811 - the fixtures `bucket` and `seaweed` come from s3_fixtures by import

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from remote_helpers import LAYOUT, identity, state
from s3_fixtures import bucket, seaweed  # noqa: F401 - the fixtures

import snapstore
from snapstore.remote.keys import LAYOUT as KEYS
from snapstore.remote.maint import gc_remote, verify_remote
from snapstore.remote.s3client import S3Client

N = 24  # snapshots seeded: enough to keep a pool of 8 busy


def seed(url: str, where: Path) -> None:
    """N one-link chains (distinct prompts) published to the bucket by one node."""
    store = snapstore.Store.open(where, identity=identity(), layout=LAYOUT, remote=url, remote_wait=False,
                                 chunk_bytes=65536, staging_bytes=65536 * 4)
    try:
        for i in range(N):
            tokens, kv, st = state(100 + i, 300)
            store.save(tokens, {"st": st, "kv": kv}, rows=300)
        f = store.flush()
        assert f.failed == 0 and f.uploaded == N, f
    finally:
        store.close()


class Watched(S3Client):
    """The real client; counts manifest GETs in flight at once (each held 20 ms so overlap shows)."""

    def __init__(self, url: str, fail_at: int | None = None):
        super().__init__(url)
        self.lock = threading.Lock()
        self.now = self.most = self.seen = 0
        self.fail_at = fail_at

    def get(self, key: str, limit: int) -> bytes | None:
        if f"{KEYS}/m/" not in key:
            return super().get(key, limit)
        with self.lock:
            self.now += 1
            self.seen += 1
            self.most = max(self.most, self.now)
            n = self.seen
        try:
            time.sleep(0.02)
            if n == self.fail_at:
                raise snapstore.RemoteError(5, f"{self.url}: GET {key} failed: injected")
            return super().get(key, limit)
        finally:
            with self.lock:
                self.now -= 1


def test_scan_reads_manifests_at_once_and_finds_the_same(bucket: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    seed(bucket, tmp_path / "a")
    # damage one chain: one of its chunks goes, so verify must name it and gc must remove it
    plain = S3Client(bucket)
    victim = next(iter(plain.list(f"{KEYS}/c/"))).key
    plain.delete([victim])
    time.sleep(1.5)  # older than gc's least age at grace 0 (twice the 0.2 s window + LastModified's second)
    monkeypatch.setenv("SNAPSTORE_REMOTE_SCAN_WIDTH", "1")
    one = Watched(bucket)
    v1 = verify_remote(one).to_dict()
    g1 = gc_remote(one, grace=0.0, lease_ttl=0.0, dry_run=True).to_dict()
    assert one.most == 1
    monkeypatch.setenv("SNAPSTORE_REMOTE_SCAN_WIDTH", "8")
    many = Watched(bucket)
    v8 = verify_remote(many).to_dict()
    g8 = gc_remote(many, grace=0.0, lease_ttl=0.0, dry_run=True).to_dict()
    assert many.most > 1, "the scan read its manifests one at a time"
    assert many.most <= 8
    assert v8 == v1 and g8 == g1  # the same findings, whatever the width
    assert v8["manifests"] == N and len(v8["damaged_manifests"]) >= 1 and not v8["ok"]
    assert g8["broken_manifests"] and len(g8["broken_manifests"]) == len(v8["damaged_manifests"])
    done = gc_remote(many, grace=0.0, lease_ttl=0.0)
    assert sorted(done.broken_manifests) == sorted(g8["broken_manifests"])
    after = verify_remote(S3Client(bucket))
    assert after.ok and after.manifests == N - len(done.broken_manifests)


def test_a_failed_read_mid_scan_deletes_nothing(bucket: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    seed(bucket, tmp_path / "a")
    plain = S3Client(bucket)
    plain.delete([next(iter(plain.list(f"{KEYS}/c/"))).key])  # something gc would remove
    before = sorted(i.key for i in plain.list(f"{KEYS}/"))
    monkeypatch.setenv("SNAPSTORE_REMOTE_SCAN_WIDTH", "8")
    time.sleep(1.5)
    with pytest.raises(snapstore.RemoteError, match="injected"):
        gc_remote(Watched(bucket, fail_at=N // 2), grace=0.0, lease_ttl=0.0)
    assert sorted(i.key for i in plain.list(f"{KEYS}/")) == before
