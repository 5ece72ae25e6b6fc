"""Issue 31: a small restore and a scheduler lookup cost a fixed, small number of catalog statements,
whatever the chain's length, with every check unchanged.

- a restore plan reads every link's parts and chunks in one statement (it was two per link and
  part): the statements a restore runs do not grow with the chain;
- ``Store.lookup`` is ``match`` + ``describe`` of its hit in one read: the same answer (property
  test over prompts that share prefixes with stored chains, at block granularity), and fewer
  statements than the two calls;
- the plan's checks still hold through the one-statement read: a chunk row gone, a quarantined
  chunk, a part of another shape — each refused before anything is written.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.profile import examples
from support.statements import statements

import snapstore as ss
from snapstore.catalog.chain_cache import ChainCache
from snapstore.chunks.chunkfile import HEADER_SIZE

BLOCK = 4
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 16))}, tokens_per_row=BLOCK)
IDENT = ss.Identity(build="t", pack="p", kv="u8")


def _open(path: Any) -> ss.Store:
    return ss.Store.open(str(path), identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0, ram_bytes=0))


def _chain(s: ss.Store, tokens: list[int], links: int, seed: int = 0) -> tuple[int, np.ndarray]:
    """Save ``tokens`` as a chain of ``links`` snapshots; (leaf id, the rows saved)."""
    rows = len(tokens) // BLOCK
    kv = np.random.default_rng(seed).integers(0, 256, (rows, 2, 16), dtype=np.uint8)
    sid = 0
    for b in sorted({max(1, rows * (i + 1) // links) for i in range(links)}):
        res = s.save(tokens[:b * BLOCK], {"kv": kv}, rows=b, parent="auto")
        assert res.ok and res.snapshot_id is not None
        sid = res.snapshot_id
    return sid, kv


def test_restore_statements_do_not_grow_with_the_chain(tmp_path: Any) -> None:
    """A restore of a 12-link chain runs as many catalog statements as one of a single link."""
    tokens = list(range(10, 10 + 48 * BLOCK))
    counts, reads = {}, {}
    for links in (1, 12):
        with _open(tmp_path / f"s{links}") as s:
            s._repo.plans = ChainCache(enabled=False)  # the catalog's own reads (kept plans: test_plan_memo.py)
            sid, kv = _chain(s, tokens, links)
            dst = np.zeros_like(kv)
            s.restore(sid, {"kv": dst})  # the connection opened, its statements prepared
            with statements(s) as seen:
                s.restore(sid, {"kv": dst})
            assert np.array_equal(dst, kv)
            counts[links] = len(seen)
            reads[links] = seen.index("COMMIT") + 1  # the plan's read transaction
    assert counts[12] == counts[1], counts
    # the plan's read: BEGIN, the snapshot with its identity's key, the chain, its parts and chunks,
    # COMMIT (before issue 31: 36 reads for 12 links, 14 for one; 6 with the key read apart), and
    # at most every USE_EVERY_S the bookkeeping write of last use
    assert reads == {1: 5, 12: 5}, reads
    assert counts[12] <= 12, counts


def test_lookup_runs_fewer_statements_than_match_and_describe(tmp_path: Any) -> None:
    tokens = list(range(10, 10 + 48 * BLOCK))
    with _open(tmp_path / "s") as s:
        _chain(s, tokens, 12)
        s.lookup(tokens)
        with statements(s) as both:
            m = s.match(tokens)
            assert m is not None
            s.describe(m)
        with statements(s) as one:
            d = s.lookup(tokens)
        assert d is not None and d.n_tokens == len(tokens)
        assert len(one) < len(both), (len(one), len(both))
        with statements(s) as match_only:
            s.match(tokens)
        # the plan's reads past the match: the snapshot with its identity's key, the chain, its parts
        # and chunks (the describe's components come from those parts, not a read of their own)
        assert len(one) <= len(match_only) + 3, (len(one), len(match_only))


@settings(max_examples=examples(25, dev=10), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_lookup_is_match_then_describe(tmp_path_factory: Any, data: st.DataObject) -> None:
    """For prompts that share any prefix with stored chains: lookup == describe(match(prompt))."""
    path = tmp_path_factory.mktemp("lk")
    base = [int(x) for x in data.draw(st.lists(st.integers(0, 9), min_size=8 * BLOCK, max_size=8 * BLOCK))]
    with _open(path) as s:
        _chain(s, base, data.draw(st.integers(1, 4)))
        other = [*base[:data.draw(st.integers(0, len(base)))], 99, 98, 97, 96, 95]
        _chain(s, other[: len(other) // BLOCK * BLOCK], data.draw(st.integers(1, 3)), seed=1)
        cut = data.draw(st.integers(0, len(base) + 5))
        prompt = [*base[:cut], *data.draw(st.lists(st.integers(0, 120), max_size=9))]
        m = s.match(prompt)
        d = s.lookup(prompt)
        if m is None:
            assert d is None
            return
        want = s.describe(m)
        assert d is not None
        assert d == want  # every field, snapshot_tokens included
        assert d.snapshot_tokens is not None and d.snapshot_tokens >= d.n_tokens == m.n_tokens
        whole = s.describe(m.snapshot_id)
        assert d.snapshot_tokens == whole.n_tokens


def test_lookup_of_a_block_prefix_names_the_snapshot_tokens(tmp_path: Any) -> None:
    """A prompt sharing only part of a stored snapshot: n_tokens is the block-aligned match,
    snapshot_tokens the snapshot's own (the vLLM connector takes an explicit parent only when equal)."""
    tokens = list(range(10, 10 + 8 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid, _ = _chain(s, tokens, 1)
        prompt = tokens[:5 * BLOCK + 2] + [500, 501]
        d, m = s.lookup(prompt), s.match(prompt)
        assert d is not None and m is not None and d.snapshot_id == m.snapshot_id == sid
        assert 0 < d.n_tokens == m.n_tokens < d.snapshot_tokens == 8 * BLOCK
        assert d.rows == {"kv": d.n_tokens // BLOCK} and d.n_tokens % BLOCK == 0
        assert s.lookup([500, 501, 502, 503, 504]) is None


def test_plan_checks_hold_through_the_one_statement_read(tmp_path: Any) -> None:
    """A quarantined chunk and a chunk row gone are still refused before a byte is written."""
    tokens = list(range(10, 10 + 24 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid, kv = _chain(s, tokens, 6)
        chain = s.describe(sid).chain
        conn = s._repo.db.conn()
        mid = chain[2]
        cid = bytes(conn.execute("SELECT chunk_id FROM part_chunks WHERE snapshot_id = ?", (mid,)).fetchone()[0])
        conn.execute("UPDATE chunks SET quarantined = 1.0 WHERE id = ?", (cid,))
        dst = np.full_like(kv, 7)
        with pytest.raises(ss.CorruptChunkError) as e:
            s.restore(sid, {"kv": dst})
        assert not e.value.touched and (dst == 7).all()
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("DELETE FROM chunks WHERE id = ?", (cid,))
        with pytest.raises(ss.SnapshotUnavailableError, match="references a chunk that is gone") as e2:
            s.restore(sid, {"kv": dst})
        assert not e2.value.touched and (dst == 7).all()


def test_small_warm_restore_starts_no_reader_threads(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A few MiB whose pages are cached are read on the calling thread (reader threads started for
    them cost more than the reads); the same restore with its files not cached keeps the readers."""
    from snapstore.restore import stream
    from snapstore.restore import tier_probe as tiers

    made: list[int] = []
    real = stream.ReadAhead

    def counting(*a: Any, **k: Any) -> Any:
        made.append(1)
        return real(*a, **k)

    monkeypatch.setattr(stream, "ReadAhead", counting)
    lay = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 16384))}, tokens_per_row=32)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=lay,
                       budget=ss.Budget(reserve_bytes=0, ram_bytes=0)) as s:
        kv = np.random.default_rng(3).integers(0, 256, (96, 2, 16384), dtype=np.uint8)  # 3 MiB
        tokens = list(range(96 * 32))
        sid = 0
        for b in (32, 64, 96):
            res = s.save(tokens[:b * 32], {"kv": kv}, rows=b, parent="auto")
            assert res.ok and res.snapshot_id is not None
            sid = res.snapshot_id
        dst = np.zeros_like(kv)
        s.restore(sid, {"kv": dst})
        made.clear()
        s.restore(sid, {"kv": dst})  # warm: the first restore read every file
        assert np.array_equal(dst, kv) and made == []
        for probing in (stream, tiers):  # the tier tally probes the files; the stream reuses its answers
            monkeypatch.setattr(probing, "resident", lambda fd, size: False)  # as if evicted
        dst = np.zeros_like(kv)  # another array: the full path (a repeat into the same one replays, restore/hot.py)
        s.restore(sid, {"kv": dst})
        assert np.array_equal(dst, kv) and made == [1]


def test_small_chunks_stay_in_the_page_cache_with_direct_io(tmp_path: Any) -> None:
    """With O_DIRECT saves on, a chunk under DIRECT_SAVE_MIN is written buffered: its pages stay
    cached, so the next restore of a small prefix (here or in the next process) is a warm one."""

    from support.pagecache import cached_pages

    from snapstore.save.chunker import DIRECT_SAVE_MIN

    lay = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 16384))}, tokens_per_row=32)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=lay, direct_io=True,
                       budget=ss.Budget(reserve_bytes=0, ram_bytes=0)) as s:
        if not s._chunker.direct:
            pytest.skip("this file system refuses O_DIRECT")
        kv = np.random.default_rng(5).integers(0, 256, (8, 2, 16384), dtype=np.uint8)  # one 256 KiB chunk
        assert kv.nbytes < DIRECT_SAVE_MIN
        assert s.save(list(range(8 * 32)), {"kv": kv}, rows=8).ok
        files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(s.path, "blobs")) for f in fs]
        pages = sum(-(-os.path.getsize(f) // 4096) for f in files)
        assert files and sum(cached_pages(f) for f in files) >= pages - len(files)


@pytest.mark.parametrize("replayed", [False, True])
@pytest.mark.parametrize("link_rows", [8, 2])
def test_a_cold_chain_is_read_by_its_reads_not_asked_for_ahead(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                 replayed: bool, link_rows: int) -> None:
    """A 12-link chain whose files are not cached is restored exactly without a WILLNEED hint (the
    pages it brought in were slower to copy from for the warm restores after: docs/benchmarks.md,
    "Seventh pass" and "Issue 48, fourth pass"); the tiers still say cold (probed before the first
    read), and the reads left the chain cached for the next restore. ``replayed``: the same for a
    restore replayed from a kept plan (restore.hot: the arrays restored into twice before), but
    that links of 64 KiB are all asked for at once before the first is read (it reads one file
    after the other, the full path two at once: restore.hot_plan.ask_ahead)."""
    import glob

    from support.pagecache import cached_pages, drop_cache

    lay = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 16384))}, tokens_per_row=32)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=lay,
                       budget=ss.Budget(reserve_bytes=0, ram_bytes=0), direct_io=False) as s:
        rows = 12 * link_rows
        kv = np.random.default_rng(5).integers(0, 256, (rows, 2, 16384), dtype=np.uint8)  # 12 links of 32 KiB rows
        tokens = list(range(rows * 32))
        sid = 0
        for b in range(link_rows, rows + 1, link_rows):
            res = s.save(tokens[:b * 32], {"kv": kv}, rows=b, parent="auto")
            assert res.ok and res.snapshot_id is not None
            sid = res.snapshot_id
        files = sorted(glob.glob(str(tmp_path / "s" / "blobs" / "*" / "*")))
        assert len(files) == 12
        for f in files:
            drop_cache(f)
        if any(cached_pages(f) for f in files):
            pytest.skip("this file system keeps files in memory: no cold reads to test")
        dst = np.zeros_like(kv)
        if replayed:
            for _ in range(2):  # the second restore into the same array keeps its plan
                s.restore(sid, {"kv": dst})
            assert len(s._hot) == 1
            for f in files:
                drop_cache(f)
        advice: list[tuple[int, int]] = []  # (how, file size) of each hint
        real = os.posix_fadvise
        real_pread = os.pread
        reads_before: list[int] = []

        def fadvise(fd: int, offset: int, length: int, how: int) -> None:
            advice.append((how, os.fstat(fd).st_size))
            real(fd, offset, length, how)

        def pread(fd: int, n: int, offset: int) -> bytes:
            if n == HEADER_SIZE:  # a chunk file's header (not the catalog's WAL-index header)
                reads_before.append(len(advice))  # the hints given when it was read
            return real_pread(fd, n, offset)

        tiers: list[dict[str, int]] = []  # what the replay itself counted
        replay = s._hot.replay

        def spy(*a: Any, **kw: Any) -> Any:
            done = replay(*a, **kw)
            if done is not None:
                tiers.append(dict(done.tiers))
            return done

        monkeypatch.setattr(os, "posix_fadvise", fadvise)
        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(s._hot, "replay", spy)
        dst[:] = 0
        replays = s._hot.replays
        s.restore(sid, {"kv": dst})
        assert np.array_equal(dst, kv)
        assert tiers == ([{"warm": 0, "cold": kv.nbytes, "ram": 0}] if replayed else [])
        willneed = [size for how, size in advice if how == os.POSIX_FADV_WILLNEED]
        if link_rows == 8 or not replayed:
            assert willneed == []
        else:  # every file asked for, before the first header was read
            assert sorted(willneed) == sorted(os.path.getsize(f) for f in files)
            assert reads_before and reads_before[0] == 12
        assert s._hot.replays == replays + replayed
        if not replayed:  # probed before the first read (a replay's own count is checked above)
            assert set(s._rates.rates()) == {"cold"}
        pages = [-(-os.path.getsize(f) // 4096) for f in files]
        assert [cached_pages(f) >= n - 1 for f, n in zip(files, pages)] == [True] * 12


@pytest.mark.parametrize("tokens_per_row", [None, 32])
def test_warm_up_prepares_what_the_first_lookup_and_restore_run(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                tokens_per_row: int | None) -> None:
    """After ``warm_up`` a fresh store's first weighed lookup and first restore of a 12-link chain
    prepare no statement (apsw's statement cache has them all) but the one whose text varies, and
    warm_up counted nothing."""
    from snapstore.lifecycle import bookkeeping

    monkeypatch.setattr(bookkeeping, "USE_EVERY_S", 1e9)  # no bookkeeping write during the test
    lay = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 16))}, tokens_per_row=tokens_per_row)
    g = tokens_per_row or 1
    tokens = list(range(10, 10 + 24 * 32))
    kv = np.random.default_rng(1).integers(0, 256, (len(tokens) // g, 2, 16), dtype=np.uint8)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=lay, budget=ss.Budget(reserve_bytes=0)) as s:
        for i in range(1, 13):
            rows = len(kv) * i // 12
            assert s.save(tokens[:rows * g], {"kv": kv}, rows=rows, parent="auto").ok
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=lay, budget=ss.Budget(reserve_bytes=0)) as s:
        s.warm_up()
        before = s.stats()
        conn = s._repo.db.conn()
        misses = conn.cache_stats()["misses"]
        with statements(s) as seen:
            d = s.lookup(tokens[:-5], prefill_tokens_per_s=1000.0)
            assert d is not None
            dst = np.zeros_like(kv)
            s.restore(ss.Match(d.snapshot_id, d.n_tokens), {"kv": dst})
        # the block-prefix holders read has one "?" per prefix length asked: its text varies
        varying = len({sql for sql in seen if sql.startswith("SELECT n_tokens, key, id FROM")})
        assert conn.cache_stats()["misses"] == misses + varying
        assert np.array_equal(dst[:d.rows["kv"]], kv[:d.rows["kv"]])
        after = s.stats()
        assert (after.hits, after.misses) == (before.hits + 1, before.misses)


def test_catalog_rows_built_at_once_equal_their_dataclass_rows() -> None:
    """The catalog's rows are built by filling each instance at once (issue 31), not through the
    frozen dataclass's ``__init__``: the instance is the same — equal, hashed alike, still frozen,
    ``dataclasses.replace`` works — and a row of the wrong width is refused."""
    import dataclasses

    from snapstore.catalog.rows import ChunkRow, PartRow, SnapRow, chunk_row, part_row, snap_row

    snap = (7, 2, "ns", 6, 3, 96, 64, 4, b"\x01" * 128, b"a" * 16, b"p" * 16, b"c" * 16, None, 1, "own", 1,
            1.5, 2.5, 4, 1024, 0, b"l" * 16, None)
    chunk = (b"i" * 32, 4096, 4000, 1, b"s" * 16, 2, 3.5, b"scope", None)
    part = (7, "kv", 1, "uint8", "[2, 16]", None, 16, 24, 256, 4)
    pairs = [(snap_row(snap), SnapRow(*snap)), (chunk_row(chunk), ChunkRow(*chunk)),
             (part_row(part), PartRow(*part[:4], (2, 16), *part[5:]))]
    for built, reference in pairs:
        assert type(built) is type(reference) and built == reference and hash(built) == hash(reference)
        assert repr(built) == repr(reference)
        with pytest.raises(dataclasses.FrozenInstanceError):
            built.nbytes = 0  # type: ignore[misc]
        first = dataclasses.fields(built)[0].name
        assert getattr(dataclasses.replace(built, **{first: getattr(reference, first)}), first) == \
            getattr(reference, first)
    assert isinstance(chunk_row((memoryview(b"i" * 32), *chunk[1:])).id, bytes)  # apsw's blob, as bytes
    with pytest.raises(ValueError):
        snap_row(snap[:-1])


def test_chain_and_its_parts_come_in_order_without_an_order_by(tmp_path: Any) -> None:
    """The chain (root first) and each part's chunks (by seq) are ordered in Python now, not by
    SQLite's ORDER BY: the same rows in the same order as the ordered statements, and a chain of
    multi-chunk links restores exactly."""
    layout = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 512))}, tokens_per_row=BLOCK)  # 1 KiB rows
    tokens = list(range(10, 10 + 48 * BLOCK))
    kv = np.random.default_rng(3).integers(0, 256, (48, 2, 512), dtype=np.uint8)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=layout, chunk_bytes=4096,
                       budget=ss.Budget(reserve_bytes=0, ram_bytes=0)) as s:
        sid = 0
        for b in (9, 19, 29, 38, 48):  # links of 9-10 rows: three chunks of up to 4 rows each
            res = s.save(tokens[:b * BLOCK], {"kv": kv}, rows=b, parent="auto")
            assert res.ok and res.snapshot_id is not None
            sid = res.snapshot_id
        conn = s._repo.db.conn()
        chain = s._repo.db.read(lambda c: c.chain(sid))
        assert [x.id for x in chain] == s.describe(sid).chain and chain[-1].id == sid
        ids = [x.id for x in chain]
        got = s._repo.db.read(lambda c: c.chain_parts(ids))
        assert all(len(chunks) > 1 for _, chunks in got)
        for part, chunks in got:
            ordered = [bytes(r[0]) for r in conn.execute(
                "SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? AND name = ? ORDER BY seq",
                (part.snapshot_id, part.name))]
            assert [c.id for c in chunks if c is not None] == ordered
        dst = np.zeros_like(kv)
        s.restore(sid, {"kv": dst})
        assert np.array_equal(dst, kv)
