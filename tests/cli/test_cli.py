"""The snapstore CLI, run as a real subprocess against stores built by the library."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import secrets
import select
import signal
import subprocess
import sys
import time
from typing import Any

import apsw
import numpy as np
import pytest
from support import IDENT, LAYOUT, empty_like_state, part_hashes, store_factory

import snapstore as ss

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there

pytestmark = pytest.mark.slow  # the CLI as a subprocess per command: the slow tier

TESTS = TESTS_DIR
HERE_DIR = os.path.dirname(os.path.abspath(__file__))  # this module's folder: children import it by name
ROOT = os.path.dirname(TESTS)

# the writer subprocess and the test build the same states from these functions
GEN_SRC = '''
import numpy as np
MAX_ROWS = 1024
def full_rows(layout, key, n=MAX_ROWS):
    """Rows of conversation `key`, the first n of MAX_ROWS (so rows [0, m) never depend on n)."""
    out = {}
    for i, (name, spec) in enumerate(sorted(layout.rows.items())):
        rng = np.random.default_rng([key, i])
        raw = rng.integers(0, 256, MAX_ROWS * spec.row_bytes, dtype=np.uint8)
        out[name] = raw.view(spec.dtype).reshape((MAX_ROWS, *spec.row_shape))[:n]
    return out
def state_at(layout, key, n, full=None):
    full = full if full is not None else full_rows(layout, key, n)
    rng = np.random.default_rng([key, n])
    out = {name: rng.integers(0, 256, spec.nbytes, dtype=np.uint8).view(spec.dtype).reshape(spec.shape)
           for name, spec in layout.fixed.items()}
    out.update({name: np.ascontiguousarray(arr[:n]) for name, arr in full.items()})
    return out
def tokens_of(key, n):
    return [key * 100_000 + i for i in range(n)]
'''
_gen: dict[str, Any] = {}
exec(GEN_SRC, _gen)
full_rows, state_at, tokens_of = _gen["full_rows"], _gen["state_at"], _gen["tokens_of"]

TOP_KEYS = {
    "inspect": {"format", "command", "dir", "identities", "snapshots", "totals"},
    "inspect_id": {"format", "command", "dir", "snapshot"},
    "verify": {"format", "command", "dir", "status", "ok", "deep", "checked_chunks", "checked_bytes",
               "sqlite_errors", "problems", "damaged_chunks", "damaged_snapshots", "affected_snapshots", "damage",
               "orphan_files", "temp_files", "dead_pending", "repaired", "removed_snapshots", "pruned_snapshots",
               "removed_files", "clean_after_repair"},
    "gc": {"format", "command", "dir", "dry_run", "removed_snapshots", "dead_pending", "expired", "stale", "evicted",
           "chunk_files", "orphan_files", "temp_files", "freed_chunks", "bytes_freed", "stored_bytes_before",
           "stored_bytes_after", "limits"},
    "stats": {"format", "command", "dir", "stats"},
}
SNAPSHOT_KEYS = {"id", "identity", "namespace", "parent_id", "children", "depth", "n_tokens", "base_tokens", "rows",
                 "components", "parts", "logical_bytes", "segment_bytes", "stored_bytes", "exclusive_bytes", "pinned",
                 "has_children", "names", "pending", "matchable", "quarantined", "session", "created", "last_used",
                 "hits", "imported_from"}


# -- helpers ---------------------------------------------------------------------------------
def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "snapstore", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


def cli_json(*args: str, code: int = 0, env: dict[str, str] | None = None) -> dict[str, Any]:
    r = cli(*args, "--json", env=env)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["format"] == 1
    return doc


open_store = store_factory(check_rows=None)


def rows_of(n: int) -> dict[str, int]:
    return {name: n for name in LAYOUT.rows}


def build_store(d: str) -> dict[int, dict[str, str]]:
    """Two trees: #1 → #2 → {#3, #4 (a branch)}, and #5 → #6. Returns the expected part hashes."""
    expect: dict[int, dict[str, str]] = {}
    full_a = full_rows(LAYOUT, 1, 300)
    full_b = {k: np.concatenate([v[:200], full_rows(LAYOUT, 2, 300)[k][200:]]) for k, v in full_a.items()}
    full_c = full_rows(LAYOUT, 3, 250)
    plan = [(1, full_a, tokens_of(1, 100), 100), (1, full_a, tokens_of(1, 200), 200),
            (1, full_a, tokens_of(1, 300), 300), (2, full_b, tokens_of(1, 200) + tokens_of(2, 300)[200:], 300),
            (3, full_c, tokens_of(3, 150), 150), (3, full_c, tokens_of(3, 250), 250)]
    with open_store(d) as s:
        for i, (key, full, toks, n) in enumerate(plan):
            st = state_at(LAYOUT, key * 10 + i, n, full)
            res = s.save(toks, st)
            assert res.snapshot_id == i + 1, res
            expect[i + 1] = part_hashes(LAYOUT, st, rows_of(n))
    return expect


def restore_hashes(s: ss.Store, sid: int) -> dict[str, str]:
    info = {x.snapshot_id: x for x in s.snapshots()}[sid]
    n = info.n_tokens
    dest = empty_like_state(state_at(LAYOUT, 0, n))
    res = s.restore(sid, into=dest)
    return part_hashes(LAYOUT, dest, res.rows)


def catalog_ids(d: str) -> set[int]:
    c = apsw.Connection(os.path.join(d, "snapstore.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return {int(r[0]) for r in c.execute("SELECT id FROM snapshots")}
    finally:
        c.close()


def tree_hash(d: str, skip: tuple[str, ...] = ()) -> dict[str, str]:
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), d) + "/"] = "dir"
        for name in files:
            p = os.path.join(root, name)
            if name.endswith(skip):
                continue
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = hashlib.sha256(f.read()).hexdigest()
    return out


def chunk_of(d: str, sid: int, part: str = "attn.kv", seq: int = 0) -> dict[str, Any]:
    doc = cli_json("--dir", d, "inspect", str(sid))
    p = next(p for p in doc["snapshot"]["parts"] if p["name"] == part)
    ch = p["chunks"][seq]
    assert ch["refs"] == 1
    ch["path"] = os.path.join(d, "blobs", ch["id"][:2], ch["id"])
    return dict(ch)


def sql(d: str, stmt: str, *params: Any) -> None:
    c = apsw.Connection(os.path.join(d, "snapstore.db"))
    try:
        c.execute(stmt, params)
    finally:
        c.close()


# -- inspect and stats -----------------------------------------------------------------------
def test_inspect_trees_and_detail(store_dir: str) -> None:
    build_store(store_dir)
    doc = cli_json("--dir", store_dir, "inspect")
    assert set(doc) == TOP_KEYS["inspect"]
    assert doc["command"] == "inspect"
    [ident] = doc["identities"]
    assert ident["key"] == IDENT.key and ident["fields"] == IDENT.to_dict()
    assert ident["namespaces"] == [{"namespace": None, "snapshots": 6, "roots": [1, 5]}]
    snaps = {s["id"]: s for s in doc["snapshots"]}
    assert set(snaps) == {1, 2, 3, 4, 5, 6}
    for s in snaps.values():
        assert set(s) == SNAPSHOT_KEYS
    assert snaps[2]["children"] == [3, 4] and snaps[2]["pinned"] and not snaps[3]["pinned"]
    assert snaps[4]["parent_id"] == 2 and snaps[4]["rows"] == {"attn.kv": 300, "mtp.kv": 300}
    assert snaps[4]["components"] == ["draft"] and snaps[4]["n_tokens"] == 300
    assert snaps[3]["logical_bytes"] > snaps[3]["stored_bytes"] > 0  # a delta stores one segment
    t = doc["totals"]
    assert t["snapshots"] == 6 and t["entries"] == 6 and t["pending"] == 0
    assert t["logical_bytes"] > t["stored_bytes"] > 0 and t["dedup_ratio"] > 0.9

    one = cli_json("--dir", store_dir, "inspect", "4")
    assert set(one) == TOP_KEYS["inspect_id"]
    s4 = one["snapshot"]
    assert [x["id"] for x in s4["chain"]] == [1, 2, 4]
    assert {p["name"] for p in s4["parts"]} == set(LAYOUT.parts)
    kv = next(p for p in s4["parts"] if p["name"] == "attn.kv")
    assert (kv["row_start"], kv["row_end"]) == (200, 300)
    assert sum(c["raw_len"] for c in kv["chunks"]) == kv["nbytes"] == 100 * LAYOUT.rows["attn.kv"].row_bytes

    text = cli("--dir", store_dir, "inspect")
    assert text.returncode == 0 and text.stderr == ""
    assert "#4" in text.stdout and ("└── #4" in text.stdout or "`-- #4" in text.stdout)
    assert IDENT.key in text.stdout and "dedup" in text.stdout
    detail = cli("--dir", store_dir, "inspect", "4")
    assert detail.returncode == 0 and "chain" in detail.stdout and "attn.kv" in detail.stdout
    missing = cli("--dir", store_dir, "inspect", "99")
    assert missing.returncode == 1 and "no snapshot 99" in missing.stderr and missing.stdout == ""


def test_stats(store_dir: str) -> None:
    build_store(store_dir)
    with open_store(store_dir) as s:
        s.restore(3, into=empty_like_state(state_at(LAYOUT, 0, 300)))
        assert s.match(tokens_of(1, 250)) is not None
        assert s.match([7, 7, 7]) is None
        lib = s.stats().to_dict()
    doc = cli_json("--dir", store_dir, "stats")
    assert set(doc) == TOP_KEYS["stats"]
    st = doc["stats"]
    assert set(st) == set(lib)
    for k in ("entries", "snapshots", "inserts", "hits", "misses", "restores", "stored_bytes", "chunks"):
        assert st[k] == lib[k], k
    assert st["hits"] == 1 and st["misses"] == 1 and st["restores"] == 1 and st["inserts"] == 6
    text = cli("--dir", store_dir, "stats")
    assert text.returncode == 0 and "hits / misses" in text.stdout and "50.0% hit rate" in text.stdout


def test_inspect_live_store_changes_nothing(store_dir: str) -> None:
    build_store(store_dir)
    s = open_store(store_dir)
    try:
        st = state_at(LAYOUT, 77, 350, full_rows(LAYOUT, 1, 350))
        pend = s.save(tokens_of(1, 350), st, commit=False, session="turn")
        assert pend.pending
        s.stats()  # flush counters now, so nothing is pending in this process during the checks
        before = tree_hash(store_dir, skip=("-shm",))
        listing = cli_json("--dir", store_dir, "inspect")
        snaps = {x["id"]: x for x in listing["snapshots"]}
        assert snaps[pend.snapshot_id]["pending"] and snaps[pend.snapshot_id]["parent_id"] == 3
        assert listing["totals"]["pending"] == 1
        one = cli_json("--dir", store_dir, "inspect", str(pend.snapshot_id))
        assert one["snapshot"]["pending"]
        assert cli_json("--dir", store_dir, "stats")["stats"]["pending"] == 1
        v = cli_json("--dir", store_dir, "verify")
        assert v["ok"] and v["dead_pending"] == []  # the owner (this process) is alive
        assert tree_hash(store_dir, skip=("-shm",)) == before
        assert s.commit(pend).snapshot_id == pend.snapshot_id
        assert restore_hashes(s, pend.snapshot_id) == part_hashes(LAYOUT, st, rows_of(350))
    finally:
        s.close()


def test_read_only_commands_leave_a_closed_store_byte_identical(store_dir: str) -> None:
    build_store(store_dir)
    before = tree_hash(store_dir)
    assert not any(k.endswith(("-wal", "-shm")) for k in before)
    for args in (["inspect"], ["inspect", "2"], ["stats"], ["verify", "--deep"]):
        assert cli("--dir", store_dir, *args).returncode == 0, args
        assert tree_hash(store_dir) == before, args


# -- verify ----------------------------------------------------------------------------------
def _flip(ch: dict[str, Any]) -> None:
    with open(ch["path"], "r+b") as f:
        f.seek(64 + 10)
        b = f.read(1)
        f.seek(64 + 10)
        f.write(bytes([b[0] ^ 0x40]))


def _truncate(ch: dict[str, Any]) -> None:
    os.truncate(ch["path"], ch["stored_len"] - 100)


def _remove(ch: dict[str, Any]) -> None:
    os.unlink(ch["path"])


DAMAGE = {
    # name: (snapshot whose chunk is damaged, how, deep needed, expected affected)
    "flipped-byte": (2, _flip, True, {2, 3, 4}),
    "truncated": (5, _truncate, False, {5, 6}),
    "missing-file": (6, _remove, False, {6}),
    "deleted-part_chunks-row": (3, "part_chunks", False, {3}),
    "deleted-chunks-row": (4, "chunks", False, {4}),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_verify_finds_damage_and_repair_keeps_the_rest(store_dir: str, kind: str) -> None:
    expect = build_store(store_dir)
    sid, how, deep, affected = DAMAGE[kind]
    ch = chunk_of(store_dir, sid)
    if how == "part_chunks":
        sql(store_dir, "DELETE FROM part_chunks WHERE snapshot_id = ? AND name = 'attn.kv' AND seq = 0", sid)
    elif how == "chunks":
        sql(store_dir, "DELETE FROM chunks WHERE id = ?", bytes.fromhex(ch["id"]))
    else:
        assert callable(how)
        how(ch)
    mode = ["--deep"] if deep else []
    if deep:  # the quick check reads headers and sizes only
        assert cli_json("--dir", store_dir, "verify")["ok"]
    doc = cli_json("--dir", store_dir, "verify", *mode, code=1)
    assert set(doc) == TOP_KEYS["verify"]
    assert doc["status"] == "damaged" and not doc["ok"] and not doc["repaired"]
    assert doc["damaged_snapshots"] == [sid], doc
    assert set(doc["affected_snapshots"]) == affected
    assert [d["snapshot"] for d in doc["damage"]] == [sid] and doc["damage"][0]["problems"]
    if kind == "truncated":
        text = cli("--dir", store_dir, "verify", *mode)
        assert text.returncode == 1 and f"damaged snapshot #{sid}" in text.stdout and "DAMAGE FOUND" in text.stdout

    rep = cli_json("--dir", store_dir, "verify", *mode, "--repair", code=1)
    assert rep["status"] == "repaired" and rep["repaired"] and rep["clean_after_repair"] is True
    assert set(rep["removed_snapshots"]) == affected and rep["pruned_snapshots"] == []
    assert catalog_ids(store_dir) == set(expect) - affected
    clean = cli_json("--dir", store_dir, "verify", "--deep")
    assert clean["ok"] and clean["status"] == "clean" and clean["problems"] == []
    with open_store(store_dir) as s:
        for other in sorted(set(expect) - affected):
            assert restore_hashes(s, other) == expect[other], other
        for gone in affected:
            with pytest.raises(ss.SnapshotUnavailableError):
                s.restore(gone, into=empty_like_state(state_at(LAYOUT, 0, 300)))


def test_verify_finds_a_deleted_snapshot_row_and_repair_cleans_it(store_dir: str) -> None:
    expect = build_store(store_dir)
    sql(store_dir, "DELETE FROM snapshots WHERE id = 5")  # #6's parent row, behind the store's back
    doc = cli_json("--dir", store_dir, "verify", code=1)
    assert not doc["ok"] and doc["damaged_snapshots"] == [6]
    rep = cli_json("--dir", store_dir, "verify", "--repair", code=1)
    assert rep["repaired"] and rep["clean_after_repair"] is True and 6 in rep["removed_snapshots"]
    clean = cli_json("--dir", store_dir, "verify", "--deep")
    assert clean["ok"] and clean["problems"] == []
    assert catalog_ids(store_dir) == {1, 2, 3, 4}
    with open_store(store_dir) as s:
        for sid in (1, 2, 3, 4):
            assert restore_hashes(s, sid) == expect[sid]


def test_verify_lists_orphans_and_temp_files_without_calling_them_damage(store_dir: str) -> None:
    build_store(store_dir)
    ch = chunk_of(store_dir, 3)
    name = secrets.token_hex(32)
    orphan = os.path.join(store_dir, "blobs", name[:2], name)
    with open(ch["path"], "rb") as src, open(orphan, "wb") as dst:
        dst.write(src.read())
    temp = os.path.join(store_dir, "tmp", "w-" + secrets.token_hex(12))
    with open(temp, "wb") as f:
        f.write(b"x" * 100)
    doc = cli_json("--dir", store_dir, "verify", "--deep")
    assert doc["ok"] and doc["status"] == "clean"
    assert doc["orphan_files"] == [orphan] and doc["temp_files"] == [temp]
    text = cli("--dir", store_dir, "verify")
    assert text.returncode == 0 and "orphan chunk files" in text.stdout and orphan in text.stdout
    # repair removes only what is older than the grace period
    assert cli_json("--dir", store_dir, "verify", "--repair")["removed_files"] == []
    assert os.path.exists(orphan)
    gone = cli_json("--dir", store_dir, "gc", "--grace", "0")
    assert gone["orphan_files"] == [orphan] and gone["temp_files"] == [temp] and gone["removed_snapshots"] == []
    assert not os.path.exists(orphan) and not os.path.exists(temp)
    assert cli_json("--dir", store_dir, "verify")["orphan_files"] == []


# -- gc --------------------------------------------------------------------------------------
def _dead_pending(d: str) -> None:
    """A process that captures a pending snapshot and dies without closing the store."""
    code = (f"import sys; sys.path[:0] = [{TESTS!r}, {HERE_DIR!r}]\n"
            "import os, snapstore as ss\n"
            "from test_cli import open_store, state_at, full_rows, tokens_of, LAYOUT\n"
            f"s = open_store({d!r}, drop_stale=False)\n"
            "r = s.save(tokens_of(3, 300), state_at(LAYOUT, 9, 300, full_rows(LAYOUT, 3, 300)), commit=False)\n"
            "assert r.pending\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


def test_gc_dry_run_changes_no_byte_and_matches_the_real_run(store_dir: str) -> None:
    build_store(store_dir)
    other = ss.Identity(build="old-build", pack="sha256:0123", extra=IDENT.extra)
    with open_store(store_dir, identity=other, drop_stale=False) as s:
        s.save([1, 2, 3], state_at(LAYOUT, 5, 3))
    _dead_pending(store_dir)
    name = secrets.token_hex(32)
    orphan = os.path.join(store_dir, "blobs", name[:2], name)
    with open(orphan, "wb") as f:
        f.write(b"o" * 500)
    temp = os.path.join(store_dir, "tmp", "w-" + secrets.token_hex(12))
    with open(temp, "wb") as f:
        f.write(b"t" * 50)
    for p in (orphan, temp):
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    args = ["--dir", store_dir, "gc", "--keep-identity", IDENT.key, "--max-entries", "3"]
    before = tree_hash(store_dir)
    dry = cli_json(*args, "--dry-run")
    assert tree_hash(store_dir) == before
    text = cli(*args, "--dry-run")
    assert text.returncode == 0 and "dry run" in text.stdout and orphan in text.stdout
    assert tree_hash(store_dir) == before
    assert set(dry) == TOP_KEYS["gc"] and dry["dry_run"]
    assert dry["dead_pending"] == [8] and dry["stale"] == [7]
    assert len(dry["evicted"]) == 3 and dry["orphan_files"] == [orphan] and dry["temp_files"] == [temp]
    assert dry["chunk_files"] and all(os.path.exists(p) for p in dry["chunk_files"])
    assert dry["limits"]["max_entries"] == 3 and dry["limits"]["keep_identity"] == IDENT.key

    real = cli_json(*args)
    for k in ("removed_snapshots", "dead_pending", "stale", "evicted", "expired", "chunk_files", "orphan_files",
              "temp_files", "freed_chunks", "bytes_freed", "stored_bytes_before", "stored_bytes_after"):
        assert real[k] == dry[k], k
    assert not any(os.path.exists(p) for p in real["chunk_files"] + [orphan, temp])
    assert catalog_ids(store_dir) == {1, 2, 3, 4, 5, 6} - set(real["evicted"])
    assert len(catalog_ids(store_dir)) == 3
    assert cli_json("--dir", store_dir, "verify", "--deep")["ok"]
    ident = cli_json("--dir", store_dir, "inspect")["identities"]
    assert [i["key"] for i in ident] == [IDENT.key]


def test_gc_ttl_drop_identity_and_env_defaults(store_dir: str) -> None:
    build_store(store_dir)
    sql(store_dir, "UPDATE snapshots SET last_used = last_used - 1000 WHERE id IN (3, 6)")
    doc = cli_json("--dir", store_dir, "gc", "--ttl", "500", "--dry-run")
    assert doc["expired"] == [3, 6] and doc["evicted"] == []
    env = {"SNAPSTORE_TTL": "500", "SNAPSTORE_MAX_ENTRIES": "2", "SNAPSTORE_DISK_MIB": "1024"}
    doc = cli_json("--dir", store_dir, "gc", "--dry-run", env=env)
    assert doc["limits"] == {"disk_bytes": 1024 << 20, "max_entries": 2, "ttl": 500.0, "grace": 3600.0,
                             "drop_identity": None, "keep_identity": None}
    assert doc["expired"] == [3, 6] and len(doc["evicted"]) == 2
    # a flag wins over the environment
    assert cli_json("--dir", store_dir, "gc", "--dry-run", "--max-entries", "6", "--ttl", "0",
                    env=env)["removed_snapshots"] == []
    doc = cli_json("--dir", store_dir, "gc", "--drop-identity", IDENT.key[:10])
    assert doc["stale"] == [1, 2, 3, 4, 5, 6] and catalog_ids(store_dir) == set()
    assert cli_json("--dir", store_dir, "inspect")["identities"] == []
    assert cli_json("--dir", store_dir, "verify", "--deep")["ok"]


WRITER = GEN_SRC + '''
import json, sys, time
sys.path.insert(0, TESTS)
import snapstore as ss
from support import IDENT, LAYOUT
d, count = sys.argv[1], int(sys.argv[2])
s = ss.Store.open(d, identity=IDENT, layout=LAYOUT, chunk_bytes=4096, staging_bytes=65536,
                  budget=ss.Budget(reserve_bytes=0))
fulls = {}
for i in range(count):
    key = 100 + (i % 4) + 4 * (i // 32)   # 4 conversations at a time, a new generation every 32 saves
    n = 64 * (1 + (i // 4) % 8)
    full = fulls.setdefault(key, full_rows(LAYOUT, key, 512))
    try:
        res = s.save(tokens_of(key, n), state_at(LAYOUT, key, n, full))
    except ss.SnapstoreError as e:   # e.g. gc --grace 0 removed an in-flight temp file
        print(json.dumps({"error": repr(e)}), flush=True)
        continue
    if res.snapshot_id is not None:
        print(json.dumps({"sid": res.snapshot_id, "key": key, "n": n}), flush=True)
s.close()
'''


def test_gc_beside_a_writer_loses_nothing(store_dir: str) -> None:
    with open_store(store_dir):
        pass
    writer = subprocess.Popen([sys.executable, "-c", f"TESTS = {TESTS!r}\n" + WRITER, store_dir, "160"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    removed: set[int] = set()
    runs = 0
    try:
        while writer.poll() is None or runs < 3:
            doc = cli_json("--dir", store_dir, "gc", "--grace", "0", "--disk-mib", "1")
            removed.update(doc["removed_snapshots"])
            runs += 1
            if runs == 2:  # a snapshot of the catalog taken beside the writer is consistent
                listing = cli_json("--dir", store_dir, "inspect")
                ids = {x["id"] for x in listing["snapshots"]}
                assert all(x["parent_id"] in ids for x in listing["snapshots"] if x["parent_id"] is not None)
        out, err = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    saved = [x for x in lines if "sid" in x]
    assert len(saved) >= 100, lines[-5:]
    assert removed, "gc evicted nothing: the budget was never exceeded"
    print(f"gc runs {runs}, saved {len(saved)}, errors {len(lines) - len(saved)}, removed {len(removed)}")
    present = catalog_ids(store_dir)
    with open_store(store_dir) as s:
        for x in saved:
            if x["sid"] not in present:
                assert x["sid"] in removed, x  # gone only because gc said it removed it
                continue
            st = state_at(LAYOUT, x["key"], x["n"], full_rows(LAYOUT, x["key"], 512))
            assert restore_hashes(s, x["sid"]) == part_hashes(LAYOUT, st, rows_of(x["n"])), x
    final = cli_json("--dir", store_dir, "verify", "--deep")
    assert final["ok"] and final["problems"] == []


# -- progress, interrupts, exit codes --------------------------------------------------------
def _run_on_pty(args: list[str], wait_for: bytes, env: dict[str, str]) -> tuple[int, bytes, str]:
    """Run with stderr on a terminal; SIGINT once ``wait_for`` shows up there."""
    master, slave = pty.openpty()
    e = dict(os.environ)
    e.update(env)
    # A child inherits an ignored SIGINT (a test run started as a background job of a non-interactive
    # shell ignores it), and Python then installs no KeyboardInterrupt handler: the child would never
    # see Ctrl-C. With a handler here (not SIG_IGN), exec gives the child the default disposition.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "snapstore", *args], stdout=subprocess.PIPE, stderr=slave,
                             env=e, cwd=ROOT)
    finally:
        signal.signal(signal.SIGINT, old)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 30
    try:
        while wait_for not in seen and time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.5)
            if r:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        assert wait_for in seen, seen
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=30)
        while True:
            r, _, _ = select.select([master], [], [], 0.2)
            if not r:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    return p.returncode, seen, out.decode()


@pytest.mark.skipif(not hasattr(os, "openpty") or sys.platform == "win32", reason="needs a POSIX pty")
def test_progress_on_a_terminal_and_ctrl_c(store_dir: str) -> None:
    build_store(store_dir)
    slow = {"_SNAPSTORE_PROGRESS_DELAY": "0.2"}
    rc, tty, out = _run_on_pty(["--dir", store_dir, "verify", "--deep"], b"verify --deep:", slow)
    assert rc == 130 and b"interrupted" in tty and b"/s" in tty and out == ""
    rc, tty, out = _run_on_pty(["--dir", store_dir, "gc", "--disk-mib", "0", "--grace", "0"], b"gc:", slow)
    assert rc == 130 and b"interrupted" in tty
    # the catalog committed, the chunk files were not all unlinked yet: consistent, leftovers are orphans
    doc = cli_json("--dir", store_dir, "verify", "--deep")
    assert doc["ok"] and catalog_ids(store_dir) == set()
    cli_json("--dir", store_dir, "gc", "--grace", "0")
    assert cli_json("--dir", store_dir, "verify")["orphan_files"] == []
    # not a terminal: nothing on stderr
    r = cli("--dir", store_dir, "verify", "--deep")
    assert r.returncode == 0 and r.stderr == ""


def test_exit_codes_and_usage(tmp_path: Any, store_dir: str) -> None:
    build_store(store_dir)
    nowhere = str(tmp_path / "nowhere")
    for i, cmd in enumerate((["inspect"], ["verify"], ["gc"], ["stats"])):
        if i % 2:
            r = cli("--dir", nowhere, *cmd)
            assert r.returncode == 2 and "no snapstore store" in r.stderr and r.stdout == "", cmd
        else:
            r = cli("--dir", nowhere, *cmd, "--json")
            assert r.returncode == 2 and r.stdout == ""
            err = json.loads(r.stderr)
            assert err["format"] == 1 and err["exit"] == 2 and err["command"] == cmd[0]
    assert not os.path.exists(nowhere)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("--dir", str(empty), "stats").returncode == 2 and os.listdir(empty) == []
    assert cli("--dir", store_dir, "verify", "--bogus").returncode == 2
    assert cli("--dir", store_dir, "frobnicate").returncode == 2
    assert cli("--dir", store_dir, "gc", "--disk-mib", "-1").returncode == 2
    assert cli("--dir", store_dir, "gc", "--drop-identity", "a", "--keep-identity", "b").returncode == 2
    r = cli("--dir", store_dir, "gc", "--keep-identity", "id-nope")
    assert r.returncode == 2 and "no identity" in r.stderr
    assert cli("--dir", store_dir, "inspect", "abc").returncode == 2
    r = cli("--dir", store_dir, "gc", "--dry-run", env={"SNAPSTORE_DISK_MIB": "lots"})
    assert r.returncode == 2 and "SNAPSTORE_DISK_MIB" in r.stderr
    # $SNAPSTORE_DIR is the default store; --json may come before or after the command
    doc = json.loads(cli("stats", "--json", env={"SNAPSTORE_DIR": store_dir}).stdout)
    assert doc["dir"] == os.path.abspath(store_dir)
    assert json.loads(cli("--json", "--dir", store_dir, "stats").stdout)["command"] == "stats"
    assert catalog_ids(store_dir) == {1, 2, 3, 4, 5, 6}


def test_help_explains_every_command() -> None:
    r = cli("--help")
    assert r.returncode == 0
    for word in ("inspect", "verify", "gc", "stats", "exit codes", "130"):
        assert word in r.stdout
    for cmd, flags in (("inspect", ["--json", "--dir"]), ("verify", ["--deep", "--repair"]),
                       ("gc", ["--dry-run", "--disk-mib", "--max-entries", "--ttl", "--drop-identity",
                               "--keep-identity", "--grace"]), ("stats", ["--json"])):
        r = cli(cmd, "--help")
        assert r.returncode == 0 and "example" in r.stdout, cmd
        for f in flags:
            assert f in r.stdout, (cmd, f)


def test_console_script_entry_point() -> None:
    from snapstore.cli.main import main

    assert main(["--version"]) == 0
    exe = os.path.join(os.path.dirname(sys.executable), "snapstore")
    if os.path.exists(exe):
        r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "verify" in r.stdout


def test_docs_cover_every_json_field_and_exit_code() -> None:
    with open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8") as f:
        doc = f.read()
    for keys in (*TOP_KEYS.values(), SNAPSHOT_KEYS):
        for k in keys:
            assert f'"{k}"' in doc or f"`{k}`" in doc, k
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 130 |"):
        assert code in doc
    for flag in ("--dir", "--json", "--deep", "--repair", "--dry-run", "--disk-mib", "--max-entries", "--ttl",
                 "--drop-identity", "--keep-identity", "--grace", "SNAPSTORE_DISK_MIB", "SNAPSTORE_MAX_ENTRIES",
                 "SNAPSTORE_TTL"):
        assert flag in doc, flag
