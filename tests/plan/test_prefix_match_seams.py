"""Seams of block-granular prefixes (``Layout(tokens_per_row=)``) with the rest of the store: what a
prefix match must never offer (another identity's, a pending capture, an expired snapshot), what
it must still find (a stream saved with fewer rows than another, a superseded chain link), and what
a restore of it writes (batches mixing clipped and whole restores, forged lengths, tokens >= 2**31)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pytest
from conftest import IDENT, LAYOUT, make_state

import snapstore as ss
from snapstore._results import Match

G = 32  # tokens per row: one paged block
BLOCKS = ss.Layout(rows={"l0": ss.Rows("float32", (2, G, 8)), "l1": ss.Rows("float32", (2, G, 8))},
                   tokens_per_row=G)
NAMES = ("l0", "l1")


def _open(path: Any, layout: ss.Layout = BLOCKS, identity: ss.Identity = IDENT, **kw: Any) -> ss.Store:
    kw.setdefault("chunk_bytes", 8192)
    kw.setdefault("staging_bytes", 65536)
    budget = kw.pop("budget", ss.Budget(reserve_bytes=0))
    return ss.Store.open(str(path), identity=identity, layout=layout, budget=budget, check_rows=True, **kw)


def _blocks(n_rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((n_rows, 2, G, 8)).astype(np.float32) for n in NAMES}


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50000, n)]


def _dest(n_rows: int) -> dict[str, np.ndarray]:
    return {n: np.full((n_rows, 2, G, 8), -1.0, np.float32) for n in NAMES}


def test_prefix_match_never_crosses_identities(tmp_path: Any) -> None:
    """Two identities in one directory: the same prompt's prefix is only ever its own identity's."""
    other = dataclasses.replace(IDENT, build="test-2.0+def")
    a = _prompt(8 * G, 1)
    q = a[:5 * G] + _prompt(20, 2)
    with _open(tmp_path / "s") as mine, _open(tmp_path / "s", identity=other) as theirs:
        r = mine.save(a, _blocks(8, 3))
        assert r.ok
        assert theirs.match(q) is None and theirs.match(a) is None
        m = mine.match(q)
        assert m is not None and m.snapshot_id == r.snapshot_id and m.n_tokens == 5 * G
        with pytest.raises(ss.IdentityError):
            theirs.restore(m, into=_dest(5))


def test_prefix_match_never_offers_a_pending_capture(tmp_path: Any) -> None:
    """A capture saved with commit=False is invisible to match() at every prefix until committed."""
    a = _prompt(8 * G, 10)
    q = a[:6 * G] + _prompt(9, 11)
    with _open(tmp_path / "s") as st:
        r = st.save(a, _blocks(8, 12), commit=False)
        assert r.pending
        assert st.match(q) is None and st.match(a) is None
        st.commit(r)
        m = st.match(q)
        assert m is not None and m.snapshot_id == r.snapshot_id and m.n_tokens == 6 * G


def test_prefix_match_honours_the_ttl(tmp_path: Any) -> None:
    """A snapshot not used within the TTL is no longer offered, whole or as a prefix."""
    a = _prompt(8 * G, 20)
    q = a[:3 * G] + [7]
    with _open(tmp_path / "s", budget=ss.Budget(reserve_bytes=0, ttl=0.5)) as st:
        st.save(a, _blocks(8, 21))
        assert st.match(q) is not None
        time.sleep(0.7)
        assert st.match(q) is None and st.match(a) is None


def test_streams_saved_with_fewer_rows_still_index_every_step(tmp_path: Any) -> None:
    """A parent saved with fewer rows in one stream (rows={"l1": 4}) than the other: the child holds
    every step its chain completes in both streams, so a prompt sharing 10 blocks with the child gets
    10 blocks, not the 4 of the parent (a hole in the index broke the binary search)."""
    sys_p = _prompt(6 * G, 30)
    base = _blocks(6, 31)
    with _open(tmp_path / "s") as st:
        p = st.save(sys_p, base, rows={"l1": 4})
        assert st.describe(p).rows == {"l0": 6, "l1": 4}
        conv = sys_p + _prompt(6 * G, 32)
        full = {n: np.concatenate([base[n], _blocks(6, 33)[n]]) for n in NAMES}
        c = st.save(conv, full)
        assert c.parent_id == p.snapshot_id
        q = conv[:10 * G] + _prompt(40, 34)
        m = st.match(q)
        assert m is not None and m.snapshot_id == c.snapshot_id and m.n_tokens == 10 * G
        dest = _dest(12)
        assert st.restore(m, into=dest).rows == {"l0": 10, "l1": 10}
        for n in NAMES:
            assert np.array_equal(dest[n][:10], full[n][:10]) and (dest[n][10:] == -1.0).all()
        # every step in between is reachable too (the index has no holes)
        for k in range(1, 11):
            mk = st.match(conv[:k * G] + [50001])
            assert mk is not None and mk.n_tokens == k * G, k


def test_restore_many_mixes_clipped_and_whole_restores_of_one_chain(tmp_path: Any) -> None:
    """One batch: a 3-block prefix match, a 6-block prefix match and the whole snapshot share chunks;
    each destination gets exactly its rows, nothing beyond."""
    a = _prompt(9 * G, 40)
    state = _blocks(9, 41)
    with _open(tmp_path / "s") as st:
        r = st.save(a, state)
        m3, m6 = st.match(a[:3 * G] + [1]), st.match(a[:6 * G + 5] + [1])
        assert m3 is not None and m6 is not None and (m3.n_tokens, m6.n_tokens) == (3 * G, 6 * G)
        d3, d6, dall = _dest(9), _dest(9), _dest(9)
        out = st.restore_many([(m3, d3), (m6, d6), (r, dall)])
        assert [o.n_tokens for o in out] == [3 * G, 6 * G, 9 * G]
        for d, k in ((d3, 3), (d6, 6), (dall, 9)):
            for n in NAMES:
                assert np.array_equal(d[n][:k], state[n][:k]) and (d[n][k:] == -1.0).all(), (k, n)


def test_a_forged_match_length_is_refused_before_a_byte_is_written(tmp_path: Any) -> None:
    """A Match whose n_tokens is not a whole number of rows names no restorable state: refused."""
    a = _prompt(8 * G, 50)
    with _open(tmp_path / "s") as st:
        r = st.save(a, _blocks(8, 51))
        dest = _dest(8)
        with pytest.raises(ss.InvalidInputError, match="whole number"):
            st.restore(Match(r.snapshot_id, 3 * G + 1, None), into=dest)
        with pytest.raises(ss.InvalidInputError, match="whole number"):
            st.describe(Match(r.snapshot_id, 3 * G + 1, None))
        assert all((dest[n] == -1.0).all() for n in NAMES)


def test_a_superseded_chain_link_still_serves_its_rows(tmp_path: Any) -> None:
    """In one session a longer save supersedes the shorter (kept only as a chain link): a prompt that
    shares fewer blocks than the link holds still gets them, bit-exact, from the link."""
    a = _prompt(4 * G, 60)
    base = _blocks(4, 61)
    with _open(tmp_path / "s") as st:
        r0 = st.save(a, base, session="chat")
        longer = a + _prompt(4 * G, 62)
        full = {n: np.concatenate([base[n], _blocks(4, 63)[n]]) for n in NAMES}
        r1 = st.save(longer, full, session="chat")
        assert r1.parent_id == r0.snapshot_id
        m = st.match(a[:3 * G] + [1])
        assert m is not None and m.n_tokens == 3 * G
        dest = _dest(4)
        st.restore(m, into=dest)
        for n in NAMES:
            assert np.array_equal(dest[n][:3], full[n][:3]) and (dest[n][3:] == -1.0).all()


@pytest.mark.parametrize("layout", [LAYOUT, BLOCKS], ids=["exact", "blocks"])
def test_tokens_at_and_above_2_to_the_31_never_alias_stored_int32_tokens(tmp_path: Any, layout: ss.Layout) -> None:
    """Stored int32 token blobs against a prompt token that wraps in int32 (2**32 + t reads as t):
    no match; a child stored in int64 (a token >= 2**31) over an int32 parent matches exactly."""
    n = 8 * G
    toks = _prompt(n, 70)
    state = make_state(layout, n) if layout is LAYOUT else _blocks(8, 71)
    with _open(tmp_path / "s", layout=layout) as st:
        r = st.save(toks, state)
        wrapped = list(toks)
        wrapped[5] = toks[5] + 2**32  # the same low 32 bits
        assert st.match(wrapped) is None
        assert st.match(toks + [2**40]).snapshot_id == r.snapshot_id  # type: ignore[union-attr]
        big = toks + [2**31 + 3] + _prompt(2 * G - 1, 72)
        more = make_state(layout, 2 * G, seed=73) if layout is LAYOUT else _blocks(2, 73)
        state2 = {k: more[k] if k in layout.fixed else np.concatenate([state[k], more[k]]) for k in state}
        r2 = st.save(big, state2)
        assert r2.parent_id == r.snapshot_id
        assert st.match(big + [1]).snapshot_id == r2.snapshot_id  # type: ignore[union-attr]
        alias = list(big)
        alias[n] = 3  # 2**31 + 3 as int32 is negative: never this token
        hit = st.match(alias + [1])
        assert hit is not None and hit.snapshot_id == r.snapshot_id and hit.n_tokens == n


def _kv_layout(g: int | None) -> ss.Layout:
    """One stream whose dtype and row shape do not say the granularity: only ``tokens_per_row`` does."""
    return ss.Layout(rows={"kv": ss.Rows("float32", (4,))}, tokens_per_row=g)


@pytest.mark.parametrize(("saved", "read"), [(16, 8), (8, 16), (None, 8), (8, None)],
                         ids=["coarse-to-fine", "fine-to-coarse", "none-to-g", "g-to-none"])
def test_a_layout_differing_only_in_tokens_per_row_never_reads_rows_of_another_granularity(
        tmp_path: Any, saved: int | None, read: int | None) -> None:
    """Rows saved at one granularity, read by a store of the same identity at another (the same dtype
    and row shape, so the dtype/shape check passes): match() does not offer them (neither exact nor
    block-granular), and every way in by reference — the saved result, its id, describe,
    restore_many — raises DestinationError before a byte is written (rows of 16 tokens served as
    rows of 8 would be wrong state)."""
    a = _prompt(64, 80)
    kv = np.random.default_rng(81).standard_normal((64 // (saved or 1), 4)).astype(np.float32)
    with _open(tmp_path / "s", layout=_kv_layout(saved)) as st:
        r = st.save(a, {"kv": kv})
        assert r.ok
    with _open(tmp_path / "s", layout=_kv_layout(read)) as st:
        # match() never offers it (issue 23 item 13: it could never restore); asked for by id, every
        # way in refuses it
        assert st.match(a + [1]) is None and st.match(a[:32] + [1]) is None
        refs: list[Any] = [r, r.snapshot_id]
        dest = {"kv": np.full((64, 4), -1.0, np.float32)}
        for ref in refs:
            if ref is None:
                continue
            with pytest.raises(ss.DestinationError, match="tokens per row"):
                st.describe(ref)
            with pytest.raises(ss.DestinationError, match="tokens per row"):
                st.restore(ref, into=dest)
            with pytest.raises(ss.DestinationError, match="tokens per row"):
                st.restore_many([(ref, dest)])
        assert (dest["kv"] == -1.0).all()
        # its own save of a longer prompt is no delta over rows of another granularity
        more = a + _prompt(32, 82)
        mine = np.random.default_rng(83).standard_normal((96 // (read or 1), 4)).astype(np.float32)
        r2 = st.save(more, {"kv": mine})
        assert r2.ok and r2.parent_id is None
        with pytest.raises(ss.LayoutError, match="tokens_per_row"):  # nor one the caller names
            st.save(more, {"kv": mine}, parent=r.snapshot_id)
        m = st.match(more + [1])
        assert m is not None and m.snapshot_id == r2.snapshot_id
        out = {"kv": np.zeros_like(mine)}
        st.restore(m, into=out)
        assert np.array_equal(out["kv"], mine)
    with _open(tmp_path / "s", layout=_kv_layout(saved)) as st:  # the first layout still reads its own
        out = {"kv": np.zeros_like(kv)}
        st.restore(r, into=out)
        assert np.array_equal(out["kv"], kv)


def test_the_same_bytes_as_rows_of_another_size_are_another_snapshot(tmp_path: Any) -> None:
    """The same prompt and the same row bytes saved at 16 and at 8 tokens per row (rows= keeps the row
    count equal): the second save is a snapshot of its own, not the first one found again by content."""
    a = _prompt(64, 84)
    kv = np.random.default_rng(85).standard_normal((4, 4)).astype(np.float32)
    with _open(tmp_path / "s", layout=_kv_layout(16)) as st:
        coarse = st.save(a, {"kv": kv})
    with _open(tmp_path / "s", layout=_kv_layout(8)) as st:
        fine = st.save(a, {"kv": kv}, rows={"kv": 4})
        assert fine.ok and fine.snapshot_id != coarse.snapshot_id
        out = {"kv": np.zeros((4, 4), np.float32)}
        assert st.restore(fine, into=out).rows == {"kv": 4}
        assert np.array_equal(out["kv"], kv)


def test_rows_from_counts_rows_not_tokens(tmp_path: Any) -> None:
    """At 32 tokens per row a snapshot of 8 blocks restores 8 rows: rows_from=9 (within its 256 tokens,
    past its rows) is refused like any rows_from outside the restore, for a prefix match at its rows."""
    a = _prompt(8 * G, 86)
    with _open(tmp_path / "s") as st:
        r = st.save(a, _blocks(8, 87))
        assert st.describe(r, rows_from=8).rows == {"l0": 8, "l1": 8}
        with pytest.raises(ss.InvalidInputError, match="rows_from"):
            st.describe(r, rows_from=9)
        with pytest.raises(ss.InvalidInputError, match="rows_from"):
            st.restore(r, into=_dest(8), rows_from=9)
        m = st.match(a[:3 * G] + [1])
        assert m is not None and m.n_tokens == 3 * G
        assert st.describe(m, rows_from=3).nbytes == 0
        with pytest.raises(ss.InvalidInputError, match="rows_from"):
            st.restore_many([(m, _dest(8))], rows_from=4)


def test_a_prefix_restore_by_another_session_keeps_the_snapshot_matchable(tmp_path: Any) -> None:
    """Session B restores a block-granular prefix of session A's snapshot: A's next turn detaches it
    (still matched whole, at its own 4 blocks + 5 tokens) instead of superseding it."""
    a = _prompt(4 * G + 5, 90)
    base = _blocks(4, 91)
    with _open(tmp_path / "s") as st:
        r0 = st.save(a, base, session="A")
        m = st.match(a[:3 * G] + [1])
        assert m is not None and m.snapshot_id == r0.snapshot_id and m.n_tokens == 3 * G
        st.restore(m, into=_dest(4), session="B")
        longer = a + _prompt(4 * G, 92)
        st.save(longer, {n: np.concatenate([base[n], _blocks(4, 93)[n]]) for n in NAMES}, session="A")
        assert st.stats().detached == 1
        whole = st.match(a + [50001])
        assert whole is not None and whole.snapshot_id == r0.snapshot_id and whole.n_tokens == 4 * G + 5


def test_restore_many_by_another_session_detaches_instead_of_superseding(tmp_path: Any) -> None:
    """The session rule holds for a batch too: a snapshot restored by restore_many from outside its
    session keeps its fixed parts when its session moves on."""
    lay = ss.Layout(fixed={"rec": ss.Fixed("float32", (4,))}, rows={"kv": ss.Rows("uint8", (16,))})
    a = _prompt(300, 100)
    rng = np.random.default_rng(101)
    kv = rng.integers(0, 256, (600, 16), dtype=np.uint8)
    rec0, rec1 = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    with _open(tmp_path / "s", layout=lay) as st:
        r0 = st.save(a, {"rec": rec0, "kv": kv[:300]}, session="A")
        dest = {"rec": np.zeros(4, np.float32), "kv": np.zeros((300, 16), np.uint8)}
        st.restore_many([(st.match(a + [1]), dest)], session="B")
        st.save(a + _prompt(300, 102), {"rec": rec1, "kv": kv}, session="A")
        assert st.stats().detached == 1
        m = st.match(a + [2])
        assert m is not None and m.snapshot_id == r0.snapshot_id
        out = {"rec": np.zeros(4, np.float32), "kv": np.zeros((300, 16), np.uint8)}
        st.restore(m, into=out)
        assert np.array_equal(out["rec"], rec0) and np.array_equal(out["kv"], kv[:300])


class _Writer:
    """A PartWriter over a host array that records every byte range it is asked to write."""

    def __init__(self, n_rows: int, lend: bool):
        self.arr = np.full((n_rows, 2, G, 8), -1.0, np.float32)
        self.raw = self.arr.reshape(-1).view(np.uint8)
        self.nbytes = self.raw.nbytes
        self.writes: list[tuple[int, int]] = []
        self._lent: dict[tuple[int, int], bytearray] = {}
        if lend:
            self.buffer_for = self._buffer_for

    def write_from(self, offset: int, data: memoryview) -> None:
        self.writes.append((offset, offset + len(data)))
        self.raw[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def _buffer_for(self, offset: int, n: int) -> memoryview:
        buf = self._lent[(offset, n)] = bytearray(n)
        return memoryview(buf)

    def commit(self, offset: int, n: int) -> None:
        self.write_from(offset, memoryview(self._lent.pop((offset, n))))

    def discard(self, offset: int, n: int) -> None:
        self._lent.pop((offset, n), None)


@pytest.mark.parametrize("kind", ["strided", "writer", "lending-writer"])
def test_a_prefix_restore_clips_every_kind_of_destination(tmp_path: Any, kind: str) -> None:
    """The straddling chunk of a 5-block prefix is clipped whatever the destination: a strided
    array, a PartWriter, a PartWriter that lends buffers — no byte at or beyond row 5 is written."""
    a = _prompt(9 * G, 110)
    state = _blocks(9, 111)
    row_bytes = 2 * G * 8 * 4
    with _open(tmp_path / "s", chunk_bytes=3 * 4096) as st:  # 6 rows a chunk: rows 0-5 straddle row 5
        st.save(a, state)
        m = st.match(a[:5 * G + 3] + [1])
        assert m is not None and m.n_tokens == 5 * G
        if kind == "strided":
            big = {n: np.full((18, 2, G, 8), -1.0, np.float32) for n in NAMES}
            dest: dict[str, Any] = {n: big[n][::2] for n in NAMES}
            st.restore(m, into=dest)
            for n in NAMES:
                assert np.array_equal(big[n][0:10:2], state[n][:5])
                assert (big[n][1::2] == -1.0).all() and (big[n][10::2] == -1.0).all()
            return
        writers = {n: _Writer(9, lend=kind == "lending-writer") for n in NAMES}
        st.restore(m, into=writers)
        for n, w in writers.items():
            assert np.array_equal(w.arr[:5], state[n][:5]) and (w.arr[5:] == -1.0).all()
            assert w.writes and max(end for _, end in w.writes) <= 5 * row_bytes


def test_plan_then_write_sizes_a_prefix_restore_by_its_rows(tmp_path: Any) -> None:
    """restore(m, into=callable): the plan the engine allocates from names the prefix's rows, and a
    destination of exactly that many rows takes the restore (the straddling chunk clipped)."""
    a = _prompt(9 * G, 120)
    state = _blocks(9, 121)
    with _open(tmp_path / "s") as st:
        st.save(a, state)
        m = st.match(a[:4 * G] + [1])
        assert m is not None and m.n_tokens == 4 * G
        seen: list[ss.MatchDetails] = []
        dest: dict[str, np.ndarray] = {}

        def alloc(d: ss.MatchDetails) -> dict[str, np.ndarray]:
            seen.append(d)
            dest.update({n: np.zeros((d.rows[n], 2, G, 8), np.float32) for n in NAMES})
            return dest

        out = st.restore(m, into=alloc)
        assert seen[0].rows == out.rows == {"l0": 4, "l1": 4} and seen[0].n_tokens == 4 * G
        assert seen[0].nbytes == 2 * 4 * 2 * G * 8 * 4
        assert all(np.array_equal(dest[n], state[n][:4]) for n in NAMES)


def test_exclude_passes_over_one_holder_of_a_prefix_to_the_next(tmp_path: Any) -> None:
    """Two stored prompts hold the same 5 blocks (saved whole, so both are indexed there): excluding
    the one match() offered falls back to the other at the same length, then to nothing."""
    shared = _prompt(5 * G, 130)
    a, b = shared + _prompt(3 * G, 131), shared + _prompt(2 * G, 132)
    with _open(tmp_path / "s") as st:
        ra = st.save(a, _blocks(8, 133), parent=None)
        rb = st.save(b, _blocks(7, 134), parent=None)
        q = shared + [50001] * 40
        first = st.match(q)
        assert first is not None and first.n_tokens == 5 * G
        second = st.match(q, exclude=[first])
        assert second is not None and second.n_tokens == 5 * G
        assert {first.snapshot_id, second.snapshot_id} == {ra.snapshot_id, rb.snapshot_id}
        assert st.match(q, exclude=[first, second]) is None
