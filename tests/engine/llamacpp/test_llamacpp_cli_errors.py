"""``snapstore import-slot`` with no slot file at FILE: exit 2 with one sentence naming it, as
``snapstore import`` says "no export file at FILE" (was: a raw "[Errno 2] No such file or directory",
"[Errno 21] Is a directory"), and no store is created for it. The real CLI entry point.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("gguf")

import helpers_llamacpp as h  # noqa: E402

from snapstore.cli.main import main  # noqa: E402


@pytest.mark.parametrize("where", ["missing", "a directory"])
def test_import_slot_of_no_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    model = h.write_llama(str(tmp_path / "llama.gguf"))
    path = str(tmp_path / ("nofile.bin" if where == "missing" else ""))
    store = str(tmp_path / "store")
    assert main(["--dir", store, "--json", "import-slot", path, "--model", model, "--build", "b"]) == 2
    doc = json.loads(capsys.readouterr().err)  # an error document goes to stderr
    assert doc["error"] == f"no slot file at {path}" and doc["exit"] == 2
    assert not os.path.exists(store)
