"""Bad input to the public API and CLI: a SnapstoreError subclass saying what to pass, and the store as
it was (a bad-input sweep of every public call, issue 48's seventh-pass review). Each test failed on the
code before it: a bare TypeError / AttributeError / UnicodeEncodeError / OverflowError, a traceback, a
store that took another program's database, or bytes of another namespace stored."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from support import IDENT, LAYOUT, empty_like_state, make_state, open_store

import snapstore as ss
from snapstore.cli.main import main
from snapstore.parts.meta import EngineMeta

TOKENS = list(range(1, 41))


def _exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray], n: int) -> bool:
    return got["rec.state"].tobytes() == want["rec.state"].tobytes() and all(
        got[k][:n].tobytes() == want[k][:n].tobytes() for k in ("attn.kv", "mtp.kv"))


def test_a_store_whose_path_is_not_utf8_opens_saves_restores_and_the_cli_reads_it(tmp_path: Any) -> None:
    """A directory named in another encoding (kept by Python as surrogates): SQLite is handed the
    path's bytes in a URI, and the CLI prints them as they are. Before: UnicodeEncodeError everywhere."""
    root = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"st\xff"))
    state = make_state(LAYOUT, 40, seed=1)
    with open_store(root) as s:
        r = s.save(TOKENS, state)
        out = empty_like_state(state)
        s.restore(r, out)
        assert _exact(out, state, 40)
    with open_store(root, read_only=True) as s:
        m = s.match(TOKENS)
        assert m is not None and m.n_tokens == 40
    for argv in (["inspect"], ["stats"], ["verify"], ["gc", "--dry-run"]):  # the command, as a user runs it
        p = subprocess.run([sys.executable, "-m", "snapstore", "--dir", root, *argv], capture_output=True)
        assert p.returncode == 0, (argv, p.stderr)
        assert b"Traceback" not in p.stderr and os.fsencode(root) in p.stdout + p.stderr


@pytest.mark.parametrize("name", ["a?b", "c#d", "e%20f", "g h", "ü"])
def test_store_paths_with_uri_characters_name_their_own_files(tmp_path: Any, name: str) -> None:
    """The catalog is opened through an SQLite URI: characters a URI gives meaning to stay the path's own
    (the catalog lands in the directory named, read and written alike), a leading "//" included."""
    for root in (str(tmp_path / name / "s"), "/" + str(tmp_path / name / "t")):
        state = make_state(LAYOUT, 40, seed=8)
        with open_store(root) as s:
            assert s.save(TOKENS, state).ok
        assert os.path.isfile(os.path.join(root, "snapstore.db"))
        with open_store(root, read_only=True) as s:
            m = s.match(TOKENS)
            assert m is not None and m.n_tokens == 40
    assert sorted(os.listdir(tmp_path)) == [name]


def test_an_empty_dir_option_is_refused_not_the_default_store(capsys: pytest.CaptureFixture[str]) -> None:
    """``--dir "$UNSET"`` named the shared default store (and `gc` would collect it)."""
    for argv in (["--dir", "", "gc", "--dry-run"], ["--dir", "", "--json", "stats"]):
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 2
        assert "--dir is empty" in (json.loads(err)["error"] if "--json" in argv else err)


def test_another_programs_sqlite_database_is_refused_and_left_as_it_was(tmp_path: Any) -> None:
    """A ``snapstore.db`` another program made: refused before anything is written to it or created
    beside it. Before: migrated into (user_version 0), switched to WAL, blobs/ made beside it."""
    for version in (0, 7):
        root = tmp_path / f"other{version}"
        root.mkdir()
        db = root / "snapstore.db"
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        con.execute("INSERT INTO customers (name) VALUES ('ada')")
        con.execute(f"PRAGMA user_version = {version}")
        con.commit()
        con.close()
        before = db.read_bytes()
        with pytest.raises(ss.StoreFormatError, match="another program's SQLite database"):
            open_store(str(root))
        assert db.read_bytes() == before
        assert sorted(os.listdir(root)) == ["snapstore.db"]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    sqlite3.connect(fresh / "snapstore.db").close()  # an empty file SQLite made: a new store fills it
    with open_store(str(fresh)) as s:
        assert s.save(TOKENS, make_state(LAYOUT, 40)).ok


def test_strings_that_are_not_utf8_are_refused_as_names_namespaces_and_sessions(store: ss.Store) -> None:
    state = make_state(LAYOUT, 40, seed=2)
    r = store.save(TOKENS, state)
    bad = "tenant-\udcff"
    calls = [lambda: store.save(TOKENS, state, namespace=bad), lambda: store.save(TOKENS, state, session=bad),
             lambda: store.match(TOKENS, namespace=bad), lambda: store.lookup(TOKENS, namespace=bad),
             lambda: store.name(r, bad), lambda: store.named(bad), lambda: store.unname(bad),
             lambda: store.save(TOKENS, state, namespace=bad, wait=False)]
    for call in calls:
        with pytest.raises(ss.InvalidInputError, match="UTF-8"):
            call()
    assert store.verify().ok and store.match(TOKENS) is not None


def test_a_parent_handle_of_another_store_is_refused_waiting_or_not(tmp_path: Any) -> None:
    """Its id would have named one of this store's snapshots (the wait=False path checked; wait=True did not)."""
    state = make_state(LAYOUT, 40, seed=3)
    with open_store(str(tmp_path / "a")) as a, open_store(str(tmp_path / "b")) as b:
        b.save(list(range(100, 140)), state)
        handle = a.save(TOKENS, state, wait=False)
        for wait in (True, False):
            with pytest.raises(ss.InvalidInputError, match="of this store"):
                b.save(TOKENS + [41], make_state(LAYOUT, 41), parent=handle, wait=wait)
        assert handle.result().ok
        assert b.match(TOKENS + [41]) is None


def test_waits_take_any_timeout_and_refuse_what_is_not_one(store: ss.Store) -> None:
    state = make_state(LAYOUT, 40, seed=4)
    handle = store.save(TOKENS, state, wait=False)
    assert handle.result(timeout=1e300).ok  # before: OverflowError
    assert handle.exception(timeout=2**63) is None
    assert store.flush(timeout=1e300) and store.flush(timeout=float("inf"))
    assert handle.result(timeout=float("inf")).ok and handle.result(timeout=-1).ok  # negative: no wait, as a Future's
    for bad in ("1", float("nan")):
        with pytest.raises(ss.InvalidInputError, match="timeout"):
            handle.result(timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(ss.InvalidInputError, match="timeout"):
            store.flush(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ss.InvalidInputError, match="timeout"):
        store.flush(timeout=-1)
    with pytest.raises(ss.InvalidInputError, match="callable"):
        handle.add_done_callback(5)  # type: ignore[arg-type]


def test_a_staging_buffer_past_what_can_be_held_is_a_config_error(tmp_path: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ss.ConfigError, match="staging_bytes"):
        open_store(str(tmp_path / "s"), staging_bytes=2**62)
    monkeypatch.setenv("SNAPSTORE_STAGING_MIB", str(2**50))
    with pytest.raises(ss.ConfigError, match="staging_bytes"):
        ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix, as a user may still pass it
def test_array_subclasses_save_and_restore_as_arrays_and_masked_arrays_are_refused(store: ss.Store) -> None:
    """An np.matrix destination passed the plan check, then its own 2-D reshape made a healthy chunk
    look truncated (CorruptChunkError, touched); a masked array failed mid-stream with a TypeError."""
    layout = ss.Layout(fixed={"m": ss.Fixed("float32", (4, 4))})
    with ss.Store.open(os.path.join(os.path.dirname(store._repo.root), "m"), identity=IDENT, layout=layout) as s:
        src = np.asmatrix(np.arange(16, dtype=np.float32).reshape(4, 4))
        r = s.save([1, 2, 3], {"m": src})
        assert r.ok
        dst = np.asmatrix(np.zeros((4, 4), dtype=np.float32))
        s.restore(r, {"m": dst})
        assert np.array_equal(np.asarray(dst), np.asarray(src))
        masked = np.ma.masked_array(np.zeros((4, 4), dtype=np.float32), mask=np.eye(4, dtype=bool))
        with pytest.raises(ss.LayoutError, match="masked array"):
            s.save([1, 2, 3, 4], {"m": masked})
        with pytest.raises(ss.DestinationError, match="masked array") as e:
            s.restore(r, {"m": masked})
        assert not e.value.touched and not masked.data.any()
        assert s.verify(deep=True).ok and not any(x.quarantined for x in s.snapshots())


class _LazyReader:
    """A PartReader that writes nothing into ``out`` (an engine's bug)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def read_into(self, offset: int, out: memoryview) -> None:
        return None


def test_a_reader_that_writes_nothing_stores_zeros_never_another_namespaces_bytes(store: ss.Store) -> None:
    """The staging slot a reader is handed held the last save's bytes; a reader that left them stored
    them under its own namespace (invariant 10). They are zeroed first."""
    a = make_state(LAYOUT, 40, seed=5)
    assert store.save(TOKENS, a, namespace="tenant-a").ok
    lazy = {**make_state(LAYOUT, 40, seed=6), "attn.kv": _LazyReader(a["attn.kv"].nbytes)}
    r = store.save(TOKENS, lazy, namespace="tenant-b")
    assert r.ok
    out = empty_like_state(a)
    out["attn.kv"][:] = 1
    store.restore(r, out, namespace="tenant-b")
    assert not out["attn.kv"].any()


def test_helpers_and_batch_calls_refuse_wrong_types_with_snapstore_errors(store: ss.Store) -> None:
    state = make_state(LAYOUT, 40, seed=7)
    r = store.save(TOKENS, state)
    cases: list[tuple[Any, type[ss.SnapstoreError]]] = [
        (lambda: ss.Layout(fixed=None, rows={"r": ss.Rows("uint8", (4,))}), ss.LayoutError),  # type: ignore[arg-type]
        (lambda: ss.Layout(rows=[("r", ss.Rows("uint8", (4,)))]), ss.LayoutError),  # type: ignore[arg-type]
        (lambda: LAYOUT.valid_rows("nope", 5), ss.LayoutError),
        (lambda: LAYOUT.valid_rows("rec.state", 5), ss.LayoutError),
        (lambda: LAYOUT.valid_rows("attn.kv", "5"), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: ss.row_span("0", 10, 2), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: ss.row_span(0, None, 2), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: ss.PagedRows(np.zeros((4, 16, 8)), [0], axes=np.array(0)), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: ss.PagedRows(np.zeros((0, 16, 8)), []), ss.InvalidInputError),
        (lambda: ss.PagedRows(np.empty((4, 16, 8), dtype=object), [0]), ss.InvalidInputError),
        (lambda: EngineMeta(5), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: EngineMeta(["a"]).pack("x"), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: EngineMeta([]), ss.InvalidInputError),
        (lambda: ss.Identity.from_dict(np.int64(3)), ss.ConfigError),  # type: ignore[arg-type]
        (lambda: ss.Budget.for_model(LAYOUT, conversations=1, tokens=10, disk_bytes=5), ss.ConfigError),
        (lambda: store.match_many(None), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: store.match_many(5), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: store.restore_many(None), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: store.match(TOKENS, exclude=np.array(1)), ss.InvalidInputError),
        (lambda: store.load(TOKENS, allocate=None), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: store.turn(parent="bogus"), ss.InvalidInputError),  # at the turn, not its first capture
        (lambda: store.turn(parent=1.5), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: store.turn(namespace=""), ss.InvalidInputError),
        (lambda: store.export(r, os.path.join(store._repo.root, "..", "x.snapx"), progress=5), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: store.import_file("nowhere.snapx", progress="x"), ss.InvalidInputError),  # type: ignore[arg-type]
        (lambda: store.save(TOKENS, {**state, "attn.kv": _Sized("x")}), ss.LayoutError),
        (lambda: store.restore(r, {**empty_like_state(state), "attn.kv": _Sized("x")}), ss.DestinationError),
    ]
    for i, (call, err) in enumerate(cases):
        with pytest.raises(err):
            call()
        assert i >= 0
    out = empty_like_state(state)
    store.restore(r, out)
    assert _exact(out, state, 40) and store.verify().ok
    assert EngineMeta({"pos": 0, "seed": 1}.keys()).fields == ("pos", "seed")  # any iterable of names


class _Sized:
    """A reader and a writer whose ``nbytes`` is no count."""

    def __init__(self, nbytes: object) -> None:
        self.nbytes = nbytes

    def read_into(self, offset: int, out: memoryview) -> None:
        raise AssertionError("never called")

    def write_from(self, offset: int, data: memoryview) -> None:
        raise AssertionError("never called")
