"""Find keys (schema v8, snapshots.find_key): the cheap integer match() finds candidates by.

What must hold: every stored key is the prompt-side key of the snapshot's tokens at its block,
however the chain was built (block-aligned or not, explicit parents, int64 segments); a key that
collides (forced here through the catalog) costs a candidate read and never changes match()'s
answer; a catalog from before v8 is keyed on open and matches exactly as before; a row left
without a key (an older snapstore writing after the migration) is keyed by the next open.
"""

from __future__ import annotations

import os

import apsw
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from support import open_store
from support.catalogs import LATEST_SCHEMA, UNDO_FIND_KEYS

import snapstore as ss
from snapstore._tokens import BLOCK, as_token_array
from snapstore.catalog.find_keys import find_keys
from snapstore.plan.match import tokens_of

TINY = ss.Layout(rows={"t": ss.Rows("uint8", (1,))})


def _open(path: str) -> ss.Store:
    return open_store(path, layout=TINY)


def _save(s: ss.Store, toks: np.ndarray, parent: object = "auto") -> ss.SaveResult:
    rows = (np.arange(len(toks), dtype=np.uint64) % 251).astype(np.uint8).reshape(-1, 1)
    r = s.save(toks, {"t": rows}, parent=parent)
    assert r.ok
    return r


def _stored(s: ss.Store) -> dict[int, tuple[int, int | None]]:
    """sid -> (n_tokens, find_key) for every snapshot row."""
    rows = s._repo.db.read(lambda c: c.execute("SELECT id, n_tokens, find_key FROM snapshots").fetchall())
    return {int(i): (int(n), None if k is None else int(k)) for i, n, k in rows}


def _expected(s: ss.Store, sid: int, n: int) -> int:
    toks = s._repo.db.read(lambda c: tokens_of(c.chain(sid)))
    assert len(toks) == n
    return int(find_keys(toks)[n // BLOCK])


def _set_key(s: ss.Store, sid: int, key: int | None) -> None:
    s._repo.db.write(lambda c: c.execute("UPDATE snapshots SET find_key = ? WHERE id = ?", (key, sid)))


def _chains(s: ss.Store, rng: np.random.Generator) -> list[np.ndarray]:
    """Prompts saved as chains with unaligned boundaries, an explicit parent, a zero-token delta
    and int64 segments (tokens >= 2**31); returns the prompts."""
    a = rng.integers(0, 50_000, 2000)
    for n in (100, 256, 300, 777, 1024, 1500, 2000):
        _save(s, a[:n])
    b = np.concatenate([a[:777], rng.integers(0, 50_000, 600)])  # a branch off a's 777-token link
    _save(s, b)
    wide = np.concatenate([a[:300], rng.integers(2**31, 2**40, 500)])  # segments stored as int64
    _save(s, wide[:600])
    _save(s, wide)
    r = _save(s, a[:40], parent=None)
    _save(s, a[:40], parent=r.snapshot_id)  # same length as its parent: no new token
    return [a, b, wide]


def test_every_stored_key_is_the_prompt_key_at_its_block(tmp_path: str) -> None:
    with _open(os.path.join(tmp_path, "s")) as s:
        _chains(s, np.random.default_rng(1))
        stored = _stored(s)
        assert len(stored) >= 10
        for sid, (n, key) in stored.items():
            assert key == _expected(s, sid, n), sid


def test_a_forced_key_collision_costs_a_read_never_the_answer(tmp_path: str) -> None:
    rng = np.random.default_rng(2)
    q = rng.integers(0, 50_000, 300 * BLOCK + 17)
    with _open(os.path.join(tmp_path, "s")) as s:
        short = _save(s, q[:2 * BLOCK + 5], parent=None)  # a true prefix, 2 blocks
        mid = _save(s, q[:150 * BLOCK + 3], parent=None)  # the longest true prefix, block 150
        other = _save(s, rng.integers(0, 50_000, 299 * BLOCK + 1), parent=None)  # not a prefix
        keys = find_keys(as_token_array(q))
        assert s.match(q).snapshot_id == mid.snapshot_id
        # a stranger whose key equals the prompt's at its own (deepest) block: read, compared, passed over
        _set_key(s, other.snapshot_id, int(keys[299]))
        assert s.match(q).snapshot_id == mid.snapshot_id
        # a true prefix whose key equals the prompt's at a deeper block than its own: it must not be
        # taken in the deepest batch ahead of the longer true prefix at block 150
        _set_key(s, short.snapshot_id, int(keys[300]))
        assert s.match(q).snapshot_id == mid.snapshot_id
        # every candidate a collision: the exact check finds none
        _set_key(s, mid.snapshot_id, int(keys[299]))
        assert s.match(q) is None
        # and with its own key back, the longest prefix serves again
        _set_key(s, mid.snapshot_id, int(keys[150]))
        assert s.match(q).snapshot_id == mid.snapshot_id


def test_a_catalog_from_before_v8_is_keyed_on_open_and_matches_the_same(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "s")
    rng = np.random.default_rng(3)
    with _open(path) as s:
        prompts = _chains(s, rng)
        queries = [p[:k] for p in prompts for k in (50, 299, 700, 1100, len(p))] + [rng.integers(0, 50_000, 900)]
        before = [(m.snapshot_id, m.n_tokens) if (m := s.match(q)) is not None else None for q in queries]
        want = {sid: key for sid, (_n, key) in _stored(s).items()}
    assert any(b is not None for b in before) and any(b is None for b in before)
    c = apsw.Connection(os.path.join(path, "snapstore.db"))
    c.execute(UNDO_FIND_KEYS + "PRAGMA user_version = 7")
    c.close()
    with _open(path) as s:
        assert {sid: key for sid, (_n, key) in _stored(s).items()} == want  # backfilled, parents first
        after = [(m.snapshot_id, m.n_tokens) if (m := s.match(q)) is not None else None for q in queries]
        assert after == before
        longer = np.concatenate([prompts[0], rng.integers(0, 50_000, 700)])
        r = _save(s, longer)  # a delta over a backfilled link
        assert s.match(longer).snapshot_id == r.snapshot_id
        assert _stored(s)[r.snapshot_id][1] == _expected(s, r.snapshot_id, len(longer))
    c = apsw.Connection(os.path.join(path, "snapstore.db"))
    assert c.pragma("user_version") == LATEST_SCHEMA
    c.close()


def test_a_row_left_without_a_key_is_keyed_by_the_next_open(tmp_path: str) -> None:
    """An older snapstore that had the store open across the migration inserts rows without a key:
    a child saved over such a parent still gets the right key, and the next open keys the parent."""
    path = os.path.join(tmp_path, "s")
    q = np.random.default_rng(4).integers(0, 50_000, 3000)
    with _open(path) as s:
        p = _save(s, q[:1000])
        _set_key(s, p.snapshot_id, None)
        child = _save(s, q[:2600], parent=p.snapshot_id)
        assert _stored(s)[child.snapshot_id][1] == _expected(s, child.snapshot_id, 2600)
        assert s.match(q).snapshot_id == child.snapshot_id
    with _open(path) as s:
        assert _stored(s)[p.snapshot_id][1] == _expected(s, p.snapshot_id, 1000)
        assert s.match(q[:1500]).snapshot_id == p.snapshot_id


def test_a_wrapped_wide_token_never_matches_an_int32_segment(tmp_path: str) -> None:
    """A prompt token >= 2**31 whose low 32 bits equal a stored int32 token is not that token."""
    with _open(os.path.join(tmp_path, "s")) as s:
        toks = np.arange(1, 601, dtype=np.int64)
        r = _save(s, toks, parent=None)
        q = toks.copy()
        q[10] += 2**32
        assert s.match(q) is None
        assert s.match(toks).snapshot_id == r.snapshot_id


@pytest.mark.parametrize("kind", ["list", "int64", "uint64", "int32", "strided"])
def test_match_reads_the_prompt_in_place_and_answers_the_same(tmp_path: str, kind: str) -> None:
    base = np.random.default_rng(5).integers(0, 50_000, 1300)
    with _open(os.path.join(tmp_path, "s")) as s:
        r = _save(s, base[:1000])
        q: object = {"list": base.tolist(), "int64": base, "uint64": base.astype(np.uint64),
                     "int32": base.astype(np.int32), "strided": np.repeat(base, 2)[::2]}[kind]
        assert s.match(q).snapshot_id == r.snapshot_id  # type: ignore[arg-type]
    borrowed = as_token_array(base, borrow=True)
    assert borrowed.dtype == np.dtype("<u8") and np.shares_memory(borrowed, base)
    assert not np.shares_memory(as_token_array(base), base)  # saves keep their own copy
    with pytest.raises(ss.InvalidInputError):
        as_token_array(np.array([1, -1]), borrow=True)


def test_the_in_list_finds_what_carray_finds(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without apsw's carray (an older apsw, or an SQLite built without it) the keys go as an IN
    list of bound variables: the same candidates, the same answers."""
    from snapstore.catalog import queries as _catalog

    rng = np.random.default_rng(6)
    with _open(os.path.join(tmp_path, "s")) as s:
        prompts = _chains(s, rng)
        queries = [p[:k] for p in prompts for k in (50, 299, 700, 1100, len(p))] + [rng.integers(0, 50_000, 9000)]
        with_carray = [m.snapshot_id if (m := s.match(q)) is not None else None for q in queries]
        monkeypatch.setattr(_catalog, "_CARRAY", None)
        assert [m.snapshot_id if (m := s.match(q)) is not None else None for q in queries] == with_carray
    assert any(x is not None for x in with_carray)


def test_two_encoded_prompts_on_one_thread_never_share_a_buffer() -> None:
    """The compare buffer a thread reuses between matches is held by one Encoded at a time."""
    from snapstore._tokens import Encoded, encode_tokens, spells_prefix

    rng = np.random.default_rng(7)
    a, b = rng.integers(0, 50_000, 3000).astype("<u8"), rng.integers(0, 50_000, 3000).astype("<u8")
    segs = [(encode_tokens(a[:1000])[0], 4, 0, 1000), (encode_tokens(a[1000:2500])[0], 4, 1000, 2500)]
    for _ in range(2):  # the second round reuses the buffers the first gave back
        ea = Encoded(a)
        assert spells_prefix(segs, a, ea)
        eb = Encoded(b)
        assert not spells_prefix(segs, b, eb)  # b encoded while ea is alive
        assert spells_prefix(segs, a, ea)  # ea still holds a
        assert ea.width(4) is not eb.width(4)
        del ea, eb


def test_candidates_whose_own_tokens_differ_cost_no_chain_read(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every snapshot shorter than a block shares the empty prefix's key, and siblings ending in one
    block share theirs: each is a candidate, passed over on its own segment (read with it), never
    by reading its chain — and the one that matches reads its chain once (one statement)."""
    from snapstore.catalog import queries as _catalog

    reads: list[int] = []
    for name in ("chain_spells", "chain_links"):  # the one-statement check, and the exact one behind it
        orig = getattr(_catalog.Txn, name)
        monkeypatch.setattr(_catalog.Txn, name,
                            lambda self, sid, *a, orig=orig: reads.append(sid) or orig(self, sid, *a))
    rng = np.random.default_rng(8)
    with _open(os.path.join(tmp_path, "s")) as s:
        for _ in range(30):
            _save(s, rng.integers(0, 50_000, int(rng.integers(20, 250))), parent=None)  # key of the empty prefix
        trunk = rng.integers(0, 50_000, 1000)
        _save(s, trunk, parent=None)
        sibs = [np.concatenate([trunk, rng.integers(0, 50_000, 100)]) for _ in range(10)]  # all end in block 4
        ids = [_save(s, t).snapshot_id for t in sibs]
        reads.clear()
        assert s.match(rng.integers(0, 50_000, 5000)) is None
        assert reads == []
        m = s.match(np.concatenate([sibs[3], rng.integers(0, 50_000, 50)]))
        assert m.snapshot_id == ids[3] and reads == [ids[3]]


def test_the_catalog_is_read_through_a_memory_map_unless_turned_off(tmp_path: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection maps 256 MiB of the catalog (match() walks token blobs in overflow pages);
    SNAPSTORE_SQLITE_MMAP_MIB sets it, 0 reads through pread only; a malformed value is refused."""
    path = os.path.join(tmp_path, "s")
    with _open(path) as s:
        _save(s, np.arange(300), parent=None)
        assert s._repo.db.read(lambda c: c.pragma("mmap_size")) == 256 << 20
    for value, want in (("0", 0), ("64", 64 << 20)):
        monkeypatch.setenv("SNAPSTORE_SQLITE_MMAP_MIB", value)
        with _open(path) as s:
            assert s._repo.db.read(lambda c: c.pragma("mmap_size")) == want
            assert s.match(np.arange(400)) is not None
    monkeypatch.setenv("SNAPSTORE_SQLITE_MMAP_MIB", "lots")
    with pytest.raises(ss.ConfigError, match="SNAPSTORE_SQLITE_MMAP_MIB"):
        _open(path)


_ELEMENT = st.one_of(
    st.integers(-5, 2**64), st.integers(0, 600), st.booleans(), st.floats(allow_nan=False, width=32),
    # numpy scalars and 0-d arrays: their __index__ works (ints), is refused (floats) or raises (a
    # 0-d bool array), and the short path must leave every one of those to numpy's judgement
    st.integers(0, 600).map(np.int64), st.integers(0, 600).map(np.array), st.booleans().map(np.bool_),
    st.booleans().map(np.array), st.floats(0, 600, width=32).map(np.array))


@given(st.lists(_ELEMENT, max_size=12))
@example([1, np.array(True)])  # __index__ raises TypeError: numpy takes it as 1
@example([1, np.array(4.5)])
def test_a_list_of_ints_takes_the_short_path_and_judges_every_list_as_numpy_does(tokens: list[object]) -> None:
    """Python lists of ints skip numpy's per-element conversion (an engine's scheduler passes its
    prompt as a list on every lookup); every list — bools, floats, ints past int64, negatives,
    numpy scalars and 0-d arrays — is accepted or refused exactly as through numpy alone, with the
    same tokens."""
    from snapstore import _tokens

    def judged() -> object:
        try:
            return as_token_array(tokens).tolist()
        except ss.InvalidInputError as e:
            return type(e)

    fast = judged()
    real = _tokens._from_int_list
    try:
        _tokens._from_int_list = lambda t: None  # type: ignore[assignment]
        slow = judged()
    finally:
        _tokens._from_int_list = real  # type: ignore[assignment]
    assert fast == slow
    ints = [t for t in tokens if type(t) is int and 0 <= t < 2**63]
    if ints:
        assert as_token_array(ints).tolist() == ints and _tokens._from_int_list(ints) is not None
