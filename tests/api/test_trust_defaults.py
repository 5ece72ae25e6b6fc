"""Issue 23, items 9, 11, 13 and 14: catalog fields that are damage rather than a crash, a default
location shared by many programs, one identity under two layouts, and messages that say what is
true. Each test failed on the code before its fix (docs/reliability.md has the figures)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import apsw
import numpy as np
import pytest
from support import IDENT, LAYOUT, empty_like_state, make_state, open_store, part_hashes
from support.catalogs import UNDO_LAYOUT_KEYS

import snapstore as ss
from snapstore.cli.main import main
from snapstore.lifecycle.gc import gc

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root

ROOT = REPO_DIR


def toks(n: int, base: int = 0) -> np.ndarray:
    return np.arange(base, base + n, dtype=np.int64)


def _set(s: ss.Store, sql: str, args: tuple[Any, ...] = ()) -> None:
    """Damage the catalog on purpose (what a crafted or corrupted database holds)."""
    s._repo.db.write(lambda t: t.execute(sql, args))


def _same(dest: dict[str, np.ndarray], st: dict[str, np.ndarray], n: int) -> bool:
    rows = {name: n for name in LAYOUT.rows}
    return part_hashes(LAYOUT, dest, rows) == part_hashes(LAYOUT, st, rows)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- item 9: catalog JSON fields are bounded and validated -------------------------------------
@pytest.mark.parametrize("shape", ["[" * 100_000 + "]" * 100_000, "[[[[[[[[[[1]]]]]]]]]]", "[[2, 4]]", "[-1]",
                                   "[1e400]", '{"a": 1}', "[NaN]"])
def test_a_crafted_part_shape_is_a_store_format_error_naming_the_row(
        store_dir: str, shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    with open_store(store_dir) as s:
        st = make_state(LAYOUT, 40, seed=1)
        sid = s.save(toks(40), st).snapshot_id
        assert sid is not None
        _set(s, "UPDATE parts SET shape = ? WHERE snapshot_id = ? AND name = 'attn.kv'", (shape, sid))
        where = f"parts(snapshot {sid}, part 'attn.kv') column shape"
        for call in (lambda: s.restore(sid, into=empty_like_state(st)), lambda: s.describe(sid)):
            with pytest.raises(ss.StoreFormatError, match=f"catalog row {where}".replace("(", r"\(")
                               .replace(")", r"\)")):
                call()
        report = s.verify(deep=False)  # damage of that snapshot, not verify's end
        assert not report.ok and report.damaged_snapshots == [sid]
        assert any(where in why for why in report.damage[sid])
    code, _out, err = _cli(capsys, "--dir", store_dir, "inspect")
    assert code == 2 and where in err and "RecursionError" not in err
    code, out, _ = _cli(capsys, "--dir", store_dir, "verify")
    assert code == 1 and "DAMAGE FOUND" in out
    code, out, _ = _cli(capsys, "--dir", store_dir, "verify", "--repair")
    assert code == 1 and "REPAIRED" in out and "now verifies clean" in out  # 1: damage was found (and removed)
    assert _cli(capsys, "--dir", store_dir, "verify")[0] == 0


def test_match_passes_over_a_snapshot_whose_part_row_is_damaged(store_dir: str) -> None:
    """match() decides whether a snapshot fits the layout from its part rows: a damaged row there
    raised StoreFormatError out of every match() that reached it, instead of the next-longest
    prefix serving (the snapshot cannot restore; verify reports its damage)."""
    with open_store(store_dir) as s:
        st = make_state(LAYOUT, 80, seed=3)
        short = s.save(toks(40), {k: v[:40] if k in LAYOUT.rows else v for k, v in st.items()}, session="a")
        long = s.save(toks(80), st, session="b", parent=None)
        assert short.ok and long.ok
        _set(s, "UPDATE parts SET shape = '[' || shape WHERE snapshot_id = ? AND name = 'attn.kv'",
             (long.snapshot_id,))
        _set(s, "UPDATE snapshots SET layout_key = NULL")  # the parts decide (a row saved before v9)
        m = s.match(toks(80))
        assert m is not None and m.snapshot_id == short.snapshot_id and m.n_tokens == 40
        dest = empty_like_state(st)
        s.restore(m, into=dest)
        assert _same(dest, st, 40)
        assert s.verify(deep=False).damaged_snapshots == [long.snapshot_id]


def test_a_crafted_identity_row_neither_crashes_an_open_nor_inspect(
        store_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    other = ss.Identity(build="b2", pack="sha256:other-model")
    with open_store(store_dir, identity=other) as s:
        assert s.save(toks(20), make_state(LAYOUT, 20, seed=2)).ok
        _set(s, "UPDATE identities SET canonical = ? WHERE key = ?", ("[" * 50_000 + "]" * 50_000, other.key))
    with open_store(store_dir) as s:  # drop_stale reads every identity row: an unreadable one stays
        assert s.stats().stale_dropped == 0
    code, out, _ = _cli(capsys, "--dir", store_dir, "--json", "inspect")
    fields = {i["key"]: i["fields"] for i in json.loads(out)["identities"]}
    assert code == 0 and "damaged" in fields[other.key]["unparsable"]


# -- item 11: the default location is shared: an open drops only its own model's stale identities
def test_an_open_keeps_another_models_snapshots_and_drops_its_own_stale_ones(
        store_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    a_id = ss.Identity(build="eng-1", pack="sha256:p1")
    b_id = ss.Identity(build="eng-1", pack="sha256:p2")
    a2_id = ss.Identity(build="eng-2", pack="sha256:p1")  # the same model, rebuilt
    st = make_state(LAYOUT, 40, seed=3)
    with open_store(store_dir, identity=a_id) as a:
        ra = [a.save(toks(n), st) for n in (20, 40)]
        assert all(r.ok for r in ra)
        stored_a = a.stats().stored_bytes
    with caplog.at_level(logging.INFO, logger="snapstore"), open_store(store_dir, identity=b_id) as b:
        assert b.save(toks(30, 7), make_state(LAYOUT, 30, seed=4)).ok
        assert b.stats().stale_dropped == 0
    assert not [r for r in caplog.records if "dropped identity" in r.getMessage()]
    with open_store(store_dir, identity=a_id, drop_stale=False) as a:  # A's snapshots remain and match
        m = a.match(toks(40))
        assert m is not None and m.snapshot_id == ra[1].snapshot_id
        dest = empty_like_state(st)
        a.restore(m, into=dest)
        assert _same(dest, st, 40)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="snapstore"), open_store(store_dir, identity=a2_id) as a2:
        assert a2.match(toks(40)) is None
        assert a2.stats().stale_dropped == 2  # counted
        lines = [r.getMessage() for r in caplog.records if "dropped identity" in r.getMessage()]
        assert len(lines) == 1 and a_id.key in lines[0] and "2 snapshots" in lines[0]
        assert f"{stored_a} bytes" in lines[0] and "build=eng-1" in lines[0]
    with open_store(store_dir, identity=b_id, drop_stale=False) as b:  # the other model's stay
        assert b.match(toks(30, 7)) is not None


def test_an_open_keeps_the_same_models_snapshots_under_other_extra_keys(store_dir: str) -> None:
    """Two programs serving one model under other settings (runtime flags, adapters: ``extra``)
    share the default location at once: neither open deletes the other's snapshots."""
    rope_a = ss.Identity(build="eng-1", pack="sha256:p1", extra={"rope_freq_base": 10000})
    rope_b = ss.Identity(build="eng-1", pack="sha256:p1", extra={"rope_freq_base": 50000})
    st = make_state(LAYOUT, 40, seed=5)
    with open_store(store_dir, identity=rope_a) as a:
        assert a.save(toks(40), st).ok
    with open_store(store_dir, identity=rope_b) as b:
        assert b.stats().stale_dropped == 0
        assert b.match(toks(40)) is None  # never another configuration's state
        assert b.save(toks(30, 9), make_state(LAYOUT, 30, seed=6)).ok
    with open_store(store_dir, identity=rope_a) as a:
        assert a.stats().stale_dropped == 0 and a.match(toks(40)) is not None
    rebuilt = ss.Identity(build="eng-2", pack="sha256:p1", extra={"rope_freq_base": 10000})
    with open_store(store_dir, identity=rebuilt) as r:  # the same program rebuilt: its own go
        assert r.stats().stale_dropped == 1
    with open_store(store_dir, identity=rope_b, drop_stale=False) as b:  # the other settings' stay
        assert b.match(toks(30, 9)) is not None


def test_a_live_capture_of_a_stale_identity_stays_and_the_log_says_so(
        store_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    old = open_store(store_dir, identity=ss.Identity(build="eng-0", pack=IDENT.pack, extra=IDENT.extra))
    try:
        assert old.save(toks(30, 500), make_state(LAYOUT, 30, seed=16)).ok  # committed: stale, dropped
        p = old.save(toks(60), make_state(LAYOUT, 60, seed=17), commit=False)  # a live process's capture
        with caplog.at_level(logging.INFO, logger="snapstore"), open_store(store_dir) as s:
            assert s.stats().stale_dropped == 1
        lines = [r.getMessage() for r in caplog.records if "dropped identity" in r.getMessage()]
        assert len(lines) == 1 and "1 snapshots" in lines[0] and "pending capture and its chain stay" in lines[0]
        assert old.commit(p).ok
    finally:
        old.close()


def test_gc_keep_identity_applies_the_same_staleness_rule(store_dir: str) -> None:
    a_id = ss.Identity(build="eng-1", pack="sha256:p1")
    b_id = ss.Identity(build="eng-1", pack="sha256:p2")
    for ident, n in ((a_id, 20), (b_id, 30)):
        with open_store(store_dir, identity=ident, drop_stale=False) as s:
            assert s.save(toks(n), make_state(LAYOUT, n, seed=5)).ok
    with open_store(store_dir, identity=IDENT, drop_stale=False) as s:
        a2 = ss.Identity(build="eng-2", pack="sha256:p1")
        s._repo.db.write(lambda t: t.ensure_identity(a2.key, a2.canonical, time.time()))
        report = gc(s._repo, keep_identity=a2.key)
        assert report.stale == [1]  # A (same model as the keeper); B and this store's own stay
        left = s._repo.db.read(lambda t: {key for _i, key, *_ in t.identities()})
        assert left == {b_id.key, IDENT.key, a2.key}


# -- item 13: one identity, two layouts --------------------------------------------------------
WIDE = ss.Layout(fixed=dict(LAYOUT.fixed), rows={"attn.kv": ss.Rows("float16", (2, 4, 16)),
                                                  "mtp.kv": LAYOUT.rows["mtp.kv"]})
NO_DRAFT = ss.Layout(fixed=dict(LAYOUT.fixed), rows={"attn.kv": LAYOUT.rows["attn.kv"]})


@pytest.mark.parametrize("recorded", [True, False], ids=["layout-key", "saved-before-v9"])
def test_match_never_serves_a_snapshot_of_another_layout(store_dir: str, recorded: bool) -> None:
    a = open_store(store_dir)
    w = open_store(store_dir, layout=WIDE)
    try:
        st = make_state(LAYOUT, 40, seed=6)
        own = a.save(toks(40), st)
        assert own.ok and w.save(toks(80), make_state(WIDE, 80, seed=7)).ok
        if not recorded:  # rows an older snapstore saved: no layout key, the parts decide
            _set(a, "UPDATE snapshots SET layout_key = NULL")
        for _ in range(2):  # the second time from the remembered answer
            m = a.match(toks(80))
            assert m is not None and m.snapshot_id == own.snapshot_id and m.n_tokens == 40
            dest = empty_like_state(st)
            a.restore(m, into=dest)
            assert _same(dest, st, 40)
        mw = w.match(toks(80))
        assert mw is not None and mw.n_tokens == 80  # and the other layout is served its own
    finally:
        a.close()
        w.close()


def test_a_v8_catalog_reads_read_only_and_migrates_on_open(store_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    with open_store(store_dir) as s:
        st = make_state(LAYOUT, 40, seed=14)
        sid = s.save(toks(40), st).snapshot_id
    c = apsw.Connection(os.path.join(store_dir, "snapstore.db"))
    c.execute(UNDO_LAYOUT_KEYS + "PRAGMA user_version = 8")
    c.close()
    assert _cli(capsys, "--dir", store_dir, "--json", "inspect")[0] == 0  # read-only: the compat view
    with open_store(store_dir) as s:  # migrated: the old snapshot has no key and still matches
        assert s._repo.db.read(lambda t: t.snapshot(sid)).layout_key is None
        m = s.match(toks(50))
        assert m is not None and m.snapshot_id == sid
        dest = empty_like_state(st)
        s.restore(m, into=dest)
        assert _same(dest, st, 40)
        assert s.save(toks(50), make_state(LAYOUT, 50, seed=15)).ok


def test_a_snapshot_without_the_optional_draft_still_matches_and_restores(store_dir: str) -> None:
    with open_store(store_dir, layout=NO_DRAFT) as old:
        st = make_state(NO_DRAFT, 60, seed=8)
        assert old.save(toks(60), st).ok
    with open_store(store_dir) as new:  # a layout with the draft component
        m = new.match(toks(90))
        assert m is not None and m.n_tokens == 60
        dest = empty_like_state(make_state(LAYOUT, 60, seed=8))
        res = new.restore(m, into=dest)
        assert res.missing_components == {"draft"}
        assert dest["attn.kv"][:60].tobytes() == st["attn.kv"][:60].tobytes()
        assert new.save(toks(70), make_state(LAYOUT, 70, seed=9)).ok
    with open_store(store_dir, layout=NO_DRAFT) as old:  # and the other way: extra parts are not read
        m = old.match(toks(90))
        assert m is not None and m.n_tokens == 70


# -- item 14: messages that say what is true -----------------------------------------------------
def test_token_errors_name_the_token(store: ss.Store) -> None:
    for bad, text in (([1, 2**63], "tokens[1] = 9223372036854775808 is out of range"),
                      ([2**64], "tokens[0] = 18446744073709551616 is out of range"),
                      ([-1, 2**63], "tokens[0] = -1 is out of range")):
        with pytest.raises(ss.InvalidInputError) as e:
            store.match(bad)
        assert text in str(e.value) and "float64" not in str(e.value)
    for none in (None, 7):
        with pytest.raises(ss.InvalidInputError) as e:
            store.match(none)
        assert "must be a sequence of non-negative ints" in str(e.value) and "shape ()" not in str(e.value)


@pytest.mark.parametrize("stmt", ["from snapstore.engine import TorchAdapter", "import snapstore.engine.hf"])
def test_import_engine_without_torch_says_what_to_install(stmt: str) -> None:
    # `import snapstore.engine` itself needs no torch (snapstore.engine.mlx lives under it); the torch
    # adapter's names and the transformers integration say what to install
    code = ("import sys; sys.modules['torch'] = None\n"
            "import snapstore, snapstore.engine\n"
            "try:\n"
            f"    {stmt}\n"
            "except ImportError as e:\n"
            "    assert isinstance(e, snapstore.SnapstoreError) and e.name == 'torch', type(e)\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "pip install 'snapstore[torch]'" in out.stdout


def test_quick_verify_says_what_it_checked(store: ss.Store, capsys: pytest.CaptureFixture[str]) -> None:
    assert store.save(toks(30), make_state(LAYOUT, 30, seed=10)).ok
    code, out, _ = _cli(capsys, "--dir", store.path, "verify")
    assert code == 0 and "quick" in out and "not read" in out and "--deep" in out
    code, out, _ = _cli(capsys, "--dir", store.path, "verify", "--deep")
    assert code == 0 and "re-hashed" in out


def test_a_quarantined_snapshot_is_not_listed_as_matchable(store: ss.Store,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    sid = store.save(toks(30), make_state(LAYOUT, 30, seed=11)).snapshot_id
    assert sid is not None
    store._repo.db.write(lambda t: t.quarantine_chunk(t.part_chunks(sid, "attn.kv")[0].id, time.time()))
    assert store.match(toks(30)) is None
    info = store.snapshots()[0]
    assert not info.matchable and info.quarantined
    code, out, _ = _cli(capsys, "--dir", store.path, "--json", "inspect")
    snap = json.loads(out)["snapshots"][0]
    assert code == 0 and snap["quarantined"] and not snap["matchable"]
    code, out, _ = _cli(capsys, "--dir", store.path, "inspect")
    assert "quarantined" in out
    code, out, _ = _cli(capsys, "--dir", store.path, "stats")
    assert "quarantined    1 chunks now" in out and "healed" in out


def test_the_same_prompt_again_in_its_session_supersedes(store: ss.Store) -> None:
    a = store.save(toks(40), make_state(LAYOUT, 40, seed=12), session="chat")
    b = store.save(toks(40), make_state(LAYOUT, 40, seed=13), session="chat")  # other bytes (nondeterminism)
    assert a.snapshot_id != b.snapshot_id
    live = [i.snapshot_id for i in store.snapshots() if i.matchable]
    assert live == [b.snapshot_id]
    assert store.stats().supersedes == 1
    m = store.match(toks(40))
    assert m is not None and m.snapshot_id == b.snapshot_id
