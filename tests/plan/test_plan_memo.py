"""Issue 31: a store keeps the catalog rows it planned a committed snapshot from, per process, for
as long as the catalog generation (schema 13) it read them under stands — and never plans from
memory what another store or process deleted, quarantined, superseded or re-keyed since.

- a repeated restore reads the generation and nothing else of the catalog, and restores exactly;
- two stores on one catalog in one process (a vLLM scheduler and its worker) share the memo, and a
  store made again at the same path never gets the old catalog's rows (the catalog's nonce);
- every change a plan depends on moves the generation (raw SQL on the real catalog, table-driven),
  what a save adds and a restore's bookkeeping do not;
- a reference: a store planning from memory and one reading the catalog each time give the same
  answer (bytes, or the same error, untouched destination alike) after any sequence of saves,
  deletes, quarantines, supersedes, heals and evictions made by the other;
- another process's `snapstore verify --deep --repair` and `snapstore gc`: the next restore refuses at the
  plan, nothing written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import apsw
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.profile import examples
from support.statements import statements

import snapstore as ss
from snapstore.catalog.chain_cache import ChainCache

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
HERE_DIR = os.path.dirname(os.path.abspath(__file__))  # this module's folder: a child process imports it by name

BLOCK = 4  # tokens per link step (one row per token: the layout has a fixed part)
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 16))}, fixed={"h": ss.Fixed("float32", (4,))})
IDENT = ss.Identity(build="t", pack="p", kv="u8")


def _open(path: Any, memo: bool = True, max_entries: int | None = None, layout: ss.Layout = LAYOUT) -> ss.Store:
    s = ss.Store.open(str(path), identity=IDENT, layout=layout,
                      budget=ss.Budget(reserve_bytes=0, ram_bytes=0, max_entries=max_entries))
    if not memo:  # this store alone plans from the catalog every time
        s._repo.plans = ChainCache(enabled=False)
    return s


def _state(tokens: list[int], seed: int) -> dict[str, np.ndarray]:
    rows = len(tokens)
    rng = np.random.default_rng(seed)
    return {"kv": rng.integers(0, 256, (rows, 2, 16), dtype=np.uint8),
            "h": rng.standard_normal(4).astype(np.float32)}


def _chain(s: ss.Store, tokens: list[int], links: int, seed: int = 0, session: str | None = None) -> int:
    """Save ``tokens`` as a chain of ``links`` snapshots; the leaf's id."""
    state = _state(tokens, seed)
    steps = len(tokens) // BLOCK
    sid = 0
    for b in sorted({max(1, steps * (i + 1) // links) for i in range(links)}):
        res = s.save(tokens[:b * BLOCK], state, rows=b * BLOCK, parent="auto", session=session)
        assert res.ok and res.snapshot_id is not None, res
        sid = res.snapshot_id
    return sid


def _gen(path: Any) -> int:
    c = apsw.Connection(os.path.join(str(path), "snapstore.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return int(c.execute("SELECT gen FROM catalog_gen").fetchone()[0])
    finally:
        c.close()


def _set_gen(db_path: str, gen: int) -> None:
    c = apsw.Connection(db_path)
    c.execute("UPDATE catalog_gen SET gen = ?", (gen,))
    c.close()


def _dest() -> dict[str, np.ndarray]:
    return {"kv": np.full((256, 2, 16), 7, np.uint8), "h": np.full(4, 7, np.float32)}


def _restored(s: ss.Store, sid: int) -> tuple[str, Any]:
    """What restoring ``sid`` gives: ("ok", rows, the bytes) or ("error", its class, touched, dest unchanged)."""
    into = _dest()
    try:
        rows = s.describe(sid).rows.get("kv", 0)
        res = s.restore(sid, {"kv": into["kv"][:rows], "h": into["h"]})
    except ss.SnapstoreError as e:
        untouched = bool((into["kv"] == 7).all() and (into["h"] == 7).all())
        return "error", (type(e).__name__, getattr(e, "touched", None), untouched)
    return "ok", (res.n_tokens, res.chain, into["kv"].tobytes(), into["h"].tobytes())


def _described(s: ss.Store, sid: int) -> tuple[str, Any]:
    try:
        d = s.describe(sid)
    except ss.SnapstoreError as e:
        return "error", type(e).__name__
    return "ok", (d.n_tokens, d.rows, d.chain, d.components, d.missing_components, d.nbytes, d.pending)


def test_a_repeated_restore_plans_from_memory(tmp_path: Any) -> None:
    """The second restore of a 12-link chain reads the generation only (BEGIN, gen, COMMIT), and
    writes the same bytes; a lookup's describe half is served the same way."""
    tokens = list(range(10, 10 + 48 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 12)
        want = _state(tokens, 0)
        s.restore(sid, {"kv": np.zeros_like(want["kv"]), "h": np.zeros(4, np.float32)})  # planned, kept
        hits = s._repo.plans.hits
        dst = {"kv": np.zeros_like(want["kv"]), "h": np.zeros(4, np.float32)}
        with statements(s) as seen:
            s.restore(sid, dst)
        assert np.array_equal(dst["kv"], want["kv"]) and np.array_equal(dst["h"], want["h"])
        assert seen[:seen.index("COMMIT") + 1] == ["BEGIN", "SELECT nonce, gen FROM catalog_gen WHERE id = 1",
                                                   "COMMIT"]
        assert s._repo.plans.hits == hits + 1
        s.lookup(tokens)
        with statements(s) as lk:
            d = s.lookup(tokens)
        assert d is not None and d.snapshot_id == sid and d.n_tokens == len(tokens)
        with statements(s) as match_only:
            s.match(tokens)
        # the generation, no plan reads, and the hit's links and row from the kept chain, not the
        # catalog (issue 48): two statements fewer than match(), which reads them (chain_spells, snapshot)
        assert len(lk) == len(match_only) - 1, (lk, match_only)
        assert [q for q in lk if "catalog_gen" in q or q.startswith(("WITH RECURSIVE", "SELECT id, identity_id"))] \
            == ["SELECT nonce, gen FROM catalog_gen WHERE id = 1"], lk


def test_a_read_only_store_plans_from_the_catalog(tmp_path: Any) -> None:
    """No triggers guard a file another program may swap under a read-only open: no memo there."""
    tokens = list(range(10, 10 + 8 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 2)
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT, read_only=True) as r:
        assert not r._repo.plans.enabled
        for _ in range(2):
            dst = _dest()
            r.restore(sid, {"kv": dst["kv"][:len(tokens)], "h": dst["h"]})
            assert np.array_equal(dst["kv"][:len(tokens)], _state(tokens, 0)["kv"])


def test_stores_on_one_catalog_in_one_process_share_the_memo(tmp_path: Any, monkeypatch: Any) -> None:
    """A vLLM scheduler's lookup and its worker's load run in one process through two stores (each
    with its own, equal layout): the load plans from what the lookup read and checked."""
    from snapstore.restore import read

    tokens = list(range(10, 10 + 24 * BLOCK))
    with _open(tmp_path / "s") as saver:
        sid = _chain(saver, tokens, 6)
    equal = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 16))}, fixed={"h": ss.Fixed("float32", (4,))})
    assert equal == LAYOUT and equal is not LAYOUT
    with _open(tmp_path / "s") as scheduler, _open(tmp_path / "s", layout=equal) as worker:
        d = scheduler.lookup(tokens)
        assert d is not None and d.snapshot_id == sid
        hits = worker._repo.plans.hits
        dst = _dest()
        monkeypatch.setattr(read, "check_plan", lambda *a, **k: pytest.fail("checked again"))
        with statements(worker) as seen:
            worker.restore(sid, {"kv": dst["kv"][:len(tokens)], "h": dst["h"]})
        assert worker._repo.plans.hits == hits + 1
        assert seen[:seen.index("COMMIT") + 1] == ["BEGIN", "SELECT nonce, gen FROM catalog_gen WHERE id = 1",
                                                   "COMMIT"]
        want = _state(tokens, 0)
        assert np.array_equal(dst["kv"][:len(tokens)], want["kv"]) and np.array_equal(dst["h"], want["h"])


def test_a_store_made_again_at_the_same_path_is_never_planned_from_the_old_ones_rows(tmp_path: Any) -> None:
    """A store open at a path keeps the memo alive; the directory is removed and a new store made
    there, whose snapshot 1 is another state and whose generation reaches the old one's. Its
    restore of snapshot 1 gives its own state: the catalogs' nonces differ."""
    import shutil

    x_tokens, y_tokens = list(range(10, 10 + 8 * BLOCK)), list(range(50, 50 + 8 * BLOCK))
    old = _open(tmp_path / "s")
    try:
        assert _chain(old, x_tokens, 1, seed=1) == 1
        _set_gen(old._repo.db_path, 5)
        assert _restored(old, 1)[0] == "ok"  # snapshot 1's rows kept, at generation 5
        shutil.rmtree(tmp_path / "s")
        with _open(tmp_path / "s") as new:
            assert new._repo.plans is old._repo.plans
            assert _chain(new, y_tokens, 1, seed=2) == 1
            assert _chain(new, x_tokens, 1, seed=1) == 2  # the old snapshot 1's chunk files exist again
            _set_gen(new._repo.db_path, 5)  # the new catalog at the same generation
            dst = _dest()
            new.restore(1, {"kv": dst["kv"][:len(y_tokens)], "h": dst["h"]})
            assert np.array_equal(dst["kv"][:len(y_tokens)], _state(y_tokens, 2)["kv"])
            assert np.array_equal(dst["h"], _state(y_tokens, 2)["h"])
    finally:
        old.close()


# (what the change does to the catalog, does it move the generation)
_CHANGES: list[tuple[str, Callable[[apsw.Connection, int, bytes], object], bool]] = [
    ("delete a committed snapshot", lambda c, sid, cid: c.execute("DELETE FROM snapshots WHERE id = ?", (sid,)), True),
    ("supersede it (not matchable)", lambda c, sid, cid: c.execute(
        "UPDATE snapshots SET matchable = 0 WHERE id = ?", (sid,)), True),
    ("use it outside its session", lambda c, sid, cid: c.execute(
        "UPDATE snapshots SET shared = 1 WHERE id = ?", (sid,)), True),
    ("move it to another namespace", lambda c, sid, cid: c.execute(
        "UPDATE snapshots SET namespace = 'x' WHERE id = ?", (sid,)), True),
    ("quarantine a chunk", lambda c, sid, cid: c.execute(
        "UPDATE chunks SET quarantined = 1.0 WHERE id = ?", (cid,)), True),
    ("republish a chunk in another codec", lambda c, sid, cid: c.execute(
        "UPDATE chunks SET codec = codec, stored_len = stored_len WHERE id = ?", (cid,)), True),
    ("delete a chunk row", lambda c, sid, cid: c.execute("DELETE FROM chunks WHERE id = ?", (cid,)), True),
    ("resize a part", lambda c, sid, cid: c.execute(
        "UPDATE parts SET nbytes = nbytes + 1 WHERE snapshot_id = ?", (sid,)), True),
    ("delete a part", lambda c, sid, cid: c.execute(
        "DELETE FROM parts WHERE snapshot_id = ? AND kind = 0", (sid,)), True),
    ("drop a chunk reference", lambda c, sid, cid: c.execute(
        "DELETE FROM part_chunks WHERE snapshot_id = ? AND chunk_id = ?", (sid, cid)), True),
    ("point a reference elsewhere", lambda c, sid, cid: c.execute(
        "UPDATE part_chunks SET seq = seq + 100 WHERE snapshot_id = ?", (sid,)), True),
    ("re-key its identity", lambda c, sid, cid: c.execute(
        "UPDATE identities SET key = key || 'x' WHERE id = (SELECT identity_id FROM snapshots WHERE id = ?)",
        (sid,)), True),
    ("delete an identity row", lambda c, sid, cid: c.execute(
        "DELETE FROM identities WHERE id = (SELECT identity_id FROM snapshots WHERE id = ?)", (sid,)), True),
    ("record a restore's last use and hit", lambda c, sid, cid: c.execute(
        "UPDATE snapshots SET last_used = last_used + 1, hits = hits + 1 WHERE id = ?", (sid,)), False),
    ("count a reference", lambda c, sid, cid: c.execute("UPDATE chunks SET refs = refs + 1 WHERE id = ?", (cid,)),
     False),
    ("refresh an identity's last open", lambda c, sid, cid: c.execute(
        "UPDATE identities SET last_open = last_open + 1"), False),
]


@pytest.mark.parametrize(("change", "fn", "moves"), _CHANGES, ids=[c[0] for c in _CHANGES])
def test_the_generation_moves_with_what_a_plan_reads(tmp_path: Any, change: str,
                                                     fn: Callable[[apsw.Connection, int, bytes], object],
                                                     moves: bool) -> None:
    tokens = list(range(10, 10 + 8 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 2)
    before = _gen(tmp_path / "s")
    c = apsw.Connection(os.path.join(str(tmp_path / "s"), "snapstore.db"))
    c.execute("PRAGMA foreign_keys = OFF")
    cid = bytes(c.execute("SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? AND name = 'kv'",
                          (sid,)).fetchone()[0])
    fn(c, sid, cid)
    c.close()
    assert (_gen(tmp_path / "s") > before) is moves, change


def test_saves_and_restores_leave_the_generation(tmp_path: Any) -> None:
    """What a save adds (a pending row, its parts and references, its commit, deduplicated chunks)
    and a restore's bookkeeping keep every kept plan valid: the serving path keeps its memo."""
    tokens = list(range(10, 10 + 16 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens[:8 * BLOCK], 2)
        before = _gen(tmp_path / "s")
        longer = _chain(s, tokens, 3)  # a delta over the stored chain, deduplicating its chunks
        dst = _dest()
        for _ in range(3):
            s.restore(sid, {"kv": dst["kv"][:8 * BLOCK], "h": dst["h"]})
            s.restore(longer, {"kv": dst["kv"][:16 * BLOCK], "h": dst["h"]})
        s.stats()  # the bookkeeping written
        assert _gen(tmp_path / "s") == before
        hits = s._repo.plans.hits
        s.restore(sid, {"kv": dst["kv"][:8 * BLOCK], "h": dst["h"]})
        assert s._repo.plans.hits == hits + 1


@settings(max_examples=examples(30, dev=12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["save", "session", "delete", "quarantine", "heal", "evict"]),
                              st.integers(0, 1 << 16)), min_size=1, max_size=8))
def test_a_memo_plans_as_the_catalog_does(tmp_path_factory: Any, ops: list[tuple[str, int]]) -> None:
    """Reference: store A plans from memory, store B (the same directory) from the catalog every
    time and makes every change. After each change, every snapshot ever saved restores (and is
    described) the same through A as through B: the same bytes, or the same error with the
    destination untouched alike."""
    path = tmp_path_factory.mktemp("memo")
    a, b = _open(path, memo=True), _open(path, memo=False)
    known: list[int] = []
    try:
        for op, r in ops:
            toks = [10 + (r % 3)] * BLOCK + list(range(20, 20 + 4 * (r % 5 + 1) * BLOCK))
            if op == "save":
                known.append(_chain(b, toks, r % 3 + 1, seed=r))
            elif op == "session":  # a longer turn of one session supersedes the earlier one
                known.append(_chain(b, toks[:4 * BLOCK], 1, seed=r, session="chat"))
                known.append(_chain(b, toks, 2, seed=r, session="chat"))
            elif op == "delete" and known:
                try:
                    b.delete(known[r % len(known)])
                except ss.SnapstoreError:
                    pass  # already gone with an ancestor
            elif op in ("quarantine", "heal") and known:
                conn = b._repo.db.conn()
                row = conn.execute("SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? ORDER BY seq",
                                   (known[r % len(known)],)).fetchone()
                if row is not None:
                    conn.execute("UPDATE chunks SET quarantined = ? WHERE id = ?",
                                 (1.0 if op == "quarantine" else None, bytes(row[0])))
            elif op == "evict":  # another store's budget: its gc evicts the least recently used
                with _open(path, memo=False, max_entries=r % 3 + 1) as c:
                    c.gc(grace=0)
            for sid in known:  # A plans (and keeps) every snapshot after each change
                assert _described(a, sid) == _described(b, sid), (op, sid)
                assert _restored(a, sid) == _restored(b, sid), (op, sid)
    finally:
        a.close()
        b.close()


def _damage_a_chunk_of(s: ss.Store, link: int) -> None:
    """Overwrite the last 3 bytes of the chunk file of snapshot ``link``'s first kv chunk."""
    row = s._repo.db.conn().execute("SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? AND name = 'kv'",
                                    (link,)).fetchone()
    blob = s._repo.blob_path(bytes(row[0]))
    os.chmod(blob, 0o600)
    with open(blob, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")


def _cli(path: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "snapstore", "--dir", str(path), *args],
                          capture_output=True, text=True, timeout=120, check=False)


_RESTORE_ELSEWHERE = """
import os, sys
sys.path[:0] = sys.argv[1].split(os.pathsep)
import test_plan_memo as t
with t._open(sys.argv[2]) as s:
    print(t._restored(s, int(sys.argv[3])))
"""


def test_another_process_finding_damage_is_seen_at_the_plan(tmp_path: Any) -> None:
    """A chain restored, then planned from memory. A chunk file of it is damaged, and a restore in
    another process finds it (checksum) and quarantines the chunk. The next restore here is refused
    at the plan — nothing written — not after the damaged bytes landed in the destination."""
    tokens = list(range(10, 10 + 24 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 4)
        ok = _restored(s, sid)
        hits = s._repo.plans.hits
        assert ok[0] == "ok" and _restored(s, sid) == ok and s._repo.plans.hits > hits  # from memory
        _damage_a_chunk_of(s, s.describe(sid).chain[2])
        res = subprocess.run([sys.executable, "-c", _RESTORE_ELSEWHERE, os.pathsep.join([TESTS_DIR, HERE_DIR]),
                              str(tmp_path / "s"), str(sid)], capture_output=True, text=True, timeout=120,
                             check=True)
        assert "CorruptChunkError" in res.stdout, res.stdout + res.stderr
        assert _restored(s, sid) == ("error", ("CorruptChunkError", False, True))


def test_another_process_repairing_or_evicting_is_seen_at_the_plan(tmp_path: Any) -> None:
    """Two chains restored, then planned from memory. `snapstore verify --deep --repair` in another
    process finds a damaged chunk file of one and drops what used it: its next restore is refused at
    the plan (nothing written), not after its bytes landed. `snapstore gc --disk-mib 0` in another
    process evicts the other: its next restore says it no longer exists, nothing written."""
    tokens = list(range(10, 10 + 24 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 4)
        other = _chain(s, [7, *tokens[1:]], 3, seed=5)
        for x in (sid, other):
            ok = _restored(s, x)
            assert ok[0] == "ok"
            hits = s._repo.plans.hits
            assert _restored(s, x) == ok
            assert s._repo.plans.hits > hits  # planned from memory
        _damage_a_chunk_of(s, s.describe(sid).chain[1])
        res = _cli(tmp_path / "s", "verify", "--deep", "--repair")
        assert res.returncode == 1, res.stdout + res.stderr
        assert _restored(s, sid) == ("error", ("SnapshotUnavailableError", False, True))
        assert _restored(s, other)[0] == "ok"
        res = _cli(tmp_path / "s", "gc", "--disk-mib", "0")
        assert res.returncode == 0, res.stdout + res.stderr
        assert _restored(s, other) == ("error", ("SnapshotUnavailableError", False, True))


def test_warm_up_plans_the_most_recently_used_snapshots(tmp_path: Any) -> None:
    """After a restart, warm_up plans the identity's most recently used snapshots into the memo:
    the first lookup and restore of one of them read the generation and nothing else of the plan;
    a snapshot used longer ago than the PLANNED most recent ones is planned from the catalog."""
    import gc

    from snapstore.store.warm import PLANNED

    prompts = [[i, *range(100, 100 + 8 * BLOCK)] for i in range(PLANNED + 1)]
    with _open(tmp_path / "s") as s:
        ids = [_chain(s, p, 2, seed=i) for i, p in enumerate(prompts)]
        for sid in reversed(ids):  # the first prompt is the most recently used, the last one the least
            assert _restored(s, sid)[0] == "ok"
        s.stats()  # the last uses written
    del s
    gc.collect()  # the memo goes with the last store on the catalog
    with _open(tmp_path / "s") as s:
        memo = s._repo.plans
        assert not memo._entries
        s.warm_up()
        assert len(memo._entries) == PLANNED
        hits = memo.hits
        d = s.lookup(prompts[0])
        assert d is not None and d.snapshot_id == ids[0] and memo.hits == hits + 1
        assert _restored(s, ids[0]) == _restored(_open(tmp_path / "s", memo=False), ids[0])
        hits = memo.hits
        d = s.lookup(prompts[-1])
        assert d is not None and d.snapshot_id == ids[-1] and memo.hits == hits  # not planned: read


def test_a_kept_plan_still_checks_every_destination_and_each_request(tmp_path: Any, monkeypatch: Any) -> None:
    """The checked half of a plan is kept per (components, rows_from, prefix) with its rows; each
    restore still checks its own destinations before a byte is written, and another rows_from is
    checked on its own, restoring exactly what the catalog's plan restores."""
    from snapstore.restore import read

    tokens = list(range(10, 10 + 24 * BLOCK))
    n = len(tokens)
    want = _state(tokens, 0)
    with _open(tmp_path / "s") as s, _open(tmp_path / "s", memo=False) as ref:
        sid = _chain(s, tokens, 6)
        assert _restored(s, sid)[0] == "ok"
        checks: list[int] = []
        real = read.check_plan
        monkeypatch.setattr(read, "check_plan", lambda *a, **k: checks.append(1) or real(*a, **k))
        dst = _dest()
        s.restore(sid, {"kv": dst["kv"][:n], "h": dst["h"]})
        assert checks == [] and np.array_equal(dst["kv"][:n], want["kv"])  # checked before: kept
        bad = {"kv": np.full((n, 2, 16), 7, np.int16), "h": np.full(4, 7, np.float32)}
        with pytest.raises(ss.DestinationError) as e:
            s.restore(sid, bad)
        assert not e.value.touched and (bad["kv"] == 7).all() and (bad["h"] == 7).all()
        with pytest.raises(ss.DestinationError):
            s.restore(sid, {"kv": dst["kv"][:n]})  # no destination for "h"
        got = {k: _dest() for k in (0, 5, n - 3)}
        for k, d in [*got.items(), (5, got[5])]:
            s.restore(sid, {"kv": d["kv"][:n], "h": d["h"]}, rows_from=k)
        assert len(checks) == 2  # rows_from 5 and n - 3 checked once each (0 was kept, then 5)
        for k, d in got.items():
            exp = _dest()
            ref.restore(sid, {"kv": exp["kv"][:n], "h": exp["h"]}, rows_from=k)
            assert np.array_equal(d["kv"], exp["kv"]) and np.array_equal(d["h"], exp["h"]), k
            assert (d["kv"][:k] == 7).all() and np.array_equal(d["kv"][k:n], want["kv"][k:])


def test_a_catalog_without_its_generation_row_plans_from_the_catalog(tmp_path: Any) -> None:
    """The counter's row gone (a damaged catalog): nothing vouches for kept rows, so none are used
    or kept, and restores still plan (from the catalog) and restore exactly."""
    tokens = list(range(10, 10 + 8 * BLOCK))
    with _open(tmp_path / "s") as s:
        sid = _chain(s, tokens, 2)
        c = apsw.Connection(s._repo.db_path)
        c.execute("DELETE FROM catalog_gen")
        c.close()
        hits = s._repo.plans.hits
        first = _restored(s, sid)
        assert first[0] == "ok" and _restored(s, sid) == first
        assert s._repo.plans.hits == hits
