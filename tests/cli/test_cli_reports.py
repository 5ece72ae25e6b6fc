"""The CLI prints the library's reports: ``inspect --json`` is the inspect report's ``to_dict()``, its
snapshots are ``Store.snapshots()``'s infos, and every command writes only through its run's context.
(``--remote``'s local part: tests/servers/test_remote_fleet.py, beside the shared tier's server.)"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from functools import partial
from typing import Any

import apsw
import numpy as np
import pytest
from support import IDENT, LAYOUT

import snapstore as ss
from snapstore.check.inspect import inspect_snapshot, inspect_store, resolve_identity
from snapstore.chunks.repo import SnapshotRepo
from snapstore.cli.commands import inspect_doc
from snapstore.cli.parser import ArgumentsError, build_parser
from snapstore.console.context import CliContext

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root

ROOT = REPO_DIR


def _state(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, spec in LAYOUT.fixed.items():
        out[name] = rng.integers(0, 256, spec.nbytes, dtype=np.uint8).view(spec.dtype).reshape(spec.shape)
    for name, rows in LAYOUT.rows.items():
        raw = rng.integers(0, 256, n * rows.row_bytes, dtype=np.uint8)
        out[name] = raw.view(rows.dtype).reshape((n, *rows.row_shape))
    return out


def _build(d: str) -> list[ss.SnapshotInfo]:
    """A chain with a branch, a session whose newer snapshot supersedes the older, a second namespace.

    Returns ``Store.snapshots()`` as the library lists it (taken before the store closes).
    """
    with ss.Store.open(d, identity=IDENT, layout=LAYOUT, chunk_bytes=4096, staging_bytes=65536,
                       budget=ss.Budget(reserve_bytes=0)) as s:
        base = list(range(100))
        s.save(base, _state(100, 1))
        s.save(base + list(range(1000, 1100)), _state(200, 2))
        s.save(base + list(range(2000, 2050)), _state(150, 3))
        s.save(list(range(5000, 5080)), _state(80, 4), session="chat")
        s.save(list(range(5000, 5120)), _state(120, 5), session="chat")
        s.save(list(range(7000, 7060)), _state(60, 6), namespace="tenant-b")
        return s.snapshots()


def _cli_json(d: str, *args: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "snapstore", "--dir", d, *args, "--json"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, (r.stdout, r.stderr)
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def test_inspect_json_is_the_library_report_and_its_snapshots_are_store_snapshots(store_dir: str) -> None:
    listed = _build(store_dir)
    assert any(not i.matchable for i in listed) and any(i.pinned for i in listed)  # the cases are there
    doc = _cli_json(store_dir, "inspect")
    repo = SnapshotRepo.open(store_dir)
    try:
        report = repo.db.read(lambda c: inspect_store(c, store_dir))
        details = {i.snapshot_id: repo.db.read(partial(inspect_snapshot, root=store_dir, sid=i.snapshot_id))
                   for i in listed}
    finally:
        repo.close()
    assert doc == {"format": 1, "command": "inspect", **report.to_dict()}
    # one description of a snapshot: inspect's entries carry exactly the infos Store.snapshots() returns
    assert [e.info for e in report.snapshots] == listed
    superseded = next(i.snapshot_id for i in listed if not i.matchable)
    for sid in (listed[2].snapshot_id, superseded):  # a branch; a chain link kept for its child
        detail = details[sid]
        one = _cli_json(store_dir, "inspect", str(sid))
        assert one == {"format": 1, "command": "inspect", **detail.to_dict()} == inspect_doc(detail)
        assert detail.snapshot.info == next(i for i in listed if i.snapshot_id == sid)
        # the overview's entry is the detail's, with parts by name and no chain
        expected = {k: v for k, v in one["snapshot"].items() if k != "chain"}
        expected["parts"] = [p["name"] for p in one["snapshot"]["parts"]]
        assert next(e for e in doc["snapshots"] if e["id"] == sid) == expected
    for sid, detail in details.items():  # every detail report extends the overview's entry
        entry = next(e for e in report.snapshots if e.info.snapshot_id == sid)
        assert detail.snapshot.to_dict() == entry.to_dict()


def test_commands_write_only_to_their_run_context(store_dir: str, capfd: pytest.CaptureFixture[str]) -> None:
    _build(store_dir)
    args = build_parser().parse_args(["--dir", store_dir, "inspect"])
    as_text = CliContext(json=False, stdout=io.StringIO(), stderr=io.StringIO())
    as_json = CliContext(json=True, stdout=io.StringIO(), stderr=io.StringIO())
    assert args.run(args, as_json) == 0 and args.run(args, as_text) == 0
    assert capfd.readouterr() == ("", "")  # nothing went to the process's own streams
    assert isinstance(as_json.stdout, io.StringIO) and isinstance(as_text.stdout, io.StringIO)
    repo = SnapshotRepo.open(store_dir)
    try:
        report = repo.db.read(lambda c: inspect_store(c, store_dir))
    finally:
        repo.close()
    assert json.loads(as_json.stdout.getvalue()) == inspect_doc(report)
    text = as_text.stdout.getvalue()
    assert f"identity {IDENT.key}" in text and "namespace tenant-b: 1 snapshots" in text
    assert as_text.meters == [] and as_json.meters == []


def test_a_bad_command_line_is_an_error_value_not_an_exit(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ArgumentsError) as e:
        build_parser().parse_args(["gc", "--ttl", "soon"])
    assert isinstance(e.value, ss.ConfigError)  # inside the SnapstoreError tree, like every error
    assert e.value.prog == "snapstore gc" and "--ttl" in e.value.message
    assert e.value.usage.startswith("usage: snapstore gc")
    assert capfd.readouterr() == ("", "")  # the parser printed nothing: main decides text or JSON


def test_resolve_identity_by_key_or_unique_prefix(store_dir: str) -> None:
    _build(store_dir)
    other = "id-" + IDENT.key[3:9] + "0" * 26  # shares a 9-character prefix with IDENT's key
    c = apsw.Connection(os.path.join(store_dir, "snapstore.db"))
    try:
        c.execute("INSERT INTO identities (key, canonical, created, last_open) VALUES (?, '{}', 0, 0)", (other,))
    finally:
        c.close()
    repo = SnapshotRepo.open(store_dir)
    try:
        def resolve(key: str) -> str:
            return repo.db.read(lambda c: resolve_identity(c, key))

        assert resolve(IDENT.key) == IDENT.key
        assert resolve(IDENT.key[:12]) == IDENT.key  # unique prefix
        with pytest.raises(ss.InvalidInputError, match="ambiguous"):
            resolve(IDENT.key[:9])
        with pytest.raises(ss.InvalidInputError, match="no identity 'id-d'"):
            resolve("id-d")  # shorter than 6 characters: never a prefix
        with pytest.raises(ss.InvalidInputError, match=f"known: {IDENT.key}, {other}"):
            resolve("id-nope-nope")
    finally:
        repo.close()

