"""Issue 9, identity and API: identity ids across rollbacks, commit refusal, errors that stay
snapstore errors, restores that never wait for the write lock, close() racing other threads,
and the engine-facing API (delete, describe, match exclude). Real SQLite, files and threads."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import apsw
import numpy as np
import pytest
from support import IDENT, LAYOUT, empty_like_state, make_state, open_store, part_hashes

import snapstore as ss
from snapstore.catalog import db as _db
from snapstore.lifecycle.bookkeeping import USE_EVERY_S
from snapstore.store import store as _store

FIXED_ONLY = ss.Layout(fixed={"state": ss.Fixed("float32", (4, 4))})


def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def catalog(path: str) -> apsw.Connection:
    """A second, independent connection to a store's catalog (another writer)."""
    c = apsw.Connection(os.path.join(path, "snapstore.db"))
    c.set_busy_timeout(10_000)
    return c


# -- item 1: identity ids ------------------------------------------------------------------------

def test_identity_id_of_a_rolled_back_save_is_never_handed_to_another_identity(store_dir: str) -> None:
    """The issue's scenario: A open (drop_stale=False); B drops A's identity row; A's next save
    re-creates it and is skipped (rolled back); C opens. A must never match or restore C's state."""
    ia, ib, ic = (ss.Identity(build=b, pack="p") for b in ("eng-a", "eng-b", "eng-c"))
    a = open_store(store_dir, identity=ia, drop_stale=False,
                   budget=ss.Budget(reserve_bytes=0, max_entries=0))  # every commit of A is skipped
    b = open_store(store_dir, identity=ib, drop_stale=True)  # deletes A's identity row (no snapshots)
    state_a = make_state(LAYOUT, 40, seed=1)
    skipped = a.save(toks(40), state_a)
    assert skipped.skipped == "max_entries"  # its transaction rolled back
    c = open_store(store_dir, identity=ic, drop_stale=False)
    state_c = make_state(LAYOUT, 40, seed=2)
    rc = c.save(toks(40), state_c)
    assert rc.ok

    assert a.match(toks(40)) is None
    assert a.match(toks(41)) is None
    assert all(i.snapshot_id != rc.snapshot_id for i in a.snapshots())
    dest = empty_like_state(state_c)
    with pytest.raises(ss.IdentityError):
        a.restore(rc.snapshot_id, dest)
    assert all(not v.any() for v in dest.values())  # nothing of C's state written into A's engine
    with pytest.raises(ss.IdentityError):
        a.describe(rc.snapshot_id)
    with pytest.raises(ss.IdentityError):
        a.delete(rc.snapshot_id)
    with pytest.raises(ss.IdentityError):
        a.save(toks(50), make_state(LAYOUT, 50), parent=rc.snapshot_id)

    # every identity has its own id: A's row (re-created for its save) committed on its own
    ids = dict(c._repo.db.read(lambda conn: [(k, i) for i, k, *_ in conn.identities()]))
    assert ids[ia.key] != ids[ic.key]
    for s in (a, b, c):
        s.close()


def test_a_snapshot_whose_identity_row_names_another_key_is_never_served(store_dir: str) -> None:
    """Match and restore check the identity *key*: a snapshot row pointing at an id that now
    names another identity (an old writer's rollback, a damaged row) stays invisible."""
    ia, ic = ss.Identity(build="eng-a", pack="p"), ss.Identity(build="eng-c", pack="p")
    a = open_store(store_dir, identity=ia, drop_stale=False)
    c = open_store(store_dir, identity=ic, drop_stale=False)
    st_ = make_state(LAYOUT, 30, seed=3)
    rc = c.save(toks(30), st_)
    c.close()
    ida = a._repo.db.read(lambda conn: conn.identity_id(ia.key))
    # what a reused row id amounts to: C's snapshot row now carries A's identity id
    a._repo.db.write(lambda conn: conn.execute("UPDATE snapshots SET identity_id = ? WHERE id = ?",
                                               (ida, rc.snapshot_id)))
    a._repo.db.write(lambda conn: conn.execute("UPDATE identities SET key = ? WHERE id = ?",
                                               ("id-" + "0" * 32, ida)))
    assert a.match(toks(30)) is None
    with pytest.raises(ss.IdentityError):
        a.restore(rc.snapshot_id, empty_like_state(st_))
    a.close()


# -- item 9: commit refusal ----------------------------------------------------------------------

def test_refused_commit_drops_its_own_subtree_and_nothing_else(store_dir: str) -> None:
    s = open_store(store_dir, budget=ss.Budget(reserve_bytes=0, max_entries=1))
    t = toks(600)
    sibling_tokens = t[:300] + toks(300, base=90_000)
    big = make_state(LAYOUT, 610, 1)  # buffers hold more rows than each save's tokens
    p = s.save(t[:300], big, commit=False, parent=None)
    x = s.save(t, big, commit=False, parent=p.snapshot_id)
    x_child = s.save(t + [5] * 10, big, commit=False, parent=x.snapshot_id)
    y = s.save(sibling_tokens, big, commit=False, parent=p.snapshot_id)
    assert all(r.pending for r in (p, x, x_child, y))

    refused = s.commit(x)  # P and X would be 2 entries with max_entries=1
    assert refused.skipped == "max_entries" and refused.snapshot_id is None
    left = {i.snapshot_id: i for i in s.snapshots()}
    assert x.snapshot_id not in left and x_child.snapshot_id not in left  # the refused one and its children
    assert left[p.snapshot_id].pending and left[y.snapshot_id].pending  # ancestor and sibling untouched
    assert s.match(t) is None

    # the sibling the engine never asked to commit still restores, and commits in its own right
    dest = empty_like_state(make_state(LAYOUT, 600))
    assert s.restore(y, dest).n_tokens == 600
    s.abandon(p)  # drops p and y: a clean budget for the next check
    assert s.snapshots() == []
    s.close()


# -- item 10: every failure a SnapstoreError -----------------------------------------------------

def test_snapshot_ids_beyond_int64_are_snapstore_errors(store: ss.Store) -> None:
    r = store.save([1, 2, 3], make_state(LAYOUT, 3))
    for bad in (2**63, 2**64 + 5, -(2**63) - 1):
        with pytest.raises(ss.InvalidInputError, match="out of range"):
            store.restore(bad, empty_like_state(make_state(LAYOUT, 3)))
        with pytest.raises(ss.InvalidInputError):
            store.commit(bad)
        with pytest.raises(ss.InvalidInputError):
            store.abandon(bad)
        with pytest.raises(ss.InvalidInputError):
            store.delete(bad)
        with pytest.raises(ss.InvalidInputError):
            store.describe(bad)
        with pytest.raises(ss.InvalidInputError):
            store.save([1, 2, 3, 4], make_state(LAYOUT, 4), parent=bad)
        with pytest.raises(ss.InvalidInputError):
            store.match([1, 2, 3], exclude=[bad])
    assert store.match([1, 2, 3]).snapshot_id == r.snapshot_id  # type: ignore[union-attr]


@pytest.mark.slow  # 8.4M tokens hashed and matched
def test_prompts_beyond_sqlites_variable_limit_match_and_pick_a_parent(store_dir: str) -> None:
    """8.4M tokens = more than 32766 block anchors: once `too many SQL variables`."""
    n = 8_400_000
    t = np.arange(n, dtype=np.int64) % 150_000
    st_ = {"state": np.arange(16, dtype=np.float32).reshape(4, 4)}
    with open_store(store_dir, layout=FIXED_ONLY) as s:
        short = s.save(t[:300], st_)
        assert short.ok
        long = s.save(t, st_, parent="auto")  # the auto parent is looked up over all anchors
        assert long.ok and long.parent_id == short.snapshot_id
        m = s.match(np.concatenate([t, [7]]))
        assert m is not None and m.snapshot_id == long.snapshot_id and m.n_tokens == n
        fallback = s.match(np.concatenate([t, [7]]), exclude=[m])
        assert fallback is not None and fallback.snapshot_id == short.snapshot_id
        assert s.match(np.concatenate([t[:n - 1], [t[n - 1] + 1]])).snapshot_id == short.snapshot_id  # type: ignore[union-attr]


class _FailingWriter:
    """A restore destination (PartWriter) whose device fails after the first write."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.mem = bytearray(nbytes)
        self.calls = 0

    def write_from(self, offset: int, data: memoryview) -> None:
        self.calls += 1
        if self.calls > 1:
            raise ValueError("device lost")
        self.mem[offset:offset + len(data)] = data


def test_a_part_writer_that_raises_is_a_touched_restore_error(store: ss.Store) -> None:
    n = 400  # attn.kv: 400 rows x 128 B = 50 KiB: several 4 KiB chunks, so several writes
    st_ = make_state(LAYOUT, n, 4)
    r = store.save(toks(n), st_)
    dest: dict[str, Any] = empty_like_state(st_)
    dest["attn.kv"] = _FailingWriter(n * LAYOUT.rows["attn.kv"].row_bytes)
    with pytest.raises(ss.RestoreError) as ei:
        store.restore(r, dest)
    assert ei.value.touched is True
    assert isinstance(ei.value.__cause__, ValueError) and "device lost" in str(ei.value)
    assert ei.value.snapshot_id == r.snapshot_id
    # the store is fine and the next restore into a working destination is exact
    dest2 = empty_like_state(st_)
    assert part_hashes(LAYOUT, dest2, store.restore(r, dest2).rows) == part_hashes(LAYOUT, st_, {
        "attn.kv": n, "mtp.kv": n})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_budget_refuses_nan_and_infinity(bad: float) -> None:
    for field in ("disk_bytes", "ram_bytes", "max_entries", "ttl", "reserve_bytes"):
        with pytest.raises(ss.ConfigError, match="finite"):
            ss.Budget(**{field: bad})


def test_dedup_lookup_retries_while_another_process_holds_the_database(store_dir: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunker's `is this chunk known?` look-up runs in the busy-retry loop like every
    transaction: a lock longer than one busy timeout is waited out, not raised as apsw.BusyError."""
    monkeypatch.setattr(_db, "_BUSY_TIMEOUT_MS", 50)
    box: dict[str, ss.Store] = {}
    opener = threading.Thread(target=lambda: box.update(s=open_store(store_dir)))
    opener.start()
    opener.join()
    gc.collect()
    s = box["s"]
    assert len(s._repo.db._all) == 0  # the opening thread's connection closed with the thread
    holder = catalog(store_dir)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO counters(name, value) VALUES ('probe', 1) "
                   "ON CONFLICT(name) DO UPDATE SET value = value + 1")
    holder.execute("COMMIT")  # exclusive locking mode: the file stays locked until close
    release = threading.Timer(0.6, holder.close)
    release.start()
    try:
        t0 = time.monotonic()
        assert s._chunker._state(bytes(32)) == 0  # the look-up the chunker makes for every chunk
        assert time.monotonic() - t0 >= 0.4
    finally:
        release.join()
    assert s.save(toks(5), make_state(LAYOUT, 5)).ok
    s.close()


def test_every_apsw_error_leaves_as_a_snapstore_error() -> None:
    assert isinstance(_db.translate(apsw.BusyError("database is locked")), ss.StoreIOError)
    assert isinstance(_db.translate(apsw.SQLError("too many SQL variables")), ss.SnapstoreError)


def test_open_with_an_empty_path_is_a_config_error(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for bad in ("", "   "):
        with pytest.raises(ss.ConfigError, match="empty"):
            ss.Store.open(bad, identity=IDENT, layout=LAYOUT)
    with pytest.raises(ss.ConfigError):
        ss.Store.open(b"/tmp/x", identity=IDENT, layout=LAYOUT)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []  # nothing created in the current directory


def test_big_endian_arrays_do_not_pass_as_the_layouts_little_endian_dtype(store: ss.Store) -> None:
    st_ = make_state(LAYOUT, 10, 5)
    swapped = dict(st_, **{"attn.kv": st_["attn.kv"].astype(">f2")})
    assert swapped["attn.kv"].dtype.name == "float16"  # numpy's name hides the byte order
    with pytest.raises(ss.LayoutError, match="big-endian"):
        store.save(toks(10), swapped)
    with pytest.raises(ss.LayoutError, match="big-endian"):
        store.save(toks(10), dict(st_, **{"attn.kv": memoryview(st_["attn.kv"].astype(">f2"))}))
    r = store.save(toks(10), st_)
    dest = empty_like_state(st_)
    dest["attn.kv"] = dest["attn.kv"].astype(">f2")
    with pytest.raises(ss.DestinationError, match="big-endian") as ei:
        store.restore(r, dest)
    assert ei.value.touched is False
    little = dict(st_, **{"attn.kv": st_["attn.kv"].astype("<f2")})  # explicit '<' is the canonical order
    assert store.save(toks(10), little).snapshot_id == r.snapshot_id


# -- item 11 (part): restore never waits for the write lock; post-commit unlink ---------------------

def test_restore_does_not_wait_for_a_long_writer_to_record_last_use(store_dir: str) -> None:
    s = open_store(store_dir)
    st_ = make_state(LAYOUT, 50, 6)
    r = s.save(toks(50), st_)
    before = {i.snapshot_id: i for i in s.snapshots()}[r.snapshot_id]
    writer = catalog(store_dir)
    writer.execute("BEGIN IMMEDIATE")  # a long writer (another process's big save) holds the lock
    # it commits once the three restores are done, or after 4 s if they queue behind it (the old code)
    release = threading.Timer(4.0, lambda: writer.execute("COMMIT"))
    release.start()
    try:
        dest = empty_like_state(st_)
        t0 = time.monotonic()
        for _ in range(3):
            s.restore(s.match(toks(50)), dest)
        assert time.monotonic() - t0 < 2.0  # before: each restore queued behind the writer
        assert writer.in_transaction  # all three ran while the writer held the lock
        assert part_hashes(LAYOUT, dest, {"attn.kv": 50, "mtp.kv": 50}) == part_hashes(
            LAYOUT, st_, {"attn.kv": 50, "mtp.kv": 50})
    finally:
        release.cancel()
        release.join()
        if writer.in_transaction:  # the timer had not fired: the writer commits now
            writer.execute("COMMIT")
        writer.close()
    # recorded, not lost: the next write (here stats()) persists last use, hits and the counter
    assert s.stats().restores == 3
    after = {i.snapshot_id: i for i in s.snapshots()}[r.snapshot_id]
    assert after.hits == 3 and after.last_used > before.last_used
    time.sleep(USE_EVERY_S)  # with the lock free and no write in the last USE_EVERY_S, a restore writes at once
    s.restore(r, dest)
    assert catalog(store_dir).execute("SELECT hits FROM snapshots WHERE id = ?",
                                      (r.snapshot_id,)).fetchone()[0] == 4
    s.close()


def test_restores_in_a_burst_write_their_bookkeeping_once_and_lose_none(store_dir: str) -> None:
    """A restore writes its last use and hit at most every USE_EVERY_S (a write transaction per
    restore was a tenth of a small one): a burst of restores writes once, the rest stays in the
    ledger for the next write (stats() here), and nothing is lost or counted twice."""
    s = open_store(store_dir)
    st_ = make_state(LAYOUT, 50, 6)
    r = s.save(toks(50), st_)
    time.sleep(USE_EVERY_S)
    writes: list[str] = []
    s._repo.db.conn().set_profile(lambda sql, _ns: writes.append(sql) if sql.startswith("BEGIN IMMEDIATE") else None)
    dest = empty_like_state(st_)
    for _ in range(5):
        s.restore(r, dest)
    s._repo.db.conn().set_profile(None)
    assert len(writes) == 1  # the first restore of the burst
    assert catalog(store_dir).execute("SELECT hits FROM snapshots WHERE id = ?", (r.snapshot_id,)).fetchone()[0] == 1
    assert s.stats().restores == 5
    assert {i.snapshot_id: i for i in s.snapshots()}[r.snapshot_id].hits == 5
    s.close()


def test_a_committed_save_does_not_raise_when_the_unlink_after_it_fails(store_dir: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_db, "_BUSY_TIMEOUT_MS", 20)
    monkeypatch.setattr(_db, "_BUSY_RETRIES", 2)
    s = open_store(store_dir)
    t = toks(600)
    st1 = make_state(LAYOUT, 600, 7)
    first = s.save(t[:300], st1, session="conv")
    writer = catalog(store_dir)
    # the moment the save's transaction has committed, another process takes the write lock and
    # holds it past the busy budget: the unlink of the superseded fixed part cannot run now
    monkeypatch.setitem(_store._HOOKS, "save_committed", lambda: writer.execute("BEGIN IMMEDIATE"))
    st2 = dict(st1, **{"rec.state": make_state(LAYOUT, 1, 8)["rec.state"]})
    second = s.save(t, st2, session="conv")  # supersedes `first`: its fixed part is freed
    assert second.ok and second.parent_id == first.snapshot_id
    monkeypatch.delitem(_store._HOOKS, "save_committed")
    writer.execute("ROLLBACK")
    writer.close()
    assert s.match(t).snapshot_id == second.snapshot_id  # type: ignore[union-attr]
    report = s.verify(deep=True)
    assert report.ok and report.orphan_files  # the file it could not unlink: an orphan, not damage
    s.gc(grace=0)
    assert not s.verify(deep=True).orphan_files
    s.close()


# -- item 10: close() racing other threads ---------------------------------------------------------

class _GatedReader:
    """A save source that blocks in read_into until released: a save held in flight."""

    def __init__(self, data: bytes):
        self.data = data
        self.nbytes = len(data)
        self.entered = threading.Event()
        self.go = threading.Event()

    def read_into(self, offset: int, out: memoryview) -> None:
        self.entered.set()
        assert self.go.wait(10)
        out[:] = self.data[offset:offset + len(out)]


def test_close_waits_for_a_call_in_flight_and_refuses_new_ones(store_dir: str) -> None:
    s = open_store(store_dir)
    st_ = make_state(LAYOUT, 20, 9)
    src = _GatedReader(st_["attn.kv"].tobytes())
    result: dict[str, Any] = {}

    def save() -> None:
        try:
            result["save"] = s.save(toks(20), dict(st_, **{"attn.kv": src}))
        except BaseException as e:  # noqa: BLE001 - reported below
            result["save"] = e

    saver = threading.Thread(target=save)
    saver.start()
    assert src.entered.wait(10)
    closer = threading.Thread(target=s.close)
    closer.start()
    time.sleep(0.3)
    assert closer.is_alive()  # close() waits for the save in flight
    with pytest.raises(ss.StateError):
        s.match(toks(20))  # a call that starts once close() began
    src.go.set()
    saver.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert isinstance(result["save"], ss.SaveResult) and result["save"].ok
    with pytest.raises(ss.StateError):
        s.save(toks(20), st_)
    s.close()  # idempotent
    with open_store(store_dir) as again:  # the save that was in flight is there, exact
        dest = empty_like_state(st_)
        out = again.restore(again.match(toks(20)), dest)
        assert part_hashes(LAYOUT, dest, out.rows) == part_hashes(LAYOUT, st_, out.rows)


def test_close_racing_busy_threads_raises_only_state_error(store_dir: str) -> None:
    s = open_store(store_dir)
    st_ = make_state(LAYOUT, 30, 10)
    r = s.save(toks(30), st_)
    errors: list[BaseException] = []
    stop = threading.Event()

    def work(k: int) -> None:
        dest = empty_like_state(st_)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                if k == 0:
                    s.save(toks(30 + i % 7), make_state(LAYOUT, 30 + i % 7, i))
                elif k == 1:
                    s.restore(r, dest)
                else:
                    s.match(toks(31))
                    s.stats()
            except ss.StateError:
                return
            except BaseException as e:  # noqa: BLE001 - anything else is the bug
                errors.append(e)
                return

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    time.sleep(0.5)
    s.close()
    stop.set()
    for th in threads:
        th.join(10)
    assert errors == []


# -- item 12: delete, describe, match(exclude=) -----------------------------------------------------

def test_delete_drops_a_snapshot_and_its_descendants_and_says_what_went(store: ss.Store) -> None:
    t = toks(900)
    a = store.save(t[:300], make_state(LAYOUT, 900, 11))
    b = store.save(t[:600], make_state(LAYOUT, 900, 11))
    c = store.save(t, make_state(LAYOUT, 900, 11))
    other = store.save(toks(100, base=50_000), make_state(LAYOUT, 100, 12))
    assert c.parent_id == b.snapshot_id and b.parent_id == a.snapshot_id
    stored = store.stats().stored_bytes
    gone = store.delete(b)
    assert set(gone.snapshot_ids) == {b.snapshot_id, c.snapshot_id} and len(gone) == 2
    assert gone.bytes_freed > 0 and store.stats().stored_bytes == stored - gone.bytes_freed
    assert store.match(t).snapshot_id == a.snapshot_id  # type: ignore[union-attr]
    assert store.match(toks(100, base=50_000)).snapshot_id == other.snapshot_id  # type: ignore[union-attr]
    assert store.verify(deep=True).ok
    with pytest.raises(ss.NotFoundError):
        store.delete(c.snapshot_id)
    with pytest.raises(ss.IdentityError):
        store.delete(a.snapshot_id, namespace="tenant")


def test_delete_refuses_a_subtree_with_another_processes_pending_capture(store_dir: str) -> None:
    s1 = open_store(store_dir)
    s2 = open_store(store_dir)  # another open store: another owner token
    t = toks(600)
    root = s1.save(t[:300], make_state(LAYOUT, 600, 13))
    capture = s2.save(t, make_state(LAYOUT, 600, 13), commit=False, parent=root.snapshot_id)
    with pytest.raises(ss.StateError, match="pending capture of another process"):
        s1.delete(root)
    assert s2.commit(capture).ok
    assert set(s1.delete(root).snapshot_ids) == {root.snapshot_id, capture.snapshot_id}
    s1.close()
    s2.close()


def test_describe_sizes_a_restore_before_it_runs(store: ss.Store) -> None:
    t = toks(700)
    full = make_state(LAYOUT, 700, 14)
    a = store.save(t[:300], full)
    b = store.save(t, full, rows={"mtp.kv": 650})
    base_only = {k: v for k, v in make_state(LAYOUT, 100, 15).items() if k != "mtp.kv"}
    c = store.save(toks(100, base=70_000), base_only)
    d = store.describe(store.match(t + [1]))
    assert isinstance(d, ss.MatchDetails)
    assert (d.snapshot_id, d.n_tokens, d.chain) == (b.snapshot_id, 700, [a.snapshot_id, b.snapshot_id])
    assert d.rows == {"attn.kv": 700, "mtp.kv": 650}
    assert d.components == {"draft"} and d.missing_components == frozenset()
    kv, mtp = LAYOUT.rows["attn.kv"].row_bytes, LAYOUT.rows["mtp.kv"].row_bytes
    assert d.part_bytes == {"rec.state": LAYOUT.fixed["rec.state"].nbytes, "attn.kv": 700 * kv, "mtp.kv": 650 * mtp}
    out = store.restore(b, empty_like_state(full))
    assert d.nbytes == out.bytes_restored and d.rows == out.rows
    base = store.describe(b, components=[])
    assert "mtp.kv" not in base.rows and base.nbytes == d.nbytes - 650 * mtp
    dc = store.describe(c.snapshot_id)
    assert dc.components == frozenset() and dc.missing_components == {"draft"} and dc.rows == {"attn.kv": 100}
    with pytest.raises(ss.SnapshotUnavailableError):
        store.describe(10**6)
    with pytest.raises(dataclasses_frozen_error()):
        d.nbytes = 0  # type: ignore[misc]


def dataclasses_frozen_error() -> type[BaseException]:
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_match_exclude_falls_back_to_the_next_longest_prefix(store: ss.Store) -> None:
    t = toks(900)
    st_ = make_state(LAYOUT, 900, 16)
    a = store.save(t[:300], st_, session="x")
    b = store.save(t[:600], st_, session="y")
    c = store.save(t, st_, session="z")
    m = store.match(t + [1])
    assert m is not None and m.snapshot_id == c.snapshot_id
    # the engine's restore of c failed: fall back, passing what failed
    m2 = store.match(t + [1], exclude=[m])
    assert m2 is not None and m2.snapshot_id == b.snapshot_id
    m3 = store.match(t + [1], exclude={m.snapshot_id, m2.snapshot_id})
    assert m3 is not None and m3.snapshot_id == a.snapshot_id
    assert store.match(t + [1], exclude=[a, b, c]) is None
    with pytest.raises(ss.InvalidInputError):
        store.match(t, exclude=5)  # type: ignore[arg-type]
    with pytest.raises(ss.InvalidInputError):
        store.match(t, exclude=["x"])


# -- issue 10: construction without side effects; a closed store refuses every call ---------------

def test_construction_only_assigns_and_open_does_the_io(tmp_path: Any) -> None:
    """Database, Repo and Store constructors create no file, directory, thread or connection;
    Store.open() does all of it (design: construction without side effects)."""
    from snapstore._config import store_options
    from snapstore.chunks.chunkfile import CODECS
    from snapstore.chunks.repo import Repo

    root = str(tmp_path / "s")
    threads = {t.ident for t in threading.enumerate()}
    _db.Database(os.path.join(root, "snapstore.db"))
    repo = Repo(root)
    options = store_options(root, chunk_bytes=None, codec=None, staging_bytes=None, check_rows=None,
                            pending_lease=None, codecs=CODECS)
    ss.Store(repo, IDENT, LAYOUT, ss.Budget(reserve_bytes=0).resolved(), options)
    assert not os.path.exists(root)
    assert {t.ident for t in threading.enumerate()} == threads
    opened = ss.Store.open(root, identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0))
    try:
        assert os.path.isfile(os.path.join(root, "snapstore.db"))
        assert {t.ident for t in threading.enumerate()} - threads  # the lease thread
    finally:
        opened.close()


def test_every_public_call_on_a_closed_store_raises_state_error(store_dir: str) -> None:
    s = open_store(store_dir)
    st_ = make_state(LAYOUT, 20, 3)
    saved = s.save(toks(20), st_)
    pending = s.save(toks(24), make_state(LAYOUT, 24, 4), commit=False)
    dest = empty_like_state(st_)
    s.close()
    calls: dict[str, Any] = {
        "save": lambda: s.save(toks(20), st_),
        "save(wait=False)": lambda: s.save(toks(20), st_, wait=False),
        "match": lambda: s.match(toks(20)),
        "match_many([])": lambda: s.match_many([]),
        "match_many": lambda: s.match_many([toks(20)]),
        "restore": lambda: s.restore(saved, dest),
        "restore_many([])": lambda: s.restore_many([]),
        "describe": lambda: s.describe(saved),
        "commit": lambda: s.commit(pending),
        "abandon": lambda: s.abandon(pending),
        "delete": lambda: s.delete(saved),
        "snapshots": lambda: s.snapshots(),
        "stats": lambda: s.stats(),
        "verify": lambda: s.verify(),
        "gc": lambda: s.gc(dry_run=True),
        "turn": lambda: s.turn(session="x"),
        "flush": lambda: s.flush(),
    }
    for name, call in calls.items():
        with pytest.raises(ss.StateError):
            call()
            pytest.fail(f"{name} on a closed store did not raise")
    s.close()  # still idempotent
