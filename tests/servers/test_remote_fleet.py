"""The shared tier against a real SeaweedFS on loopback: nodes in separate processes share one bucket."""
# ruff: noqa: F811 - the fixtures `bucket` and `seaweed` come from s3_fixtures by import

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from remote_helpers import LAYOUT, expected, identity, restore_in_background, state
from s3_fixtures import SeaweedCluster, bucket, seaweed  # noqa: F401 - the fixtures

import snapstore
from snapstore.remote.keys import LAYOUT as KEYS
from snapstore.remote.maint import gc_remote, verify_remote
from snapstore.remote.s3client import S3Client

NODE = str(Path(__file__).resolve().parents[1] / "remote_node.py")
LENGTHS = [600, 1300, 2100]  # a chain of three links (anchors in blocks 2, 5 and 8)


def node(op: dict[str, object], timeout: float = 120) -> dict[str, object]:
    """Run one node operation in its own process; its JSON answer."""
    p = subprocess.run([sys.executable, NODE, json.dumps(op)], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def keys(url: str, kind: str) -> list[str]:
    return [i.key for i in S3Client(url).list(f"{KEYS}/{kind}/")]


def test_two_nodes_share_a_chain(bucket: str, tmp_path: Path) -> None:
    a = node({"op": "save", "dir": str(tmp_path / "a"), "url": bucket, "seed": 1, "lengths": LENGTHS})
    assert a["failed"] == 0 and a["uploaded"] == 3, a
    assert len(keys(bucket, "m")) == 3
    b = node({"op": "restore", "dir": str(tmp_path / "b"), "url": bucket, "seed": 1, "n": LENGTHS[-1],
              "n_max": LENGTHS[-1]})
    kv, st = expected(1, LENGTHS[-1], LENGTHS[-1])
    # node B never saw the prompt: the whole chain came from the bucket, byte-exact, zero prefill
    assert b["match"] == LENGTHS[-1] and b["remote"] is True
    assert b["rows"] == {"kv": LENGTHS[-1]} and b["kv"] == kv and b["st"] == st
    assert b["local_after"] is True  # and it is now in B's local tier
    assert verify_remote(S3Client(bucket), deep=True).ok


def test_concurrent_savers_add_no_second_copy(bucket: str, tmp_path: Path) -> None:
    start = time.time() + 4.0  # both processes are up by then and save at the same moment
    procs = [subprocess.Popen([sys.executable, NODE, json.dumps(
        {"op": "save", "dir": str(tmp_path / f"n{i}"), "url": bucket, "seed": 2, "lengths": LENGTHS,
         "wait": True, "start_at": start})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    client = S3Client(bucket)
    chunks = list(client.list(f"{KEYS}/c/"))
    # the same prefix saved on two nodes at once: each chunk object once, each manifest once
    _t, kv, _st = state(2, LENGTHS[-1])
    distinct = -(-LENGTHS[-1] * 256 // 65536) + 3  # row chunks of the whole chain + one fixed part a link
    assert len(chunks) <= distinct + 3
    assert len(keys(bucket, "m")) == 3
    created = 0
    for i in range(2):
        st = snapstore.Store.open(tmp_path / f"n{i}", identity=identity(), layout=LAYOUT)
        created += st._repo.db.read(lambda c: c.counters()).get("remote_chunks_put", 0)
        st.close()
    assert created == len(chunks), (created, len(chunks))  # no chunk was written twice
    assert verify_remote(client, deep=True).ok


def test_namespaces_and_identities_stay_apart(bucket: str, tmp_path: Path) -> None:
    node({"op": "save", "dir": str(tmp_path / "a"), "url": bucket, "seed": 3, "lengths": LENGTHS[:1],
          "namespace": "tenant-a"})
    other_ns = node({"op": "restore", "dir": str(tmp_path / "b"), "url": bucket, "seed": 3, "n": LENGTHS[0],
                     "n_max": LENGTHS[0], "namespace": "tenant-b"})
    assert other_ns["match"] is None
    tokens, _kv, _st = state(3, LENGTHS[0])
    with snapstore.Store.open(tmp_path / "c", identity=identity("eng-remote-2"), layout=LAYOUT,
                              remote=bucket) as other_build:
        assert other_build.match(tokens, namespace="tenant-a") is None
    same = node({"op": "restore", "dir": str(tmp_path / "d"), "url": bucket, "seed": 3, "n": LENGTHS[0],
                 "n_max": LENGTHS[0], "namespace": "tenant-a"})
    assert same["match"] == LENGTHS[0]


def _save_chain(url: str, root: Path, seed: int, **kw: object) -> snapstore.Store:
    tokens, kv, st = state(seed, LENGTHS[-1])
    s = snapstore.Store.open(root, identity=identity(), layout=LAYOUT, remote=url, chunk_bytes=65536,
                             staging_bytes=4 * 65536, **kw)  # type: ignore[arg-type]
    for n in LENGTHS:
        s.save(tokens[:n], {"st": st + n, "kv": kv}, rows=n)
    return s


def _dest() -> dict[str, np.ndarray]:
    return {"st": np.full((8, 8), 5.0, np.float32), "kv": np.full((LENGTHS[-1], 2, 64), 5.0, np.float16)}


def test_corrupt_chunk_object_is_detected_never_served_and_counted(bucket: str, tmp_path: Path) -> None:
    a = _save_chain(bucket, tmp_path / "a", 4)
    assert a.flush().uploaded == 3
    a.close()
    client = S3Client(bucket)
    tokens, kv, st = state(4, LENGTHS[-1])
    b = snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket)
    m = b.match(tokens)
    assert m is not None and m.n_tokens == LENGTHS[-1]
    # the first chunk the restore reads (parts in layout order: the leaf's fixed part "st"), so it
    # is found before any byte is written (a corrupt chunk found later leaves the chunks before it
    # written, each checked: test_remote_tee.py)
    leaf = m.remote.chain[-1].parts  # type: ignore[attr-defined]
    cid_hex = next(p for p in leaf if p.name == "st").chunks[0].id.hex()
    victim = next(k for k in keys(bucket, "c") if k.endswith(cid_hex))
    data = bytearray(client.get(victim, 1 << 30) or b"")
    data[-1] ^= 0x40
    client.put(victim, bytes(data))  # bit rot in the bucket
    dest = _dest()
    with pytest.raises(snapstore.CorruptChunkError) as e:
        b.restore(m, dest)
    assert e.value.touched is False
    assert (dest["kv"] == 5.0).all() and (dest["st"] == 5.0).all()  # never served
    cid = bytes.fromhex(victim.rsplit("/", 1)[1])
    assert not os.path.exists(b._repo.blob_path(cid))  # and never published locally
    assert b.match(tokens) is not None and type(b.match(tokens)).__name__ == "RemoteMatch"  # nothing imported
    b.close()
    b = snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT)
    counters = b._repo.db.read(lambda c: c.counters())
    assert counters.get("remote_corrupt_chunks") == 1
    b.close()
    rep = verify_remote(client, deep=True)
    assert not rep.ok and len(rep.corrupt_chunks) == 1
    assert verify_remote(client, deep=False).ok  # right size: only a deep verify re-hashes


def test_corrupt_manifest_is_skipped_and_counted(bucket: str, tmp_path: Path) -> None:
    a = _save_chain(bucket, tmp_path / "a", 5)
    a.flush()
    a.close()
    client = S3Client(bucket)
    leaf = max(keys(bucket, "m"), key=lambda k: int(k.rsplit("/", 1)[1][:12]))
    doc = json.loads(client.get(leaf, 1 << 30) or b"")
    doc["body"]["n_tokens"] += 0  # same shape, tampered content below
    doc["body"]["writer"] = "someone-else"
    client.put(leaf, json.dumps(doc).encode())
    tokens, _kv, _st = state(5, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        assert m is not None and m.n_tokens == LENGTHS[1]  # the damaged leaf is skipped, its parent serves
    assert not verify_remote(client).ok


@pytest.mark.parametrize("mode", ["tee", "fetch"])
def test_volume_server_stopped_mid_restore(bucket: str, tmp_path: Path, seaweed: SeaweedCluster,  # noqa: F811
                                           monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", mode)  # tee: the default
    a = _save_chain(bucket, tmp_path / "a", 6)
    assert a.flush().uploaded == 3
    a.close()
    tokens, kv, st = state(6, LENGTHS[-1])
    monkeypatch.setenv("SNAPSTORE_TEST_REMOTE_PAUSE", "fetch:0.3")  # the restore is under way when it stops
    monkeypatch.setenv("SNAPSTORE_REMOTE_TIMEOUT_S", "3")
    b = snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket)
    m = b.match(tokens)
    assert m is not None
    dest = _dest()
    t, outcome = restore_in_background(b, m, dest)
    time.sleep(0.1)
    seaweed.stop_volume(1)
    try:
        t.join(120)
        assert outcome, "restore hung"
        res = outcome[0]
        if isinstance(res, snapstore.SnapstoreError):  # a clear error
            assert isinstance(res, snapstore.RestoreError), res
            if mode == "fetch" or not res.touched:  # fetch checks the whole chain before writing a byte
                assert res.touched is False, res
                assert (dest["kv"] == 5.0).all() and (dest["st"] == 5.0).all()
            else:  # tee: the chunks written before the failure, each checked: never a wrong byte
                assert "partly written" in str(res)
                assert ((dest["kv"] == kv) | (dest["kv"] == 5.0)).all()
                assert ((dest["st"] == st + LENGTHS[-1]) | (dest["st"] == 5.0)).all()
        else:  # or a success: then every byte is right
            want_kv, want_st = expected(6, LENGTHS[-1], LENGTHS[-1])
            import hashlib
            assert hashlib.sha256(dest["kv"].tobytes()).hexdigest() == want_kv
            assert hashlib.sha256(dest["st"].tobytes()).hexdigest() == want_st
    finally:
        b.close()
        seaweed.start_volume(1)
        seaweed.wait_volumes()
    # with the volume server back, the same node restores exactly
    monkeypatch.delenv("SNAPSTORE_TEST_REMOTE_PAUSE")
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        dest = _dest()
        b.restore(m, dest)
        assert np.array_equal(dest["kv"], kv) and np.array_equal(dest["st"], st + LENGTHS[-1])


def test_background_upload_is_off_the_save_path_and_wait_mode_waits(bucket: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPSTORE_TEST_REMOTE_PAUSE", "before_manifest:1.0")
    tokens, kv, st = state(7, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "a", identity=identity(), layout=LAYOUT, remote=bucket) as a:
        t = time.perf_counter()
        a.save(tokens[:LENGTHS[0]], {"st": st, "kv": kv}, rows=LENGTHS[0])
        assert time.perf_counter() - t < 0.8  # returned once the local copy was durable
        assert keys(bucket, "m") == []
        t = time.perf_counter()
        f = a.flush()
        assert f.uploaded == 1 and time.perf_counter() - t > 0.5
    with snapstore.Store.open(tmp_path / "w", identity=identity(), layout=LAYOUT, remote=bucket,
                              remote_wait=True) as w:
        t = time.perf_counter()
        w.save(tokens[:LENGTHS[1]], {"st": st, "kv": kv}, rows=LENGTHS[1])
        assert time.perf_counter() - t >= 1.0  # wait mode: the manifest is in the bucket on return
        assert len(keys(bucket, "m")) == 2


def test_unreachable_bucket_never_fails_the_local_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("SNAPSTORE_REMOTE_TIMEOUT_S", "1")
    tokens, kv, st = state(8, LENGTHS[0])
    with snapstore.Store.open(tmp_path / "a", identity=identity(), layout=LAYOUT, remote="s3://nowhere/x") as a:
        r = a.save(tokens, {"st": st, "kv": kv}, rows=LENGTHS[0])
        m = a.match(tokens)
        assert m is not None and m.snapshot_id == r.snapshot_id  # the local answer stands
        f = a.flush()
        assert f.failed == 1 and "nowhere" in f.errors[0]
        a.stats()  # persists the in-memory counters
        counters = a._repo.db.read(lambda c: c.counters())
        assert counters.get("remote_errors") == 1 and counters.get("remote_upload_errors") == 1


def test_gc_lease_and_fence_keep_chunks_a_live_upload_relies_on(bucket: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    client = S3Client(bucket)
    a = _save_chain(bucket, tmp_path / "a", 9)
    a.flush()
    a.close()
    for k in keys(bucket, "m"):  # the chunks are now old orphans (a node died before its manifests)
        client.delete([k])
    time.sleep(1.5)
    # (1) a live upload that relies on those orphans: gc during it keeps them for its lease
    monkeypatch.setenv("SNAPSTORE_TEST_REMOTE_PAUSE", "after_heads:2.0")
    c = _save_chain(bucket, tmp_path / "c", 9)
    time.sleep(0.7)
    leases = [json.loads(client.get(k, 1 << 20) or b"{}") for k in keys(bucket, "l")]
    leased = {cid for d in leases for cid in d.get("chunks", [])}
    assert leased
    g = gc_remote(client, grace=0)
    assert g.kept_for_leases == len(leased)  # orphans no upload relies on yet may go; these stay
    there = {k.rsplit("/", 1)[1] for k in keys(bucket, "c")}
    assert leased <= there
    c.flush()
    c.close()
    assert verify_remote(client, deep=True).ok
    # (2) a gc that listed the leases before the upload wrote its lease (lease_ttl=0 plays that): it
    # deletes the orphans; the uploader's fence finds them gone and puts them again before the manifest
    for k in keys(bucket, "m"):
        client.delete([k])
    time.sleep(1.5)
    d = _save_chain(bucket, tmp_path / "d", 9)
    time.sleep(0.7)
    g = gc_remote(client, grace=0, lease_ttl=0)
    assert g.chunks_removed > 0
    d.flush()
    counters = d._repo.db.read(lambda c: c.counters())
    d.close()
    rep = verify_remote(client, deep=True)
    assert rep.ok, rep.damaged_manifests
    assert snapstore.Store.open(tmp_path / "d", identity=identity(), layout=LAYOUT)._repo.db.read(
        lambda c: c.counters()).get("remote_fence_republished", 0) > 0 or counters


def test_gc_budget_evicts_least_recently_used_leaves(bucket: str, tmp_path: Path) -> None:
    client = S3Client(bucket)
    for seed in (10, 11):
        s = _save_chain(bucket, tmp_path / f"s{seed}", seed)
        s.flush()
        s.close()
    time.sleep(2.5)
    tokens, _kv, _st = state(10, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "r", identity=identity(), layout=LAYOUT, remote=bucket) as r:
        r.restore(r.match(tokens), _dest())  # seed 10's chain is used now: seed 11's is the LRU
    before = len(keys(bucket, "m"))
    g = gc_remote(client, grace=0, budget_bytes=1)  # over any budget: evicts leaves, LRU first
    assert len(g.evicted_manifests) == before  # every manifest eventually (parents once leaves)
    assert keys(bucket, "m") == [] and keys(bucket, "c") == []
    for seed in (12, 13):
        s = _save_chain(bucket, tmp_path / f"s{seed}", seed)
        s.flush()
        s.close()
    time.sleep(2.5)
    tokens, _kv, _st = state(12, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "r2", identity=identity(), layout=LAYOUT, remote=bucket) as r:
        r.restore(r.match(tokens), _dest())
    total = sum(i.size for i in client.list(f"{KEYS}/c/"))
    g = gc_remote(client, grace=0, budget_bytes=total - 1)
    # one leaf of seed 13's chain (the least recently used) goes; seed 12's chain and all parents stay
    assert len(g.evicted_manifests) == 1
    t13, _k, _s = state(13, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "r3", identity=identity(), layout=LAYOUT, remote=bucket) as r:
        assert r.match(tokens).n_tokens == LENGTHS[-1]
        assert r.match(t13).n_tokens == LENGTHS[1]
    assert verify_remote(client, deep=True).ok


@pytest.mark.slow
def test_kill_campaign_50_sigkills_mid_upload(bucket: str, tmp_path: Path) -> None:
    """SIGKILL a node at random points of its uploads, 50 times; another node's acknowledged saves survive."""
    import random
    client = S3Client(bucket)
    acked = node({"op": "save", "dir": str(tmp_path / "keeper"), "url": bucket, "seed": 100, "lengths": LENGTHS})
    assert acked["uploaded"] == 3
    rng = random.Random(16)
    total_acked = 0
    for i in range(int(os.environ.get("SNAPSTORE_TEST_KILLS", "50"))):
        p = subprocess.Popen([sys.executable, NODE, json.dumps(
            {"op": "loop", "dir": str(tmp_path / "victim"), "url": bucket, "seed": 1000 + 10 * i,
             "lengths": LENGTHS})], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert p.stdout is not None
        assert json.loads(p.stdout.readline())["ready"]
        time.sleep(rng.uniform(0.0, 0.6))
        p.kill()
        out, _ = p.communicate()
        total_acked += out.count("acked")
        rep = verify_remote(client)  # after every kill: no manifest references a missing chunk
        assert rep.ok, (i, rep.damaged_manifests, rep.missing_chunks)
    time.sleep(3.0)  # past the gc's minimum age (2 x window + LastModified's one-second resolution)
    g = gc_remote(client, grace=0, lease_ttl=0)  # the dead nodes' leases and orphans go
    rep = verify_remote(client, deep=True)
    assert rep.ok and rep.orphan_chunks == 0, (rep, g)
    assert keys(bucket, "l") == [] and total_acked > 0  # some victims got uploads acknowledged first
    b = node({"op": "restore", "dir": str(tmp_path / "b"), "url": bucket, "seed": 100, "n": LENGTHS[-1],
              "n_max": LENGTHS[-1]})
    kv, st = expected(100, LENGTHS[-1], LENGTHS[-1])
    assert b["match"] == LENGTHS[-1] and b["kv"] == kv and b["st"] == st  # acknowledged: never lost


def test_cli_remote_flags(bucket: str, tmp_path: Path) -> None:
    from snapstore.cli.main import main
    s = _save_chain(bucket, tmp_path / "a", 14)
    s.flush()
    s.close()
    env = dict(os.environ, SNAPSTORE_REMOTE=bucket)
    run = [sys.executable, "-m", "snapstore"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*run, *args], capture_output=True, text=True, env=env, timeout=120)

    p = cli("--dir", str(tmp_path / "a"), "stats", "--remote", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["remote"]["manifests"] == 3 and doc["counters"]["remote_uploads"] == 3
    assert doc["stats"]["entries"] == 3
    p = cli("--dir", str(tmp_path / "a"), "inspect", "--remote", bucket)
    assert p.returncode == 0 and "shared tier" in p.stdout and "2100 tokens" in p.stdout, p.stdout
    assert cli("verify", "--remote", "--deep").returncode == 0
    p = cli("gc", "--remote", "--dry-run", "--grace", "0", "--remote-budget-mib", "0", "--json")
    assert p.returncode == 0 and len(json.loads(p.stdout)["evicted_manifests"]) == 3
    assert len(keys(bucket, "m")) == 3  # a dry run changes nothing
    victim = sorted(keys(bucket, "c"))[0]
    S3Client(bucket).delete([victim])
    p = cli("verify", "--remote", "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["status"] == "damaged"
    assert main(["verify", "--remote", "s3://Bad_Bucket/x"]) == 2  # a usage error, not a traceback


def test_cli_remote_local_part_is_the_local_report(bucket: str, tmp_path: Path) -> None:
    """inspect --remote --json carries the local store's inspect report; stats --remote adds this node's counters."""
    from snapstore.check.inspect import inspect_store
    from snapstore.chunks.repo import SnapshotRepo
    from snapstore.cli.commands import inspect_doc
    d = str(tmp_path / "a")
    s = _save_chain(bucket, tmp_path / "a", 15)
    assert s.flush().uploaded == 3
    s.close()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "snapstore", "--dir", d, *args, "--remote", bucket],
                              capture_output=True, text=True, env=dict(os.environ), timeout=120)

    p = cli("inspect", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    repo = SnapshotRepo.open(d)
    try:
        report = repo.db.read(lambda c: inspect_store(c, d))
    finally:
        repo.close()
    assert doc["local"] == inspect_doc(report) and doc["dir"] == os.path.abspath(d)
    p = cli("stats")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == f"stats {os.path.abspath(d)}"
    assert "uploads=3" in lines[lines.index(f"shared tier {bucket}") - 1]  # the local counters, then the tier
