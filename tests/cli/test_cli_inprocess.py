"""The fast tier's check of every ``snapstore`` command (tests/cli/test_cli.py runs them as subprocesses
in the slow tier): exit codes, the JSON envelope on stdout, and the error object on stderr, through
``main()`` in this process on a real store (docs/cli.md "Exit codes", "JSON output")."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from support import LAYOUT, Workload, open_store

from snapstore.cli.main import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None]:
    """Exit code, the JSON object on stdout (if any) and the one on stderr (if any)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), (json.loads(err) if err.strip() else None)


@pytest.fixture
def store(store_dir: str) -> str:
    w = Workload(LAYOUT, conversations=2, max_tokens=200)
    with open_store(store_dir) as s:
        for k in range(2):
            for j, n in enumerate((80, 200)):
                assert s.save(w.tokens(k)[:n], w.state(k, n), parent="auto" if j else None).ok
    return store_dir


def test_every_command_exit_code_and_json(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = ["--dir", store, "--json"]
    code, doc, _ = _run(capsys, *d, "inspect")
    assert code == 0 and doc is not None and doc["command"] == "inspect" and doc["totals"]["snapshots"] == 4
    code, doc, _ = _run(capsys, *d, "inspect", "2")
    assert code == 0 and doc is not None and [c["id"] for c in doc["snapshot"]["chain"]] == [1, 2]
    code, out, err = _run(capsys, *d, "inspect", "99")
    assert code == 1 and out is None and err is not None and err["exit"] == 1 and err["command"] == "inspect"
    code, doc, _ = _run(capsys, *d, "stats")
    assert code == 0 and doc is not None and doc["stats"]["snapshots"] == 4
    code, doc, _ = _run(capsys, *d, "verify", "--deep")
    assert code == 0 and doc is not None and doc["status"] == "clean" and doc["ok"]
    code, doc, _ = _run(capsys, *d, "gc", "--dry-run", "--max-entries", "1")
    assert code == 0 and doc is not None and doc["dry_run"] and 4 - len(doc["removed_snapshots"]) == 1
    code, doc, _ = _run(capsys, *d, "stats")
    assert doc is not None and doc["stats"]["snapshots"] == 4  # the dry run removed nothing


def test_damage_exits_1_and_repair_says_repaired(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    blobs = sorted(os.path.join(r, f) for r, _, fs in os.walk(os.path.join(store, "blobs")) for f in fs)
    with open(blobs[0], "r+b") as f:  # flip one byte of a chunk's payload
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    code, doc, _ = _run(capsys, "--dir", store, "--json", "verify", "--deep")
    assert code == 1 and doc is not None and doc["status"] == "damaged" and doc["affected_snapshots"]
    code, doc, _ = _run(capsys, "--dir", store, "--json", "verify", "--deep", "--repair")
    assert code == 1 and doc is not None and doc["status"] == "repaired" and doc["clean_after_repair"]
    code, doc, _ = _run(capsys, "--dir", store, "--json", "verify", "--deep")
    assert code == 0 and doc is not None and doc["status"] == "clean"


def test_usage_errors_exit_2_with_the_error_object(tmp_path: Any, store: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--dir", str(tmp_path / "none"), "--json", "stats")
    assert code == 2 and out is None and err is not None and err["command"] == "stats"
    assert "no snapstore store" in err["error"]
    code, out, err = _run(capsys, "--json", "no-such-command")
    assert code == 2 and out is None and err is not None and err["command"] is None
    code, out, err = _run(capsys, "--dir", store, "--json", "gc", "--drop-identity", "id-zzzzzzzz")
    assert code == 2 and out is None and err is not None and err["command"] == "gc"
    code, doc, _ = _run(capsys, "--dir", store, "--json", "stats")  # the refused gc removed nothing
    assert code == 0 and doc is not None and doc["stats"]["snapshots"] == 4
