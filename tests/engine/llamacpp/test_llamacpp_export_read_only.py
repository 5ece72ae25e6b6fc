"""``snapstore export-slot`` writes the slot file only (docs/cli.md's table): the store is read, as
``snapstore export`` reads it, so it is left byte for byte as it was (was: the catalog changed, the
export's restore recorded as a hit), and a store this user may read but not write exports too (was:
exit 2, "cannot open the store ... for writing ... open it with read_only=True", which the command
has no flag for). Real slot files, stores and the CLI entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("gguf")

import helpers_llamacpp as h  # noqa: E402
from support.stores import tree_bytes  # noqa: E402
from test_llamacpp_draft import BUILD, TOKENS, slot_file  # noqa: E402

from snapstore.cli.main import main  # noqa: E402


def _stored(tmp: Path, store: str, capsys: pytest.CaptureFixture[str]) -> tuple[str, bytes]:
    model = h.write_llama(str(tmp / "llama.gguf"))
    data = slot_file(TOKENS, seed=8)
    (tmp / "a.bin").write_bytes(data)
    assert main(["--dir", store, "--json", "import-slot", str(tmp / "a.bin"), "--model", model, "--build", BUILD]) == 0
    return str(json.loads(capsys.readouterr()[0])["snapshot_id"]), data


def test_export_slot_leaves_the_store_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    sid, data = _stored(tmp_path, store, capsys)
    before = tree_bytes(store)
    out = tmp_path / "out.bin"
    assert main(["--dir", store, "--json", "export-slot", sid, str(out)]) == 0
    assert json.loads(capsys.readouterr()[0])["exact"] is True and out.read_bytes() == data
    assert tree_bytes(store) == before


def test_export_slot_reads_a_store_this_user_cannot_write(request: pytest.FixtureRequest,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    base = tempfile.mkdtemp(prefix="snapstore-slot-ro-")  # outside pytest's 0700 directory
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    store = os.path.join(base, "store")
    sid, data = _stored(Path(base), store, capsys)
    for d, _dirs, files in os.walk(store):  # readable by all, writable by its owner only
        os.chmod(d, 0o755)
        for name in files:
            os.chmod(os.path.join(d, name), 0o644)
    outdir = os.path.join(base, "out")
    os.mkdir(outdir)
    os.chown(outdir, 65534, 65534)
    os.chmod(base, 0o755)
    before = tree_bytes(store)
    out = os.path.join(outdir, "slot.bin")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # uid 65534: may read the store, not write it
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = str(main(["--dir", store, "export-slot", sid, out]))
        except BaseException as e:
            code = f"{type(e).__name__}: {e}"
        os.write(w, code.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        code = f.read().decode()
    os.waitpid(pid, 0)
    assert code == "0", (code, capsys.readouterr()[1][-1000:])
    with open(out, "rb") as f:
        assert f.read() == data
    assert tree_bytes(store) == before
