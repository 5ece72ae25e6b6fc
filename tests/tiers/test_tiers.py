"""One tier interface (issue 51): every place a store's bytes live answers :mod:`snapstore.tiers.interface`
— the RAM tier and the chunk files as a ``Tier``, the S3 tier or the null one as a ``SharedTier`` —
and a Store holds them as one ``Tiers``: its restore reads through them, nearest first, and checks
every chunk it reads from a file. Real store directories, real SQLite, real files."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support import store_factory

import snapstore as ss
from snapstore.catalog.rows import ChunkRow
from snapstore.chunks.chunkfile import HEADER_SIZE
from snapstore.remote.tier import RemoteTier
from snapstore.remote.uploader import FlushResult
from snapstore.tiers.interface import NO_SHARED_TIER, SharedTier, Tier
from snapstore.tiers.stack import Tiers

MIB = 1 << 20
LAYOUT = ss.Layout(fixed={"run": ss.Fixed("uint8", (MIB,))}, rows={"kv": ss.Rows("uint8", (16 * 1024,))})
_open = store_factory(layout=LAYOUT, chunk_bytes=MIB, staging_bytes=4 * MIB, check_rows=None,
                      budget=ss.Budget(reserve_bytes=0, ram_bytes=64 * MIB))
SHARED = ("has", "lookup", "restore", "localize", "saved", "nbytes", "uploads", "flush", "close")


def _state(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"run": rng.integers(0, 256, MIB, dtype=np.uint8),
            "kv": rng.integers(0, 256, (n, 16 * 1024), dtype=np.uint8)}


def _chunk_rows(s: ss.Store) -> list[ChunkRow]:
    """Every chunk row of the store's catalog."""
    rows: list[ChunkRow] = s._repo.db.read(lambda c: list(c.all_chunks()))
    assert rows
    return rows


def test_each_tier_answers_the_interface(store_dir: str) -> None:
    with _open(store_dir) as s:
        tiers = s._tiers
        assert isinstance(tiers, Tiers)
        assert [t.name for t in tiers.local] == ["ram", "disk"]
        assert all(isinstance(t, Tier) for t in tiers.local)
        assert s._ram is tiers.ram  # the RAM tier as tests and benchmarks reach it
        # no remote=: the null shared tier, asked like the S3 one
        assert tiers.shared is NO_SHARED_TIER and isinstance(tiers.shared, SharedTier) and not tiers.shared.present
    assert RemoteTier.present and all(callable(getattr(RemoteTier, name)) for name in SHARED)
    with _open(store_dir, budget=ss.Budget(reserve_bytes=0, ram_bytes=0)) as s:
        assert s._tiers.ram is None and s._ram is None and [t.name for t in s._tiers.local] == ["disk"]


def test_restore_reads_through_the_tiers_nearest_first_and_checks_every_file_chunk(store_dir: str) -> None:
    state = _state(192)  # 1 MiB fixed + 3 MiB of rows: 4 chunks of 1 MiB
    tokens = list(range(192))
    with _open(store_dir) as s:
        ram, files = s._tiers.ram, s._tiers.files
        assert ram is not None
        r = s.save(tokens, state)
        dest = {k: np.zeros_like(v) for k, v in state.items()}
        s.restore(r, dest)
        s.restore(r, dest)  # the second restore admits each chunk, read again through the file tier
        assert ram.drain(30)
        rows = _chunk_rows(s)
        assert ram.measure() == sum(c.raw_len for c in rows) == 4 * MIB
        assert files.measure() == sum(c.stored_len for c in rows)
        for c in rows:
            a, b = np.empty(c.raw_len, np.uint8), np.ones(c.raw_len, np.uint8)
            assert ram.has(c.id) and files.has(c.id)
            assert files.read_into(c, a.data) and ram.read_into(c, b.data) and np.array_equal(a, b)
        # damage every chunk file in place (its size and header kept): the file tier no longer holds those bytes
        for _, path in s._repo.blob_files():
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, b"\xff\x00\xff\x00", HEADER_SIZE + 100)
            finally:
                os.close(fd)
        buf = np.empty(MIB, np.uint8)
        assert not any(files.read_into(c, buf.data) for c in rows)
        # the RAM tier is read first: the restore is exact without touching the damaged files
        for v in dest.values():
            v[...] = 0
        s.restore(r, dest)
        assert all(np.array_equal(dest[k], state[k]) for k in state)
        # forgotten there, the chunks come from the files, each checked: the restore refuses them
        assert ram.delete([c.id for c in rows]) == 4 * MIB and ram.measure() == 0 and not ram.has(rows[0].id)
        with pytest.raises(ss.CorruptChunkError):
            s.restore(r, dest)


def test_a_store_without_remote_asks_the_null_shared_tier(store_dir: str) -> None:
    state = _state(64)
    tokens = list(range(64))
    with _open(store_dir) as s:
        r = s.save(tokens, state)  # saved(): nothing to upload
        m = s.match(tokens + [1, 2])  # lookup(): nothing longer than the local match
        assert m is not None and m.snapshot_id == r.snapshot_id and not NO_SHARED_TIER.has(m)
        assert s.restore_many([(m, {k: np.zeros_like(v) for k, v in state.items()})])[0].n_tokens == 64
        assert s.flush() == FlushResult() and NO_SHARED_TIER.uploads() == {}  # flush(): nothing queued
        assert NO_SHARED_TIER.localize([(m, {})], s, set(), 0) == [(m, {})]
        with pytest.raises(ss.SnapshotUnavailableError):
            NO_SHARED_TIER.restore(m, {}, LAYOUT, set(), 0, lambda c, f: True, lambda n: True, lambda c: 0)
    assert s._tiers.shared is NO_SHARED_TIER
