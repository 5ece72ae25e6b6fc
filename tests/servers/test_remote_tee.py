"""The default shared-tier restore (tee), restore_many of shared-tier matches, and the prefix index of
fetched chains, against a real SeaweedFS on loopback.

The tee fills the destination from checked bytes held in memory and returns before the local copy
is written; the import follows in the background (``flush()`` waits), after which the prompt is
local. A node killed mid-import leaves only orphans gc removes. ``restore_many`` fetches
shared-tier matches into the local tier first (or says clearly that one cannot fit). A chain
fetched from the bucket gets its block-granular prefix index, so a shorter prompt sharing some
of its blocks matches locally.
"""
# ruff: noqa: F811 - the fixtures `bucket` and `seaweed` come from s3_fixtures by import

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from remote_helpers import LAYOUT, identity, state
from s3_fixtures import bucket, seaweed  # noqa: F401 - the fixtures

import snapstore
from snapstore.remote.maint import verify_remote
from snapstore.remote.s3client import S3Client

LENGTHS = [600, 1300, 2100]  # 256-byte rows: a 537,600-byte chain of three links
TINY = snapstore.Budget(disk_bytes=100_000, ram_bytes=0, reserve_bytes=0)  # smaller than the chain
HERE = Path(__file__).resolve().parents[1]


def _publish(url: str, root: Path, seed: int, lengths: list[int] = LENGTHS) -> None:
    """Node A: save the chain and upload it."""
    tokens, kv, st = state(seed, lengths[-1])
    with snapstore.Store.open(root, identity=identity(), layout=LAYOUT, remote=url, chunk_bytes=65536,
                              staging_bytes=4 * 65536) as a:
        for n in lengths:
            a.save(tokens[:n], {"st": st + n, "kv": kv}, rows=n)
        assert a.flush().uploaded == len(lengths)


def _dest(n: int = LENGTHS[-1]) -> dict[str, np.ndarray]:
    return {"st": np.full((8, 8), 5.0, np.float32), "kv": np.full((n, 2, 64), 5.0, np.float16)}


def _files(root: Path) -> list[str]:
    return [f for _d, _s, fs in os.walk(root / "blobs") for f in fs] if (root / "blobs").exists() else []


def test_default_restore_returns_before_the_import_then_the_prompt_is_local(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _publish(bucket, tmp_path / "a", 31)
    tokens, kv, st = state(31, LENGTHS[-1])
    monkeypatch.setenv("SNAPSTORE_TEST_REMOTE_PAUSE", "import:3")  # hold the background import back
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        assert type(m).__name__ == "RemoteMatch"
        dest = _dest()
        res = b.restore(m, dest)  # type: ignore[arg-type]
        # the destination is filled, byte-exact, while nothing is in the local tier yet
        assert np.array_equal(dest["kv"], kv) and np.array_equal(dest["st"], st + LENGTHS[-1])
        assert res.n_tokens == LENGTHS[-1] and res.rows == {"kv": LENGTHS[-1]}
        assert b.snapshots() == [] and _files(tmp_path / "b") == []
        assert b.flush().ok  # waits for the import
        assert [s.n_tokens for s in b.snapshots()] == LENGTHS
        again = b.match(tokens)
        assert type(again).__name__ == "Match" and again is not None and again.n_tokens == LENGTHS[-1]
        dest = _dest()
        b.restore(again, dest)
        assert np.array_equal(dest["kv"], kv) and np.array_equal(dest["st"], st + LENGTHS[-1])
        remote = b.stats().remote
        assert remote["tee_restores"] == 1 and remote["tee_imports"] == 1
        # the import read nothing from the bucket again: the restore's checked bytes were written
        chain = m.remote.chain  # type: ignore[union-attr]
        assert remote["fetched_bytes"] == sum({ch.id: ch.stored_len for mf in chain for p in mf.parts
                                               for ch in p.chunks}.values())
    assert verify_remote(S3Client(bucket), deep=True).ok


def test_tee_over_its_memory_bound_imports_what_it_could_not_hold_from_the_bucket(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _publish(bucket, tmp_path / "a", 32)
    tokens, kv, st = state(32, LENGTHS[-1])
    monkeypatch.setenv("SNAPSTORE_REMOTE_TEE_MIB", "0")  # nothing may be held for the import
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        dest = _dest()
        b.restore(m, dest)  # type: ignore[arg-type]
        assert np.array_equal(dest["kv"], kv) and np.array_equal(dest["st"], st + LENGTHS[-1])
        assert b.flush().ok
        assert len(b.snapshots()) == 3 and type(b.match(tokens)).__name__ == "Match"
        chain = m.remote.chain  # type: ignore[union-attr]
        chain_bytes = sum({ch.id: ch.stored_len for mf in chain for p in mf.parts for ch in p.chunks}.values())
        remote = b.stats().remote
        assert remote["tee_restores"] == 1 and remote["fetched_bytes"] == 2 * chain_bytes  # read twice
        assert b.verify().ok


def test_default_restore_never_writes_an_unchecked_byte_and_imports_nothing_after_a_corrupt_chunk(
        bucket: str, tmp_path: Path) -> None:
    _publish(bucket, tmp_path / "a", 38)
    tokens, kv, st = state(38, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        chain = m.remote.chain  # type: ignore[union-attr]
        last = [ch for p in chain[-1].parts if p.name == "kv" for ch in p.chunks][-1]  # the last rows restored
        client = S3Client(bucket)
        key = next(i.key for i in client.list("snapstore-v1/c/")
                   if i.key.endswith(last.id.hex()))
        data = bytearray(client.get(key, 1 << 30) or b"")
        data[-1] ^= 0x40  # its last byte: every earlier piece of it passes until the checksum at the end
        client.put(key, bytes(data))
        dest = _dest()
        with pytest.raises(snapstore.CorruptChunkError) as e:
            b.restore(m, dest)  # type: ignore[arg-type]
        assert e.value.touched is True and "partly written" in str(e.value)
        # what was written is right; the corrupt chunk's rows never reached the destination
        rows = last.raw_len // 256
        good = np.all((dest["kv"] == kv).reshape(LENGTHS[-1], -1), axis=1)
        assert good[:LENGTHS[-1] - rows].any() and not good[LENGTHS[-1] - rows:].any()
        assert ((dest["kv"] == kv) | (dest["kv"] == 5.0)).all()
        assert b.flush().ok and b.snapshots() == [] and _files(tmp_path / "b") == []  # nothing imported
        assert b.stats().remote["corrupt_chunks"] == 1


_KILLED_NODE = """
import json, sys
sys.path.insert(0, {here!r})
import numpy as np, snapstore
from remote_helpers import LAYOUT, identity, state
tokens, kv, st = state({seed}, {n})
b = snapstore.Store.open({root!r}, identity=identity(), layout=LAYOUT, remote={url!r})
m = b.match(tokens)
dest = {{"st": np.zeros((8, 8), np.float32), "kv": np.zeros(({n}, 2, 64), np.float16)}}
b.restore(m, dest)
ok = bool(np.array_equal(dest["kv"], kv) and np.array_equal(dest["st"], st + {n}))
print(json.dumps({{"restored": ok}}), flush=True)
b.flush()  # the import is paused before its transaction: killed there
"""


def test_node_killed_mid_import_leaves_only_orphans_gc_removes(bucket: str, tmp_path: Path) -> None:
    _publish(bucket, tmp_path / "a", 33)
    tokens, kv, st = state(33, LENGTHS[-1])
    root = tmp_path / "b"
    code = _KILLED_NODE.format(here=str(HERE), seed=33, n=LENGTHS[-1], root=str(root), url=bucket)
    env = dict(os.environ, SNAPSTORE_TEST_REMOTE_PAUSE="import_commit:60")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert json.loads(line) == {"restored": True}, p.stderr.read() if p.stderr else line
        want = sum(1 for _ in S3Client(bucket).list("snapstore-v1/c/"))
        deadline = time.monotonic() + 60
        while len(_files(root)) < want and time.monotonic() < deadline:  # every chunk file written
            time.sleep(0.05)
        assert len(_files(root)) == want
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait(30)
    with snapstore.Store.open(root, identity=identity(), layout=LAYOUT, remote=bucket) as b:
        assert b.snapshots() == []  # nothing half-imported is visible
        rep = b.gc(grace=0)
        assert len(rep.orphan_files) == want and _files(root) == []
        assert b.verify().ok
        m = b.match(tokens)  # and the prompt is served again, from the bucket
        dest = _dest()
        b.restore(m, dest)  # type: ignore[arg-type]
        assert np.array_equal(dest["kv"], kv) and np.array_equal(dest["st"], st + LENGTHS[-1])


def test_restore_many_takes_shared_tier_matches(bucket: str, tmp_path: Path) -> None:
    _publish(bucket, tmp_path / "a", 34)
    tokens, kv, st = state(34, LENGTHS[-1])
    mine, my_kv, my_st = state(35, 700)
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket,
                              chunk_bytes=65536) as b:
        b.save(mine, {"st": my_st, "kv": my_kv}, rows=700)
        b.flush()
        far, near = b.match(tokens), b.match(mine)
        assert type(far).__name__ == "RemoteMatch" and type(near).__name__ == "Match"
        d1, d2 = _dest(), _dest(700)
        out = b.restore_many([(far, d1), (near, d2)])
        assert [r.n_tokens for r in out] == [LENGTHS[-1], 700]
        assert np.array_equal(d1["kv"], kv) and np.array_equal(d1["st"], st + LENGTHS[-1])
        assert np.array_equal(d2["kv"], my_kv) and np.array_equal(d2["st"], my_st)
        assert type(b.match(tokens)).__name__ == "Match"  # fetched into the local tier


def test_restore_many_says_clearly_when_a_shared_tier_match_cannot_fit(bucket: str, tmp_path: Path) -> None:
    _publish(bucket, tmp_path / "a", 36)
    tokens, kv, _st = state(36, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket,
                              budget=TINY) as b:
        m = b.match(tokens)
        dest = _dest()
        with pytest.raises(snapstore.SnapshotUnavailableError, match="restore_many.*restore\\(\\) it alone") as e:
            b.restore_many([(m, dest)])
        assert e.value.touched is False and (dest["kv"] == 5.0).all() and (dest["st"] == 5.0).all()
        assert b.snapshots() == []
        b.restore(m, dest)  # type: ignore[arg-type] # what the message advises: it streams
        assert np.array_equal(dest["kv"], kv)


G = 16  # tokens per row
BLOCKS = snapstore.Layout(rows={"kv": snapstore.Rows("float16", (2, G, 8))}, tokens_per_row=G)


def test_a_fetched_chain_matches_block_granularly_below_its_end(bucket: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(37)
    prompt = rng.integers(0, 50_000, 9 * G)
    rows = rng.standard_normal((9, 2, G, 8)).astype(np.float16)
    with snapstore.Store.open(tmp_path / "a", identity=identity(), layout=BLOCKS, remote=bucket,
                              chunk_bytes=4096) as a:
        a.save(prompt, {"kv": rows})
        assert a.flush().uploaded == 1
    for mode in ("fetch", "tee"):
        monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", mode)
        with snapstore.Store.open(tmp_path / f"b-{mode}", identity=identity(), layout=BLOCKS,
                                  remote=bucket) as b:
            m = b.match(prompt)
            assert type(m).__name__ == "RemoteMatch"
            b.restore(m, {"kv": np.zeros_like(rows)})  # type: ignore[arg-type]
            b.flush()
            # a shorter prompt sharing only 5 of its blocks: a block-granular match, in the local tier
            shorter = np.concatenate([prompt[:5 * G + 3], rng.integers(50_000, 60_000, 40)])
            p = b.match(shorter)
            assert p is not None and type(p).__name__ == "Match" and p.n_tokens == 5 * G, (mode, p)
            dest = {"kv": np.full((9, 2, G, 8), -1.0, np.float16)}
            out = b.restore(p, dest)
            assert out.rows == {"kv": 5}
            assert np.array_equal(dest["kv"][:5], rows[:5]) and (dest["kv"][5:] == -1.0).all()
