"""Every Store call that names a snapshot keeps to its own (invariant 10, docs/design.md): another
open store's pending capture is neither restored, described, committed nor abandoned, and a chain
whose link belongs to another namespace or identity (a damaged or reused parent link) serves
nothing. Review of issue 10's split (_access, _read, _snapshot_ops): each check here had no test
in the fast tier, so losing one in a later move would have passed. Real SQLite and files; two
Store objects on one directory are two owners, as two processes are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support import IDENT, LAYOUT, empty_like_state, make_state, open_store

import snapstore as ss


def toks(n: int, base: int = 3000) -> list[int]:
    return list(range(base, base + n))


def untouched(dest: dict[str, np.ndarray]) -> bool:
    return all(not v.any() for v in dest.values())


def test_another_stores_pending_capture_is_not_readable_nor_changeable(store_dir: str) -> None:
    mine, other = open_store(store_dir), open_store(store_dir)  # two owners of one directory
    try:
        state = make_state(LAYOUT, 120, 41)
        capture = other.save(toks(120), state, commit=False)
        assert capture.ok and capture.pending
        dest = empty_like_state(state)
        with pytest.raises(ss.SnapshotUnavailableError, match="pending capture of another process"):
            mine.restore(capture.snapshot_id, dest)
        with pytest.raises(ss.SnapshotUnavailableError, match="pending capture of another process"):
            mine.restore_many([(capture.snapshot_id, dest)])
        with pytest.raises(ss.SnapshotUnavailableError, match="pending capture of another process"):
            mine.describe(capture.snapshot_id)
        assert untouched(dest)
        with pytest.raises(ss.StateError, match="pending capture of another process"):
            mine.commit(capture)
        assert mine.match(toks(120)) is None  # still pending: invisible to match
        with pytest.raises(ss.StateError, match="pending capture of another process"):
            mine.abandon(capture)
        assert other.commit(capture).ok  # its owner still holds it, and commits it
        assert mine.match(toks(120)) is not None
    finally:
        mine.close()
        other.close()


@pytest.mark.parametrize("foreign", ["namespace", "identity"])
def test_a_chain_link_of_another_tenant_serves_nothing(store_dir: str, foreign: str) -> None:
    """C is a delta over P (tenant A); a damaged catalog points C's parent link at Q, another
    tenant's snapshot of the same length. Restoring C must not read Q's rows into A's engine."""
    t = toks(200)
    mine = open_store(store_dir, drop_stale=False)
    other = mine if foreign == "namespace" else open_store(
        store_dir, identity=ss.Identity(build="eng-other", pack=IDENT.pack), drop_stale=False)
    try:
        ns: dict[str, Any] = {"namespace": "tenant-a"} if foreign == "namespace" else {}
        theirs: dict[str, Any] = {"namespace": "tenant-b"} if foreign == "namespace" else {}
        state = make_state(LAYOUT, 200, 42)
        p = mine.save(t[:100], state, **ns)
        c = mine.save(t, state, **ns)
        assert c.ok and c.parent_id == p.snapshot_id
        q = other.save(t[:100], make_state(LAYOUT, 200, 43), **theirs)
        assert q.ok and q.snapshot_id not in (p.snapshot_id, c.snapshot_id)
        mine._repo.db.write(lambda conn: conn.execute("UPDATE snapshots SET parent_id = ? WHERE id = ?",
                                                      (q.snapshot_id, c.snapshot_id)))
        dest = empty_like_state(state)
        with pytest.raises(ss.SnapshotUnavailableError, match="belongs to another identity or namespace"):
            mine.restore(c, dest)
        assert untouched(dest)
        with pytest.raises(ss.SnapshotUnavailableError, match="belongs to another identity or namespace"):
            mine.describe(c)
    finally:
        if other is not mine:
            other.close()
        mine.close()


def test_an_explicit_parent_of_another_namespace_is_refused(store_dir: str) -> None:
    with open_store(store_dir) as s:
        state = make_state(LAYOUT, 150, 44)
        p = s.save(toks(100), state, namespace="tenant-a")
        with pytest.raises(ss.IdentityError, match="another namespace"):
            s.save(toks(150), state, parent=p.snapshot_id, namespace="tenant-b")
        with pytest.raises(ss.IdentityError, match="another namespace"):
            s.save(toks(150), state, parent=p.snapshot_id)  # the default namespace is a namespace too
        assert s.save(toks(150), state, parent=p.snapshot_id, namespace="tenant-a").parent_id == p.snapshot_id


def test_rows_from_beyond_the_snapshot_is_refused_before_writing(store_dir: str) -> None:
    with open_store(store_dir) as s:
        state = make_state(LAYOUT, 60, 45)
        r = s.save(toks(60), state)
        dest = empty_like_state(state)
        for call in (lambda: s.restore(r, dest, rows_from=61), lambda: s.describe(r, rows_from=61),
                     lambda: s.restore_many([(r, dest)], rows_from=61)):
            with pytest.raises(ss.InvalidInputError, match="rows_from=61 is outside"):
                call()
        assert untouched(dest)


def test_a_commit_that_cannot_fit_never_evicts_the_capture_it_commits(store_dir: str) -> None:
    """Commit's eviction protects the chain it commits: refused for the budget, the capture is
    dropped and the result says skipped — never a success for a snapshot evicted in the same
    transaction (invariant 6: a snapshot reported saved is there)."""
    with open_store(store_dir, budget=ss.Budget(reserve_bytes=0, max_entries=0)) as s:
        capture = s.save(toks(80), make_state(LAYOUT, 80, 46), commit=False)
        assert capture.ok and capture.pending  # pending captures do not count as entries
        res = s.commit(capture)
        assert res.skipped == "max_entries" and res.snapshot_id is None
        assert s.snapshots() == [] and s.stats().skipped == {"max_entries": 1}
