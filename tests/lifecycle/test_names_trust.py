"""Names × the rest of the store (issue 46, items 8 and 11): a named snapshot is exempt from the
store's TTL in every query — match, lookup, the weighed match, match_many, block-granular prefixes,
expiry at open and ``gc`` — and it is kept when its identity is dropped as stale (a rebuilt engine),
counted in the budget, listed by inspect and movable to the new build with an explicit override.
Real stores throughout; time passes by setting ``last_used`` back, as a day of idleness would."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import numpy as np
import pytest
from support import IDENT, Conversation, Workload, sha, store_factory

import snapstore as ss
from snapstore.cli.main import main

ROW = ss.Rows("uint8", (128,))
LAY = ss.Layout(fixed={"rec": ss.Fixed("float32", (64,))}, rows={"kv": ROW})
open_store = store_factory(layout=LAY, staging_bytes=64 * 1024, check_rows=None)
WORKLOAD = Workload(LAY, conversations=16, max_tokens=600, levels=256)
DAY = 86400.0
TTL = ss.Budget(reserve_bytes=0, ttl=DAY)
REBUILT = dataclasses.replace(IDENT, build=IDENT.build + "-rebuilt")  # the same model, another build


def conv(k: int) -> Conversation:
    return WORKLOAD.conversation(k)


def idle(s: ss.Store, *refs: ss.SaveResult, days: float = 10) -> None:
    """Set the snapshots' last use ``days`` back (what that long without a restore leaves)."""
    then = time.time() - days * DAY
    for r in refs:
        sid = r.snapshot_id
        assert sid is not None
        s._repo.db.write(lambda t, sid=sid: t.execute(  # type: ignore[misc]
            "UPDATE snapshots SET last_used = ? WHERE id = ?", (then, sid)))


def restores(s: ss.Store, m: ss.Match, c: Conversation) -> bool:
    dest = {"rec": np.zeros(64, np.float32), "kv": np.zeros_like(c.rows["kv"])}
    r = s.restore(m, dest)
    return r.n_tokens == m.n_tokens and sha(dest["kv"][: r.n_tokens]) == sha(c.rows["kv"][: r.n_tokens])


# -- item 8: names × TTL -----------------------------------------------------------------------
def test_a_named_snapshot_unused_past_the_ttl_still_matches_in_every_query(store_dir: str) -> None:
    """In a process that has been up longer than the TTL (no open in between expires anything), a
    named snapshot unused for ten days is still served by every query that matches; an unnamed
    one of the same age is not, and unnaming puts the TTL back in force."""
    with open_store(store_dir, budget=TTL) as s:
        a, b = conv(0), conv(1)
        named, plain = s.save(a.tokens[:300], a.state()), s.save(b.tokens[:300], b.state())
        s.name(named, "plan")
        idle(s, named, plain)
        ask = np.concatenate([a.tokens[:300], [7, 8, 9]])  # the named prompt and more
        m = s.match(ask)
        assert m is not None and m.snapshot_id == named.snapshot_id and m.n_tokens == 300
        d = s.lookup(ask)
        assert d is not None and d.snapshot_id == named.snapshot_id and d.n_tokens == 300
        w = s.match(ask, prefill_tokens_per_s=1.0)  # reading 300 tokens at 1 token/s: the restore wins
        assert w is not None and w.snapshot_id == named.snapshot_id
        wd = s.lookup(ask, prefill_tokens_per_s=1.0)
        assert wd is not None and wd.snapshot_id == named.snapshot_id
        assert [x.snapshot_id if x else None for x in s.match_many([ask, b.tokens[:300]])] == \
            [named.snapshot_id, None]
        assert s.match(b.tokens[:300]) is None and s.lookup(b.tokens[:300]) is None  # the TTL holds
        assert restores(s, m, a)
        assert s.unname("plan")  # (a write: the restore's last use is recorded by now)
        idle(s, named)
        assert s.match(ask) is None and s.lookup(ask) is None  # unnamed: the TTL applies again


def test_a_name_whose_own_ttl_ran_out_no_longer_exempts(store_dir: str) -> None:
    with open_store(store_dir, budget=TTL) as s:
        a = conv(2)
        r = s.save(a.tokens[:300], a.state())
        s.name(r, "brief", ttl_s=3600)
        idle(s, r)
        assert s.match(a.tokens[:300]) is not None  # the name lives: exempt
        iid = s._repo.db.read(lambda t: t.identity_id(IDENT.key))
        sid, past = r.snapshot_id, time.time() - 1
        assert iid is not None and sid is not None
        s._repo.db.write(lambda t: t.set_name(iid, "", "brief", sid, past - 3600, past))  # its hour is over
        assert s.match(a.tokens[:300]) is None


G = 32  # tokens per row (a paged block)
BLOCKS = ss.Layout(rows={"l0": ss.Rows("float32", (2, G, 8))}, tokens_per_row=G)


def test_a_named_snapshot_past_the_ttl_serves_a_block_granular_prefix(tmp_path: Any) -> None:
    """The block-granular prefix search (a prompt sharing only the first blocks) applies the same
    rule: a named snapshot past the TTL serves its shared blocks."""
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, 50000, 8 * G)]
    rows = {"l0": rng.standard_normal((8, 2, G, 8)).astype(np.float32)}
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=BLOCKS, budget=TTL, chunk_bytes=8192,
                       staging_bytes=65536) as s:
        r = s.save(prompt, rows)
        s.name(r, "doc")
        idle(s, r)
        ask = prompt[:3 * G] + [7]
        m = s.match(ask)
        assert m is not None and m.snapshot_id == r.snapshot_id and m.n_tokens == 3 * G
        dest = {"l0": np.zeros((3, 2, G, 8), np.float32)}
        assert s.restore(m, dest).n_tokens == 3 * G and np.array_equal(dest["l0"], rows["l0"][:3])
        assert s.unname("doc")
        idle(s, r)
        assert s.match(ask) is None


def test_expiry_at_open_and_gc_keep_a_named_snapshot_past_the_ttl(store_dir: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with open_store(store_dir) as s:
        a, b, c = conv(3), conv(4), conv(5)
        named = s.save(a.tokens[:300], a.state())
        plain, plain2 = s.save(b.tokens[:300], b.state()), s.save(c.tokens[:300], c.state())
        s.name(named, "keep")
        idle(s, named, plain, plain2)
    code = main(["--dir", store_dir, "--json", "gc", "--ttl", str(int(DAY))])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["expired"] == sorted([plain.snapshot_id, plain2.snapshot_id])
    with open_store(store_dir, budget=TTL) as s:
        m = s.match(a.tokens[:300])
        assert m is not None and m.snapshot_id == named.snapshot_id and restores(s, m, a)


# -- item 11: names × stale drops ----------------------------------------------------------------
def _names(store_dir: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["--dir", store_dir, "--json", "inspect"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_a_stale_drop_keeps_named_snapshots_and_logs_and_counts_the_rest(
        store_dir: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    """A rebuilt engine opens the same model: the old build's unnamed snapshots go (one WARNING line,
    counted), its named snapshot stays whole with its chain, still counted in the budget and listed
    by inspect with its name."""
    with open_store(store_dir) as old:
        a, b = conv(6), conv(7)
        root = old.save(a.tokens[:200], a.state(200))
        leaf = old.save(a.tokens[:400], a.state(400), parent=root)  # a delta: its chain is root -> leaf
        other = old.save(b.tokens[:300], b.state())
        old.name(leaf, "agent/plan")
        kept_bytes = old.stats().stored_bytes
    with caplog.at_level(logging.WARNING, logger="snapstore"), open_store(store_dir, identity=REBUILT) as new:
        stats = new.stats()
        assert stats.stale_dropped == 1  # the unnamed snapshot only
        assert stats.stored_bytes < kept_bytes and stats.stored_bytes > 0  # the named chain's bytes stay counted
        assert new.named("agent/plan") is None  # another identity's name: not this build's to match
        assert new.match(a.tokens[:400]) is None
    lines = [r.getMessage() for r in caplog.records if "dropped identity" in r.getMessage()]
    assert len(lines) == 1 and "1 snapshots" in lines[0] and "1 named snapshot" in lines[0]
    doc = _names(store_dir, capsys)
    ids = {d["id"] for d in doc["snapshots"]}
    assert ids == {root.snapshot_id, leaf.snapshot_id} and other.snapshot_id not in ids
    old_ident = next(i for i in doc["identities"] if i["key"] == IDENT.key)
    assert [n["name"] for n in old_ident["names"]] == ["agent/plan"]
    with open_store(store_dir, identity=REBUILT) as again:  # the next open drops nothing more
        assert again.stats().stale_dropped == 1
    with open_store(store_dir, drop_stale=False) as back:  # the old build still restores it, by name
        m = back.named("agent/plan")
        assert m is not None and m.snapshot_id == leaf.snapshot_id and restores(back, m, a)


def test_a_kept_named_snapshot_is_unnamed_then_dropped_at_the_next_stale_open(store_dir: str) -> None:
    """The name is what keeps it: once the name is gone (unnamed, or its ttl over), the next open of
    the new build drops it like any stale snapshot."""
    with open_store(store_dir) as old:
        a = conv(8)
        r = old.save(a.tokens[:300], a.state())
        old.name(r, "brief", ttl_s=3600)
    with open_store(store_dir, identity=REBUILT) as new:
        assert new.stats().stale_dropped == 0
    with open_store(store_dir, drop_stale=False) as old:
        assert old.unname("brief")
    with open_store(store_dir, identity=REBUILT) as new:
        assert new.stats().stale_dropped == 1
        assert new._repo.db.read(lambda t: t.identity_id(IDENT.key)) is None  # its identity went with it


def test_a_kept_named_snapshot_moves_to_the_new_build_with_an_explicit_override(
        store_dir: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Exportable (by its name and old identity) and importable under the new build's identity with
    --accept-identity: restored by name there, byte-exact."""
    with open_store(store_dir) as old:
        a = conv(9)
        r = old.save(a.tokens[:300], a.state())
        old.name(r, "agent/plan")
    with open_store(store_dir, identity=REBUILT) as new:
        new.save(conv(10).tokens[:100], conv(10).state(100))  # the new build's own work
    out = str(tmp_path / "plan.snapx")
    assert main(["--dir", store_dir, "export", "--name", "agent/plan", out]) == 0
    capsys.readouterr()
    assert main(["--dir", store_dir, "import", out, "--identity", REBUILT.key]) == 2  # another identity: refused
    assert "accept" in capsys.readouterr().err
    assert main(["--dir", store_dir, "--json", "import", out, "--identity", REBUILT.key,
                 "--accept-identity", IDENT.key]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["imported_from"] == IDENT.key and got["name"] == "agent/plan"
    with open_store(store_dir, identity=REBUILT) as new:
        m = new.named("agent/plan")
        assert m is not None and restores(new, m, a)
        assert new.match(a.tokens[:300]) is None  # an override import: by name only, never matched


def test_an_explicit_drop_identity_still_drops_named_snapshots(store_dir: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``gc --drop-identity KEY`` is the operator's own decision about that identity: everything of it
    goes, named or not (only the stale rule spares names)."""
    with open_store(store_dir) as s:
        a = conv(11)
        r = s.save(a.tokens[:300], a.state())
        s.name(r, "n")
    assert main(["--dir", store_dir, "--json", "gc", "--drop-identity", IDENT.key]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stale"] == [r.snapshot_id]
    with open_store(store_dir) as s:
        assert s.named("n") is None and s.match(a.tokens[:300]) is None
