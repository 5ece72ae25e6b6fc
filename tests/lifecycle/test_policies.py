"""One copy of each lifecycle policy: open, close and gc drop alike (live captures spared, every drop
counted), plus the bookkeeping and API fixes of review 1 (hits, delete beside a dead owner,
match(exclude=None), what "abandoned" counts)."""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np
from support import IDENT
from test_lifecycle import Conv, open_store

import snapstore as ss
from snapstore.lifecycle.gc import gc
from snapstore.lifecycle.owner import OWNER_PREFIX

# the same model, rebuilt: stale
OTHER = ss.Identity(build="other-build", pack=IDENT.pack, kv="f16", mtp=False, extra=IDENT.extra)


def _dead_token() -> str:
    return OWNER_PREFIX + secrets.token_hex(16)  # no lock file, no owner row: provably gone


def _counters(s: ss.Store) -> ss.Stats:
    return s.stats()


def test_gc_identity_drop_spares_a_live_pending_capture(store_dir: str) -> None:
    old = open_store(store_dir, identity=OTHER)
    conv = Conv(1)
    r = old.save(conv.tokens[:300], conv.state(), commit=False)
    assert r.snapshot_id is not None
    new = open_store(store_dir)  # open-time drop_stale spares the live capture
    try:
        report = gc(new._repo, keep_identity=IDENT.key, grace=3600)
        assert report.stale == []
        assert old.commit(r).snapshot_id == r.snapshot_id  # still there: the engine's turn commits
    finally:
        new.close()
        old.close()


def test_gc_drops_count_like_open_time_housekeeping(store_dir: str) -> None:
    conv = Conv(2)
    with open_store(store_dir, identity=OTHER) as other:
        other.save(conv.tokens[:100], conv.state())
    with open_store(store_dir, drop_stale=False) as s:
        p = s.save(conv.tokens[:64], conv.state())
        dead = s.save(conv.tokens[:128], conv.state(), commit=False)
        assert p.snapshot_id is not None and dead.snapshot_id is not None
        sid = dead.snapshot_id
        s._repo.db.write(lambda t: t.set_state(sid, 0, _dead_token(), time.time()))
        before = _counters(s)
        report = gc(s._repo, keep_identity=IDENT.key, ttl=1e-9, grace=3600)
        after = _counters(s)
    assert report.dead_pending == [sid] and len(report.stale) == 1 and report.expired == [p.snapshot_id]
    assert after.abandoned - before.abandoned == 1
    assert after.stale_dropped - before.stale_dropped == 1
    assert after.expired - before.expired == 1


def test_abandoned_counts_captures_not_the_chain_links_pruned_after_them(store_dir: str) -> None:
    conv = Conv(3)
    with open_store(store_dir) as s:
        a = s.save(conv.tokens[:64], conv.state(), session="c")
        b = s.save(conv.tokens[:128], conv.state(), session="c", parent=a.snapshot_id)  # a: a bare link
        c = s.save(conv.tokens[:192], conv.state(), session="c", parent=b.snapshot_id, commit=False)
        e = s.save(conv.tokens[:160], conv.state(), session="c", parent=b.snapshot_id)  # b: a bare link
        s.delete(e)  # b keeps its pending child c
        before = s.stats().abandoned
        s.abandon(c)  # c goes, and with it the links b and a it alone kept
        assert [x.snapshot_id for x in s.snapshots()] == []
        assert s.stats().abandoned - before == 1


def test_delete_takes_a_dead_owners_capture_with_the_subtree(store_dir: str) -> None:
    conv = Conv(4)
    with open_store(store_dir) as s:
        p = s.save(conv.tokens[:64], conv.state())
        child = s.save(conv.tokens[:128], conv.state(), parent=p.snapshot_id, commit=False)
        sid = child.snapshot_id
        assert sid is not None
        s._repo.db.write(lambda t: t.set_state(sid, 0, _dead_token(), time.time()))
        res = s.delete(p)
        assert set(res.snapshot_ids) == {p.snapshot_id, sid}


def test_match_exclude_none_excludes_nothing(store_dir: str) -> None:
    conv = Conv(5)
    with open_store(store_dir) as s:
        r = s.save(conv.tokens[:64], conv.state())
        m = s.match(conv.tokens[:100], exclude=None)
        assert m is not None and m.snapshot_id == r.snapshot_id


def test_hits_are_exact_with_restores_and_saves_running_together(store_dir: str) -> None:
    conv = Conv(6)
    with open_store(store_dir, budget=ss.Budget(reserve_bytes=0, ram_bytes=0)) as s:
        m = s.save(conv.tokens[:300], conv.state())
        n = 150

        def restorer() -> None:
            out = {"rec": np.zeros(64, np.float32), "kv": np.zeros_like(conv.rows["kv"])}
            for _ in range(n):
                s.restore(m, out)

        def saver(k: int) -> None:
            other = Conv(100 + k)
            for i in range(60):
                s.save(other.tokens[i:i + 5], other.state(), parent=None)

        ts = [threading.Thread(target=restorer) for _ in range(2)] + \
             [threading.Thread(target=saver, args=(k,)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert s.stats().restores == 2 * n
        assert [x.hits for x in s.snapshots() if x.snapshot_id == m.snapshot_id] == [2 * n]
