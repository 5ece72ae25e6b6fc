"""What the integrations use of the public API instead of the core's internals (issue 51): an output
file written by the store's rule (``OutputFile``), a snapshot's identity from its id alone
(``Store.identity_of``), the identity-override check of an export in an engine's own format
(``Store.check_export``), the default store directory (``default_dir``) and the paged pool's readings
(``PagedRows.pool_axes`` / ``block_indices``). Real stores and files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import snapstore as ss

IDENT = ss.Identity(build="eng-1.0", pack="sha256:integration-api", kv="f16", extra={"engine": "test"})
OTHER = ss.Identity(build="eng-1.0", pack="sha256:another-quant", kv="f16", extra={"engine": "test"})
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (64,))})
KV = np.random.default_rng(51).integers(0, 256, (200, 64), dtype=np.uint8)
TOKENS = list(range(7, 207))


def _open(path: Path, identity: ss.Identity = IDENT) -> ss.Store:
    return ss.Store.open(str(path), identity=identity, layout=LAYOUT, chunk_bytes=4096)


# -- OutputFile -------------------------------------------------------------------------------------
def test_an_output_file_appears_whole_on_a_clean_exit(tmp_path: Path) -> None:
    dest = tmp_path / "slot.bin"
    with ss.OutputFile(dest, what="the slot file") as out:
        out.write(b"abc")
        out.write(memoryview(b"def"))
        assert not dest.exists() and os.path.exists(out.tmp_path)  # nothing at the path until published
        assert os.path.dirname(out.tmp_path) == str(tmp_path)  # beside it: one rename puts it in place
    assert dest.read_bytes() == b"abcdef"
    assert os.stat(dest).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == ["slot.bin"]  # no temporary file left


def test_an_output_file_that_fails_leaves_the_old_file(tmp_path: Path) -> None:
    dest = tmp_path / "cache.safetensors"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with ss.OutputFile(dest, overwrite=True, suffix=".safetensors") as out:
            assert out.tmp_path.endswith(".safetensors")
            Path(out.tmp_path).write_bytes(b"half")  # a writer that takes a file name
            raise RuntimeError("writer failed")
    assert dest.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["cache.safetensors"]


def test_an_output_file_replaces_a_file_only_when_asked(tmp_path: Path) -> None:
    dest = tmp_path / "x.bin"
    dest.write_bytes(b"old")
    with pytest.raises(ss.ConfigError, match="a file is there already"):
        ss.OutputFile(dest)
    with ss.OutputFile(dest, overwrite=True) as out:
        out.write(b"new")
    assert dest.read_bytes() == b"new"


def test_an_output_file_is_never_written_inside_a_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with _open(store) as s:
        s.save(TOKENS, {"kv": KV})
    before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file() and "-" not in p.name}
    for inside in (store / "snapstore.db", store / "blobs" / "x.bin", store / "y.bin"):
        with pytest.raises(ss.ConfigError, match="inside the snapstore store|store's own file name"):
            ss.OutputFile(inside, overwrite=True, what="the slot file")
    with pytest.raises(ss.ConfigError, match="store's own file name"):
        ss.OutputFile(tmp_path / "snapstore.db", overwrite=True)
    # the store being read is refused even while its catalog is absent (store_root)
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ss.ConfigError, match="inside the snapstore store"):
        ss.OutputFile(bare / "z.bin", store_root=bare)
    assert before == {p: p.read_bytes() for p in before}


def test_an_output_file_with_nothing_written_publishes_nothing(tmp_path: Path) -> None:
    out = ss.OutputFile(tmp_path / "never.bin")
    with pytest.raises(ss.StateError, match="nothing was written"):
        out.publish()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ss.StateError):
        out.write(b"late")


# -- Store.identity_of ----------------------------------------------------------------------------
def test_identity_of_names_the_identity_a_snapshot_was_saved_under(tmp_path: Path) -> None:
    with _open(tmp_path / "s") as a, _open(tmp_path / "s", OTHER) as b:
        mine = a.save(TOKENS, {"kv": KV})
        theirs = b.save(TOKENS[:100], {"kv": KV[:100]})
        assert ss.Store.identity_of(tmp_path / "s", mine.snapshot_id) == IDENT
        assert ss.Store.identity_of(str(tmp_path / "s"), theirs) == OTHER  # a SaveResult names it too
    with pytest.raises(ss.NotFoundError, match="no snapshot 999"):
        ss.Store.identity_of(tmp_path / "s", 999)
    with pytest.raises(ss.InvalidInputError):
        ss.Store.identity_of(tmp_path / "s", -1)


# -- Store.check_export ---------------------------------------------------------------------------
def test_check_export_follows_the_identity_override_policy(tmp_path: Path) -> None:
    exported = str(tmp_path / "chain.snapx")
    with _open(tmp_path / "a") as a:
        own = a.save(TOKENS, {"kv": KV})
        assert a.check_export(own, "slot file") is True  # the store's own state: an exact file
        a.export(own, exported)
    with _open(tmp_path / "b", OTHER) as b:
        moved = b.import_file(exported, accept_identity=IDENT.key)
        assert moved.imported_from == IDENT.key
        with pytest.raises(ss.IdentityError, match="cannot carry that mark"):
            b.check_export(moved.snapshot_id, "slot file")
        with pytest.raises(ss.IdentityError, match="cannot carry that mark"):
            b.check_export(moved.snapshot_id, "slot file", accept_identity=OTHER.key)  # not the one that computed it
        assert b.check_export(moved.snapshot_id, "slot file", accept_identity=IDENT.key) is False  # an approximation
    with _open(tmp_path / "b") as b_as_ident, pytest.raises(ss.IdentityError, match="another identity"):
        b_as_ident.check_export(moved.snapshot_id, "slot file")  # ownership is checked, as for export


# -- default_dir, PagedRows' readings -------------------------------------------------------------
def test_default_dir_is_the_directory_store_open_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNAPSTORE_DIR", str(tmp_path / "here"))
    assert ss.default_dir() == str(tmp_path / "here")
    with ss.Store.open(identity=IDENT, layout=LAYOUT) as s:
        assert os.path.samefile(s.path, ss.default_dir())


def test_paged_rows_readings_are_public_static_methods() -> None:
    assert ss.PagedRows.pool_axes(5, (1, -3)) == (1, 2)
    with pytest.raises(ss.InvalidInputError, match="must differ"):
        ss.PagedRows.pool_axes(4, (2, 2))
    table = ss.PagedRows.block_indices([3, 1, 2])
    assert table.dtype == np.int64 and table.tolist() == [3, 1, 2]
    with pytest.raises(ss.InvalidInputError, match="1-D sequence"):
        ss.PagedRows.block_indices([[1, 2]])
