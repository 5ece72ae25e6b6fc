"""Capacity and lifecycle: budgets, pins, leaf-only LRU, supersede, TTL, stale identities,
the RAM tier and persistent counters."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from support import Conversation, Workload, sha, store_factory

import snapstore as ss

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
HERE_DIR = os.path.dirname(os.path.abspath(__file__))  # this module's folder: a child process imports it by name

ROW = ss.Rows("uint8", (128,))
LAY = ss.Layout(fixed={"rec": ss.Fixed("float32", (64,))}, rows={"kv": ROW})  # 256 B fixed, 128 B a row
CB = 4096


open_store = store_factory(layout=LAY, staging_bytes=16 * CB, check_rows=None)
# Conversations of up to 2000 tokens, incompressible rows; Conv(k).state() is the next turn's state.
WORKLOAD = Workload(LAY, conversations=1100, max_tokens=2000, levels=256)


def Conv(k: int) -> Conversation:  # noqa: N802 (the name the tests have always used)
    """Conversation ``k`` of :data:`WORKLOAD`: tokens and K/V rows only grow; fixed state changes every turn."""
    return WORKLOAD.conversation(k)


def restore_ok(s: ss.Store, sid: int, conv: Conversation, fixed: np.ndarray | None = None,
               session: str | None = None) -> ss.RestoreResult:
    dest = {"rec": np.zeros(64, np.float32), "kv": np.zeros_like(conv.rows["kv"])}
    r = s.restore(sid, dest, session=session)
    assert sha(dest["kv"][: r.n_tokens]) == sha(conv.rows["kv"][: r.n_tokens])
    if fixed is not None:
        assert sha(dest["rec"]) == sha(fixed)
    return r


def matchable(s: ss.Store) -> list[ss.SnapshotInfo]:
    return [x for x in s.snapshots() if x.matchable and not x.pending]


def test_repeated_turns_keep_one_matchable_snapshot(store_dir: str) -> None:
    conv = Conv(1)
    with open_store(store_dir) as s:
        for turn, n in enumerate([300, 520, 800, 1100]):
            st_ = conv.state()
            r = s.save(conv.tokens[:n], st_, session="conv-17")
            assert r.ok
            live = matchable(s)
            assert [x.snapshot_id for x in live] == [r.snapshot_id]  # the superseded one is gone now
            assert s.stats().supersedes == turn
            restore_ok(s, r.snapshot_id, conv, st_["rec"], session="conv-17")  # its own session's use
        # the chain links kept only their rows: no fixed parts stored for non-matchable links
        links = [x for x in s.snapshots() if not x.matchable]
        assert len(links) == 3 and all(x.pinned for x in links)
        assert s.stats().stored_bytes <= 1100 * 128 + 256 + 64 * 64  # rows once + one fixed set + headers
        # saved without a parent, the new one makes the old one fully removable
        st_ = conv.state()
        r = s.save(conv.tokens[:1500], st_, session="conv-17", parent=None)
        assert [x.snapshot_id for x in s.snapshots()] == [r.snapshot_id]
        assert s.verify(deep=True).ok


def test_supersede_only_strict_extensions_in_the_same_session(store_dir: str) -> None:
    conv, other = Conv(2), Conv(3)
    with open_store(store_dir) as s:
        a = s.save(conv.tokens[:400], conv.state(), session="A")
        b = s.save(conv.tokens[:400], conv.state(), session="B")  # same prefix, other session
        c = s.save(other.tokens[:500], other.state(), session="A")  # same session, not an extension
        d = s.save(conv.tokens[:400], conv.state(), session="A")  # same tokens: not strict
        e = s.save(conv.tokens[:900], conv.state(), session="A")
        live = {x.snapshot_id for x in matchable(s)}
        assert b.snapshot_id in live and c.snapshot_id in live and e.snapshot_id in live
        assert a.snapshot_id not in live and d.snapshot_id not in live
        assert s.match(conv.tokens[:450]).snapshot_id == b.snapshot_id


def test_two_conversations_fit_a_budget_for_two(store_dir: str) -> None:
    convs = [Conv(10), Conv(11)]
    turns = [250, 500, 750, 1000]
    budget = ss.Budget.for_model(LAY, conversations=2, tokens=1000, reserve_bytes=0)
    with open_store(store_dir, budget=budget) as s:
        for n in turns:
            for i, cv in enumerate(convs):
                r = s.save(cv.tokens[:n], cv.state(), session=f"c{i}")
                assert r.ok, r
                assert s.stats().evictions == 0
        assert s.stats().entries == 2
        for cv in convs:
            m = s.match(cv.tokens[:1000])
            assert m is not None and m.n_tokens == 1000
            restore_ok(s, m.snapshot_id, cv)
        assert s.stats().stored_bytes <= budget.disk_bytes


def test_budget_for_one_evicts_the_least_recently_used(store_dir: str) -> None:
    convs = [Conv(20), Conv(21)]
    budget = ss.Budget.for_model(LAY, conversations=1, tokens=1000, reserve_bytes=0)
    with open_store(store_dir, budget=budget) as s:
        a = s.save(convs[0].tokens[:1000], convs[0].state(), session="a")
        assert a.ok
        b = s.save(convs[1].tokens[:1000], convs[1].state(), session="b")
        assert b.ok and s.stats().evictions >= 1
        assert s.match(convs[0].tokens[:1000]) is None
        assert s.match(convs[1].tokens[:1000]).snapshot_id == b.snapshot_id
        assert s.stats().stored_bytes <= budget.disk_bytes


def test_chain_scenario_under_eviction(store_dir: str) -> None:
    C = 256
    rng = np.random.default_rng(5)
    a_tok = rng.integers(0, 1000, 3 * C + 100)
    b_tok = np.concatenate([a_tok[:C], rng.integers(1000, 2000, C + 60)])
    a_kv = rng.integers(0, 256, (len(a_tok), 128), dtype=np.uint8)
    b_kv = np.concatenate([a_kv[:C], rng.integers(0, 256, (C + 60, 128), dtype=np.uint8)])
    fixed = np.ones(64, np.float32)
    with open_store(store_dir) as s:
        a_ids, sizes = [], []
        for n in (C, 2 * C, 3 * C, 3 * C + 100):
            r = s.save(a_tok[:n], {"rec": fixed, "kv": a_kv})
            a_ids.append(r.snapshot_id)
            sizes.append(r.stored_bytes)
        rb = s.save(b_tok, {"rec": fixed, "kv": b_kv}, parent=a_ids[0])
        total = s.stats().stored_bytes
    c_tok = rng.integers(5000, 6000, C)
    c_kv = rng.integers(0, 256, (C, 128), dtype=np.uint8)
    c_bytes = 256 + 64 + C * 128 + 64 * (C * 128 // CB)
    # room for C only after evicting A's two deepest snapshots (one is not enough)
    budget = ss.Budget(disk_bytes=total + c_bytes - sizes[3] - 1, reserve_bytes=0)
    with open_store(store_dir, budget=budget) as s:
        time.sleep(0.01)
        s.restore(rb.snapshot_id, {"rec": np.zeros(64, np.float32), "kv": np.zeros_like(b_kv)})  # B is recent
        time.sleep(0.01)
        rc = s.save(c_tok, {"rec": fixed + 1, "kv": c_kv})
        assert rc.ok and rc.stored_bytes == c_bytes
        ids = {x.snapshot_id for x in s.snapshots()}
        assert a_ids[3] not in ids and a_ids[2] not in ids  # the deepest leaf went first, then its parent
        assert {a_ids[0], a_ids[1], rb.snapshot_id} <= ids
        m = s.match(a_tok)
        assert m.snapshot_id == a_ids[1] and m.n_tokens == 2 * C  # A still restores at 2 chunks
        res = s.restore(m, {"rec": np.zeros(64, np.float32), "kv": np.zeros_like(a_kv)})
        assert res.chain == a_ids[:2]
        root = next(x for x in s.snapshots() if x.snapshot_id == a_ids[0])
        assert root.pinned
        dest = {"rec": np.zeros(64, np.float32), "kv": np.zeros_like(b_kv)}
        assert s.restore(s.match(b_tok), dest).chain == [a_ids[0], rb.snapshot_id]
        assert sha(dest["kv"]) == sha(b_kv)
        assert s.stats().stored_bytes <= budget.disk_bytes


def test_pinned_parent_is_never_evicted_and_oversize_is_skipped(store_dir: str) -> None:
    conv = Conv(30)
    with open_store(store_dir, budget=ss.Budget(disk_bytes=60_000, reserve_bytes=0)) as s:
        big = s.save(conv.tokens[:1000], conv.state())  # 128 KB > 60 KB budget
        assert big.snapshot_id is None and big.skipped == "larger_than_budget"
        assert s.stats().skipped == {"larger_than_budget": 1}
        assert s.stats().stored_bytes == 0 and not os.listdir(os.path.join(store_dir, "tmp"))
        root = s.save(conv.tokens[:200], conv.state())
        child = s.save(conv.tokens[:400], conv.state())
        assert child.parent_id == root.snapshot_id
        other = Conv(31)
        r = s.save(other.tokens[:300], other.state())  # must evict the child leaf, never the pinned root
        assert r.ok
        ids = {x.snapshot_id for x in s.snapshots()}
        assert root.snapshot_id in ids or child.snapshot_id not in ids
        assert s.stats().stored_bytes <= 60_000


def test_save_that_cannot_fit_after_evicting_is_skipped_and_writes_nothing(store_dir: str) -> None:
    conv = Conv(40)
    with open_store(store_dir, budget=ss.Budget(disk_bytes=100_000, reserve_bytes=0)) as s:
        root = s.save(conv.tokens[:300], conv.state())
        pend = s.save(conv.tokens[:600], conv.state(), commit=False)  # pins root, cannot be evicted
        assert pend.pending
        files_before = sorted(p for _, _, fs in os.walk(store_dir) for p in fs if not p.startswith("snapstore.db"))
        other = Conv(41)
        r = s.save(other.tokens[:500], other.state())
        assert r.snapshot_id is None and r.skipped == "disk_budget"
        files_after = sorted(p for _, _, fs in os.walk(store_dir) for p in fs if not p.startswith("snapstore.db"))
        assert files_after == files_before
        assert s.stats().skipped.get("disk_budget") == 1
        # abandoning the pending capture releases its pin and its bytes
        stored = s.stats().stored_bytes
        s.abandon(pend)
        assert s.stats().stored_bytes < stored
        assert not next(x for x in s.snapshots() if x.snapshot_id == root.snapshot_id).pinned
        assert s.save(other.tokens[:500], other.state()).ok


def test_max_entries_evicts_leaves_first(store_dir: str) -> None:
    with open_store(store_dir, budget=ss.Budget(max_entries=3, reserve_bytes=0)) as s:
        convs = [Conv(50 + i) for i in range(5)]
        ids = []
        for cv in convs:
            ids.append(s.save(cv.tokens[:100], cv.state()).snapshot_id)
            assert s.stats().entries <= 3
        assert [x.snapshot_id for x in matchable(s)] == ids[-3:]


def test_ttl_expired_not_matched_and_collected(store_dir: str) -> None:
    conv = Conv(60)
    with open_store(store_dir, budget=ss.Budget(ttl=0.5, reserve_bytes=0)) as s:
        r = s.save(conv.tokens[:100], conv.state())
        assert s.match(conv.tokens[:100]).snapshot_id == r.snapshot_id
        time.sleep(0.7)
        assert s.match(conv.tokens[:100]) is None
        rep = s.gc(grace=0)
        assert r.snapshot_id in rep.expired and s.stats().stored_bytes == 0


def test_stale_identity_dropped_at_open(store_dir: str) -> None:
    conv = Conv(70)
    old = ss.Identity(build="eng-1.0", pack="sha256:aa")
    new = ss.Identity(build="eng-1.1", pack="sha256:aa")
    with open_store(store_dir, identity=old) as s:
        s.save(conv.tokens[:300], conv.state())
    with open_store(store_dir, identity=new) as s:  # drop_stale=True is the default
        assert s.snapshots() == [] and s.stats().stored_bytes == 0
        assert s.stats().stale_dropped == 1
    with open_store(store_dir, identity=old) as s:
        assert s.match(conv.tokens[:300]) is None


def test_drop_stale_false_keeps_other_identities(store_dir: str) -> None:
    conv = Conv(71)
    old = ss.Identity(build="eng-1.0", pack="sha256:aa")
    with open_store(store_dir, identity=old) as s:
        s.save(conv.tokens[:300], conv.state())
    with open_store(store_dir, drop_stale=False):
        pass
    with open_store(store_dir, identity=old, drop_stale=False) as s:
        assert s.match(conv.tokens[:300]) is not None


def test_ram_tier_serves_repeated_restores_and_drops_corrupt(store_dir: str) -> None:
    conv = Conv(80)
    with open_store(store_dir, budget=ss.Budget(ram_bytes=1 << 20, reserve_bytes=0)) as s:
        r = s.save(conv.tokens[:500], conv.state())
        restore_ok(s, r.snapshot_id, conv)
        restore_ok(s, r.snapshot_id, conv)  # admitted on the second restore (in the background)
        assert s._ram is not None and s._ram.drain(10)
        assert s.stats().ram_hits == 0 and s.stats().ram_bytes > 0
        restore_ok(s, r.snapshot_id, conv)
        assert s.stats().ram_hits > 0
        # a chunk found corrupt is dropped from the tier as well
        cid = next(iter(s._ram._items))
        s._ram.discard(cid)
        assert s._ram.get(cid) is None
    with open_store(store_dir, budget=ss.Budget(ram_bytes=0, reserve_bytes=0)) as s:
        restore_ok(s, r.snapshot_id, conv)
        assert s._ram is None


def test_counters_persist_across_restarts(store_dir: str) -> None:
    conv = Conv(90)
    with open_store(store_dir) as s:
        s.save(conv.tokens[:100], conv.state())
        s.match(conv.tokens[:150])
        s.match([1, 2, 3])
    with open_store(store_dir) as s:
        st_ = s.stats()
        assert (st_.inserts, st_.hits, st_.misses, st_.hit_tokens) == (1, 1, 1, 100)
        d = st_.to_dict()
        for key in ("inserts", "entries", "hits", "misses", "hit_tokens", "evictions", "supersedes", "skipped",
                    "stored_bytes", "logical_bytes", "dedup_ratio", "ram_hits"):
            assert key in d


def test_budget_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPSTORE_DISK_MIB", "10")
    monkeypatch.setenv("SNAPSTORE_RAM_MIB", "0")
    monkeypatch.setenv("SNAPSTORE_MAX_ENTRIES", "7")
    monkeypatch.setenv("SNAPSTORE_TTL", "30")
    b = ss.Budget().resolved()
    assert (b.disk_bytes, b.ram_bytes, b.max_entries, b.ttl) == (10 << 20, 0, 7, 30.0)
    assert ss.Budget(disk_bytes=5).resolved().disk_bytes == 5  # keywords win
    monkeypatch.setenv("SNAPSTORE_DISK_MIB", "lots")
    with pytest.raises(ss.ConfigError, match="SNAPSTORE_DISK_MIB"):
        ss.Budget().resolved()


def test_budget_defaults_and_for_model(monkeypatch: pytest.MonkeyPatch) -> None:
    b = ss.Budget().resolved()
    assert b.disk_bytes == 51200 << 20 and b.ram_bytes == 2048 << 20 and b.reserve_bytes == 1024 << 20
    fm = ss.Budget.for_model(LAY, conversations=3, tokens=1000, headroom=1.0)
    assert fm.disk_bytes == 3 * (1000 * 128 + 256)
    with pytest.raises(ss.ConfigError):
        ss.Budget(disk_bytes=-1)


def test_free_space_reserve_skips_instead_of_filling_the_disk(store_dir: str) -> None:
    st = os.statvfs(os.path.dirname(store_dir) or ".")
    free = st.f_bavail * st.f_frsize
    conv = Conv(95)
    with open_store(store_dir, budget=ss.Budget(reserve_bytes=free + (1 << 30))) as s:
        r = s.save(conv.tokens[:100], conv.state())
        assert r.skipped == "disk_full" and s.stats().stored_bytes == 0


_EVICTOR = """
import os, sys, time
sys.path[:0] = sys.argv[2].split(os.pathsep)
import numpy as np, snapstore as ss
from support import IDENT
from test_lifecycle import LAY, Conv
s = ss.Store.open(sys.argv[1], identity=IDENT, layout=LAY, chunk_bytes=4096, staging_bytes=65536,
                  budget=ss.Budget(disk_bytes=int(sys.argv[3]), reserve_bytes=0), drop_stale=False)
end = time.time() + float(sys.argv[4])
i = 0
while time.time() < end:
    cv = Conv(1000 + i % 50)
    s.save(cv.tokens[:600], cv.state())   # every save evicts the LRU leaf
    i += 1
print(i)
s.close()
"""


@pytest.mark.slow  # an evicting child process for seconds
def test_restore_beside_concurrent_eviction_is_exact_or_a_clean_miss(store_dir: str) -> None:
    import subprocess
    import sys
    conv = Conv(999)
    budget = 3 * (600 * 128 + 256 + 64 * 20)
    with open_store(store_dir, budget=ss.Budget(disk_bytes=budget, reserve_bytes=0)) as s:
        assert s.save(conv.tokens[:600], conv.state()).ok
        proc = subprocess.Popen([sys.executable, "-c", _EVICTOR, store_dir, os.pathsep.join([TESTS_DIR, HERE_DIR]),
                                 str(budget), "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        exact = misses = 0
        sentinel = np.full((2000, 128), 7, np.uint8)
        deadline = time.time() + 4
        while time.time() < deadline:
            m = s.match(conv.tokens[:600])
            if m is None:
                s.save(conv.tokens[:600], conv.state())  # evicted: put it back
                continue
            dest = {"rec": np.zeros(64, np.float32), "kv": sentinel.copy()}
            try:
                s.restore(m, dest)
            except ss.SnapshotUnavailableError as e:
                assert e.touched is False and (dest["kv"] == 7).all()
                misses += 1
                continue
            assert sha(dest["kv"][:600]) == sha(conv.rows["kv"][:600])
            exact += 1
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert exact > 0 and int(out) > 0
        assert s.verify(deep=True).ok
