"""Named snapshots (issue 32, part 3): ``Store.name`` / ``named`` / ``unname`` — per identity and
namespace, never evicted, expired or superseded away while named, an expired ttl unnames, and the
named bytes count toward the budget. Real stores throughout."""

from __future__ import annotations

import time

import numpy as np
import pytest
from support import IDENT, Conversation, Workload, sha, store_factory

import snapstore as ss

ROW = ss.Rows("uint8", (128,))
LAY = ss.Layout(fixed={"rec": ss.Fixed("float32", (64,))}, rows={"kv": ROW})  # 256 B fixed, 128 B a row
open_store = store_factory(layout=LAY, staging_bytes=64 * 1024, check_rows=None)
WORKLOAD = Workload(LAY, conversations=64, max_tokens=600, levels=256)
COST_300 = 39360  # what a whole save of 300 tokens stores (4 KiB chunks, raw)
OTHER = ss.Identity(build="b", pack="another-model", kv="f16", mtp=False)


def conv(k: int) -> Conversation:
    return WORKLOAD.conversation(k)


def restored(s: ss.Store, m: ss.Match, c: Conversation) -> bool:
    dest = {"rec": np.zeros(64, np.float32), "kv": np.zeros_like(c.rows["kv"])}
    r = s.restore(m, dest)
    return sha(dest["kv"][: r.n_tokens]) == sha(c.rows["kv"][: r.n_tokens])


def test_name_named_unname_round_trip(store_dir: str) -> None:
    with open_store(store_dir) as s:
        a = conv(0)
        r = s.save(a.tokens[:300], a.state())
        assert s.named("agent/plan") is None
        s.name(r, "agent/plan")
        m = s.named("agent/plan")
        assert m is not None and m.snapshot_id == r.snapshot_id and m.n_tokens == 300
        assert restored(s, m, a)
    with open_store(store_dir) as s:  # names are in the catalog
        m = s.named("agent/plan")
        assert m is not None and m.snapshot_id == r.snapshot_id
        assert s.unname("agent/plan") is True
        assert s.unname("agent/plan") is False
        assert s.named("agent/plan") is None
        assert s.match(a.tokens[:300]) is not None  # the snapshot stays


def test_a_name_moves_and_is_per_namespace_and_identity(store_dir: str) -> None:
    with open_store(store_dir) as s:
        a, b = conv(1), conv(2)
        ra = s.save(a.tokens[:300], a.state())
        rb = s.save(b.tokens[:300], b.state())
        rx = s.save(a.tokens[:300], a.state(), namespace="tenant-x")
        s.name(ra, "n")
        s.name(rb, "n")  # moves
        m = s.named("n")
        assert m is not None and m.snapshot_id == rb.snapshot_id
        assert s.named("n", namespace="tenant-x") is None
        s.name(rx, "n")  # its own namespace (from the SaveResult)
        mx = s.named("n", namespace="tenant-x")
        assert mx is not None and mx.snapshot_id == rx.snapshot_id
        assert ra.snapshot_id is not None
        with pytest.raises(ss.IdentityError):
            s.name(ra.snapshot_id, "n", namespace="tenant-x")  # not that namespace's snapshot
    with open_store(store_dir, identity=OTHER, drop_stale=False) as o:
        assert o.named("n") is None


def test_a_named_snapshot_is_never_evicted_and_its_bytes_count(store_dir: str) -> None:
    disk = 3 * COST_300
    with open_store(store_dir, disk=disk) as s:
        first = conv(3)
        kept = s.save(first.tokens[:300], first.state())
        s.name(kept, "keep")
        for k in range(4, 12):  # far more than the budget holds: LRU eviction runs on every save
            c = conv(k)
            assert s.save(c.tokens[:300], c.state()).ok
        m = s.named("keep")
        assert m is not None and restored(s, m, first)
        assert s.match(first.tokens[:300]) is not None
        # with two named, the budget has room for one more snapshot only beside them
        second = conv(20)
        s.name(s.save(second.tokens[:300], second.state()), "keep2")
        third = conv(21)
        s.name(s.save(third.tokens[:300], third.state()), "keep3")
        big = conv(22)
        r = s.save(big.tokens[:300], big.state())
        assert r.skipped == "disk_budget"  # everything else is named: it cannot fit beside them
        s.unname("keep")
        assert s.save(big.tokens[:300], big.state()).ok  # now "keep" can be evicted for it
        assert s.named("keep") is None and s.match(first.tokens[:300]) is None


def test_an_expired_name_unnames_and_stops_protecting(store_dir: str) -> None:
    with open_store(store_dir, disk=2 * COST_300) as s:
        a = conv(30)
        r = s.save(a.tokens[:300], a.state())
        s.name(r, "brief", ttl_s=3600)
        assert s.named("brief") is not None
        iid = s._repo.db.read(lambda t: t.identity_id(IDENT.key))
        assert iid is not None and r.snapshot_id is not None
        sid = r.snapshot_id
        past = time.time() - 1
        s._repo.db.write(lambda t: t.set_name(iid, "", "brief", sid, past - 3600, past))  # its hour is over
        assert s.named("brief") is None
        for k in range(31, 34):
            c = conv(k)
            assert s.save(c.tokens[:300], c.state()).ok
        assert s.match(a.tokens[:300]) is None  # evicted: the expired name protected nothing
        assert s._repo.db.read(lambda t: t.all_names()) == []  # and was removed


def test_the_store_ttl_does_not_expire_a_named_snapshot(store_dir: str) -> None:
    with open_store(store_dir) as s:
        a, b = conv(40), conv(41)
        named, plain = s.save(a.tokens[:300], a.state()), s.save(b.tokens[:300], b.state())
        s.name(named, "old")
        long_ago = time.time() - 10 * 86400
        for r in (named, plain):
            sid = r.snapshot_id
            assert sid is not None
            s._repo.db.write(lambda t, sid=sid: t.execute(  # type: ignore[misc]
                "UPDATE snapshots SET last_used = ? WHERE id = ?", (long_ago, sid)))
    budget = ss.Budget(reserve_bytes=0, ttl=86400)
    with open_store(store_dir, budget=budget) as s:  # the open expires what was unused for a day
        assert s.named("old") is not None
        assert s.match(b.tokens[:300]) is None


def test_supersede_detaches_a_named_snapshot_instead_of_retiring_it(store_dir: str) -> None:
    with open_store(store_dir) as s:
        a = conv(50)
        r1 = s.save(a.tokens[:200], a.state(), session="chat")
        s.name(r1, "turn-1")
        r2 = s.save(a.tokens[:400], a.state(), session="chat")
        assert r2.parent_id == r1.snapshot_id
        m = s.named("turn-1")
        assert m is not None and m.snapshot_id == r1.snapshot_id
        assert restored(s, m, a)  # whole: fixed parts kept, still matchable
        assert s.stats().detached == 1


def test_what_cannot_be_named(store_dir: str) -> None:
    with open_store(store_dir) as s:
        a = conv(60)
        pending = s.save(a.tokens[:100], a.state(), commit=False)
        with pytest.raises(ss.StateError):
            s.name(pending, "p")
        done = s.save(a.tokens[:300], a.state())
        bad_names: tuple[object, ...] = ("", "x" * 257, "a\nb", 7)
        for bad in bad_names:
            with pytest.raises(ss.InvalidInputError):
                s.name(done, bad)  # type: ignore[arg-type]
        for ttl in (0, -1, float("nan"), True):
            with pytest.raises(ss.InvalidInputError):
                s.name(done, "ok", ttl_s=ttl)
        with pytest.raises(ss.NotFoundError):
            s.name(10_000, "ghost")


def test_delete_removes_the_name(store_dir: str) -> None:
    with open_store(store_dir) as s:
        a = conv(61)
        r = s.save(a.tokens[:300], a.state())
        s.name(r, "gone")
        s.delete(r)
        assert s.named("gone") is None
        assert s._repo.db.read(lambda t: t.all_names()) == []


def test_inspect_lists_names(store_dir: str) -> None:
    from test_cli import cli, cli_json

    with open_store(store_dir) as s:
        a = conv(62)
        r = s.save(a.tokens[:300], a.state())
        rx = s.save(a.tokens[:300], a.state(), namespace="t")
        s.name(r, "plan")
        s.name(rx, "brief", ttl_s=7200)
    doc = cli_json("--dir", store_dir, "inspect")
    [ident] = doc["identities"]
    got = [(n["namespace"], n["name"], n["snapshot_id"], n["expires"] is None) for n in ident["names"]]
    assert got == [(None, "plan", r.snapshot_id, True), ("t", "brief", rx.snapshot_id, False)]
    text = cli("--dir", store_dir, "inspect").stdout
    assert f"name 'plan' -> #{r.snapshot_id}" in text
    assert f"name 'brief' (namespace t) -> #{rx.snapshot_id}, expires in 1h" in text


def test_a_read_only_store_of_an_older_catalog_has_no_names(store_dir: str) -> None:
    import apsw
    from support.catalogs import UNDO_ADMISSION

    with open_store(store_dir) as s:
        a = conv(63)
        s.name(s.save(a.tokens[:300], a.state()), "x")
    c = apsw.Connection(f"{store_dir}/snapstore.db")
    c.execute(UNDO_ADMISSION + "PRAGMA user_version = 9")
    c.close()
    with open_store(store_dir, read_only=True) as ro:
        assert ro.named("x") is None  # schema 9: no names table, read without migrating
        with pytest.raises(ss.StateError):
            ro.name(1, "y")
    with open_store(store_dir) as s:  # a read-write open migrates: the names table is back, empty
        assert s.named("x") is None
        s.name(1, "y")
        assert s.named("y") is not None
