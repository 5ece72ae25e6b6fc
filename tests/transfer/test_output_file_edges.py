"""The public pieces an integration writes its own formats with (issue 51), at their edges: an
interrupt while ``OutputFile`` (and so ``Store.export``) makes its file durable leaves no temporary
file; a long but valid file name can be written; ``Store.identity_of`` and ``Store.check_export``
refuse an argument of the wrong type with a SnapstoreError saying what was wrong. Real stores and
files; the interrupt is an ``os.fsync`` that raises KeyboardInterrupt (Ctrl-C during a long fsync).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import snapstore as ss

IDENT = ss.Identity(build="eng-1.0", pack="sha256:output-file-edges", kv="f16", extra={"engine": "test"})
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (64,))})
KV = np.random.default_rng(52).integers(0, 256, (200, 64), dtype=np.uint8)
TOKENS = list(range(11, 211))


def _interrupted_fsync(fd: int) -> None:
    raise KeyboardInterrupt


def test_an_interrupt_during_the_fsync_leaves_no_temporary_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: the ``.NAME.RANDOM.part`` file stayed (publish's error path caught OSError only)."""
    dest = tmp_path / "slot.bin"
    dest.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with ss.OutputFile(dest, overwrite=True) as out:
            out.write(b"new bytes")
            monkeypatch.setattr(os, "fsync", _interrupted_fsync)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["slot.bin"] and dest.read_bytes() == b"old"
    with pytest.raises(ss.StateError):  # discarded: nothing more is written to it
        out.write(b"late")


def test_an_export_interrupted_during_its_fsync_leaves_nothing(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Store.export through OutputFile (268c603): the old export unlinked its temporary file on any
    exit; an interrupt during the fsync must still leave no file beside the destination."""
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as s:
        saved = s.save(TOKENS, {"kv": KV})
        monkeypatch.setattr(os, "fsync", _interrupted_fsync)
        with pytest.raises(KeyboardInterrupt):
            s.export(saved, tmp_path / "chain.snapx")
        monkeypatch.undo()
        assert sorted(os.listdir(tmp_path)) == ["s"]
        s.export(saved, tmp_path / "chain.snapx")  # and the next try writes it
    assert sorted(os.listdir(tmp_path)) == ["chain.snapx", "s"]


@pytest.mark.parametrize("name", ["a" * 255, "é" * 125 + ".bin", "a" + "é" * 127, "b" * 240 + ".safetensors"])
def test_a_long_valid_file_name_is_written(tmp_path: Path, name: str) -> None:
    """The temporary name adds ~20 bytes to the destination's: was ENAMETOOLONG for a name the
    file system takes (a StoreIOError 'File name too long' for a file that could be written)."""
    suffix = ".safetensors" if name.endswith(".safetensors") else ""
    with ss.OutputFile(tmp_path / name, suffix=suffix) as out:
        assert len(os.fsencode(os.path.basename(out.tmp_path))) <= 255 and out.tmp_path.endswith(".part" + suffix)
        out.tmp_path.encode("utf-8")  # cut at a character: a writer given the name may encode it strictly
        out.write(b"x")
    assert (tmp_path / name).read_bytes() == b"x" and os.listdir(tmp_path) == [name]


def test_identity_of_a_path_that_is_no_path_is_a_config_error() -> None:
    """Was: a TypeError from os.fspath."""
    for bad in (None, 7, b"/tmp"):
        with pytest.raises(ss.ConfigError, match="store path must be a str"):
            ss.Store.identity_of(bad, 1)  # type: ignore[arg-type]


def test_check_export_refuses_an_accept_identity_that_is_no_key(tmp_path: Path) -> None:
    """accept_identity was checked only for marked state: 5 passed silently for the store's own."""
    with ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=LAYOUT) as s:
        saved = s.save(TOKENS, {"kv": KV})
        with pytest.raises(ss.IdentityError, match="accept_identity must be an identity key"):
            s.check_export(saved, "slot file", accept_identity=5)  # type: ignore[arg-type]
        assert s.check_export(saved, "slot file", accept_identity=IDENT.key) is True  # own state: exact
