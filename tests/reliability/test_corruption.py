"""Corruption campaign: damage chunk files and the SQLite catalog, then check detection and blast radius.

Chunk damage (random single-byte flips, truncations, zero-filled ranges, deletions, appended garbage,
one chunk's bytes swapped for another's), on a store with raw chunks and one with zstd chunks:

* verify(deep=True) names the damaged chunk every time (N tried = N detected);
* restore never reports success with wrong bytes: it raises a RestoreError subclass (and with
  ``touched`` False the destination is unchanged) or returns exact bytes;
* snapshots that do not use the damaged chunk restore exact (damage does not spread);
* ``verify(repair=True)`` leaves a store that verifies clean and whose survivors restore exact,
  removing only snapshots verify reported as affected.

SQLite damage (a random page of snapstore.db overwritten with random bytes or zeros): opening,
verifying or restoring raises a SnapstoreError or works; a restore that succeeds is exact.

CI: 100 chunk trials per codec + 40 page trials. ``SNAPSTORE_LONG=1``: 3000 + 600.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import numpy as np
import pytest

import snapstore as ss
from snapstore.check.verify import verify as repo_verify
from snapstore.chunks.chunkfile import HEADER_SIZE

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there
HERE = TESTS_DIR
sys.path.insert(0, HERE)
from support import LAYOUT, Workload, store_factory  # noqa: E402

LONG = bool(os.environ.get("SNAPSTORE_LONG"))
CHUNK_TRIALS = 3000 if LONG else 100
PAGE_TRIALS = 600 if LONG else 40
FIGURES: dict[str, Any] = {}


_open = store_factory(budget=ss.Budget(reserve_bytes=0, ram_bytes=0))


def _workload(low_entropy: bool) -> Workload:
    """Four conversations of 400 tokens; 4 values a byte when a codec should compress them."""
    return Workload(LAYOUT, conversations=4, max_tokens=400, levels=4 if low_entropy else 256)


def _state(w: Workload, conv: int, n: int, turn: int) -> dict[str, np.ndarray]:
    """Conversation ``conv``'s parts after ``n`` tokens at ``turn``; conversation 3 shares its first
    128 rows (and tokens) with conversation 2, so the store holds shared chunks."""
    out = w.state(conv, n, turn)
    if conv == 3:
        for name, rows in w.rows(2).items():
            out[name][:min(n, 128)] = rows[:min(n, 128)]
    return out


def build_template(path: str, codec: str) -> dict[int, tuple[np.ndarray, dict[str, np.ndarray]]]:
    """A store with chains, branches and shared chunks. Returns sid -> (tokens, state)."""
    w = _workload(codec != "raw")
    saved: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
    st = _open(path, codec=codec)
    try:
        for conv in range(4):
            toks = w.tokens(conv).copy()
            if conv == 3:
                toks[:128] = w.tokens(2)[:128]
            for j, n in enumerate((64, 192, 400)):
                state = _state(w, conv, n, turn=0)
                r = st.save(toks[:n], state, parent="auto" if j else None)
                assert r.snapshot_id is not None
                saved[r.snapshot_id] = (toks[:n].copy(), state)
            n = 250  # a branch off the 192 boundary
            btoks = toks.copy()
            btoks[200:] += 1
            state = _state(w, conv, n, turn=1)
            r = st.save(btoks[:n], state)
            saved[r.snapshot_id] = (btoks[:n].copy(), state)
    finally:
        st.close()
    return saved


@pytest.fixture(scope="module", params=["raw", "zstd"])
def template(request: Any, tmp_path_factory: Any) -> tuple[str, str, dict[int, Any]]:
    path = str(tmp_path_factory.mktemp(f"tmpl-{request.param}") / "store")
    return path, request.param, build_template(path, request.param)


def _uses(st: ss.Store, sid: int) -> set[bytes]:
    """Chunk ids a full restore of ``sid`` reads (leaf: every part; ancestors: row segments)."""
    def run(c: Any) -> set[bytes]:
        chain = c.chain(sid)
        out: set[bytes] = set()
        for link in chain:
            for p in c.parts(link.id):
                if link.id == sid or p.kind == 1:
                    out.update(ch.id for ch in c.part_chunks(link.id, p.name) if ch is not None)
        return out
    return st._repo.db.read(run)


def _check_restores(st: ss.Store, saved: dict[int, Any], damaged: set[bytes], fig: dict[str, int]) -> set[int]:
    """Restore every snapshot; returns those that failed (each must use a damaged chunk)."""
    failed = set()
    for sid, (_toks, state) in saved.items():
        sentinel = {name: np.full_like(v, 0x3C) for name, v in state.items()}
        into = {name: v.copy() for name, v in sentinel.items()}
        uses = _uses(st, sid)
        try:
            st.restore(sid, into=into)
        except ss.RestoreError as e:
            assert uses & damaged, f"snapshot {sid} does not use the damaged chunk but failed: {e}"
            if not e.touched:
                for name in into:
                    assert into[name].tobytes() == sentinel[name].tobytes(), "touched=False but destination changed"
            fig["restore_refused"] += 1
            failed.add(sid)
            continue
        for name, v in state.items():
            assert into[name].tobytes() == v.tobytes(), f"restore of {sid} reported success with wrong bytes"
        fig["restore_exact"] += 1
    return failed


def _damage(path: str, rng: np.random.Generator, other: str) -> tuple[str, bool]:
    """Damage one chunk file in place. Returns (kind, reserved_only) where reserved_only means only
    the reserved tail of the header changed."""
    data = open(path, "rb").read()
    kind = ["flip", "flip-header", "truncate", "zero", "delete", "append", "swap"][int(rng.integers(7))]
    if kind == "delete":
        os.unlink(path)
        return kind, False
    if kind == "flip":
        i = int(rng.integers(len(data)))
        new = data[:i] + bytes([data[i] ^ int(rng.integers(1, 256))]) + data[i + 1:]
    elif kind == "flip-header":
        i = int(rng.integers(HEADER_SIZE))
        new = data[:i] + bytes([data[i] ^ int(rng.integers(1, 256))]) + data[i + 1:]
    elif kind == "truncate":
        new = data[:int(rng.integers(len(data)))]
    elif kind == "zero":
        a = int(rng.integers(len(data)))
        b = min(len(data), a + int(rng.integers(1, 2048)))
        new = data[:a] + bytes(b - a) + data[b:]
    elif kind == "append":
        new = data + bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8))
    else:
        new = open(other, "rb").read()
    if new == data:
        return "unchanged", False
    changed = [i for i in range(min(len(new), len(data))) if new[i] != data[i]]
    reserved_only = len(new) == len(data) and all(56 <= i < HEADER_SIZE for i in changed)
    with open(path, "wb") as f:
        f.write(new)
    return kind, reserved_only


def test_chunk_corruption_campaign(template: Any, tmp_path: Any) -> None:
    tmpl, codec, saved = template
    rng = np.random.default_rng(42 if codec == "raw" else 43)
    fig = {"tried": 0, "detected": 0, "reserved_only": 0, "restore_refused": 0, "restore_exact": 0,
           "repaired_clean": 0, "removed_by_repair": 0}
    kinds: dict[str, int] = {}
    work = str(tmp_path / "work")
    shutil.copytree(tmpl, work)
    tmpl_files = {os.path.relpath(os.path.join(d, f), tmpl) for d, _, fs in os.walk(tmpl) for f in fs}
    for _t in range(CHUNK_TRIALS):
        _reset(tmpl, work, tmpl_files)
        st = _open(work, codec=codec)
        try:
            files = sorted(p for _, p in st._repo.blob_files())
            victim = files[int(rng.integers(len(files)))]
            cid = bytes.fromhex(os.path.basename(victim))
            kind, reserved_only = _damage(victim, rng, files[int(rng.integers(len(files)))])
            if kind == "unchanged":
                continue
            kinds[kind] = kinds.get(kind, 0) + 1
            if reserved_only:  # bytes 56..63 of the header: reserved, must be zero (checked since)
                fig["reserved_only"] += 1
            fig["tried"] += 1
            rep = st.verify(deep=True)
            assert not rep.ok and cid in rep.damaged_chunks, f"{kind} of {cid.hex()} not detected: {rep.problems}"
            fig["detected"] += 1
            failed = _check_restores(st, saved, {cid}, fig)
            assert failed <= set(rep.affected_snapshots)
        finally:
            st.close()
        rep = repo_verify(ss_repo(work), deep=True, repair=True)
        assert rep.repaired
        assert set(rep.removed_snapshots) <= set(rep.affected_snapshots)
        st = _open(work, codec=codec)
        try:
            after = st.verify(deep=True)
            assert after.ok and not after.orphan_files, after.problems
            left = {i.snapshot_id for i in st.snapshots()}
            assert left.isdisjoint(rep.removed_snapshots)
            _check_restores(st, {s: v for s, v in saved.items() if s in left}, set(), fig)
            fig["removed_by_repair"] += len(rep.removed_snapshots)
            fig["repaired_clean"] += 1
        finally:
            st.close()
    fig["kinds"] = kinds  # type: ignore[assignment]
    FIGURES[f"chunks-{codec}"] = fig
    print(f"chunk corruption ({codec}):", json.dumps(fig))
    assert fig["tried"] >= CHUNK_TRIALS * 0.8 and fig["detected"] == fig["tried"]


HEAL_TRIALS = 1000 if LONG else 20


def test_quarantine_and_heal_campaign(template: Any, tmp_path: Any) -> None:
    """Damage one chunk; every restore that meets it fails and quarantines it in the same call;
    then match() serves nothing that needs it (each hit restores exact); a save of every state
    (as the engine would after re-reading the prompt) republishes the damaged chunk, after which
    every state matches at full length and restores exact and deep verify is clean: no repair."""
    tmpl, codec, saved = template
    rng = np.random.default_rng(52 if codec == "raw" else 53)
    fig = {"tried": 0, "refused": 0, "quarantined": 0, "match_after_quarantine_exact": 0,
           "match_after_quarantine_none_or_shorter": 0, "healed": 0, "exact_after_heal": 0, "clean_after_heal": 0}
    work = str(tmp_path / "work")
    shutil.copytree(tmpl, work)
    tmpl_files = {os.path.relpath(os.path.join(d, f), tmpl) for d, _, fs in os.walk(tmpl) for f in fs}
    order = sorted(saved.items(), key=lambda kv: (len(kv[1][0]), kv[0]))  # prefixes first, as turns go
    for _t in range(HEAL_TRIALS):
        _reset(tmpl, work, tmpl_files)
        st = _open(work, codec=codec)
        try:
            files = sorted(p for _, p in st._repo.blob_files())
            victim = files[int(rng.integers(len(files)))]
            cid = bytes.fromhex(os.path.basename(victim))
            kind, _ = _damage(victim, rng, files[int(rng.integers(len(files)))])
            if kind == "unchanged":
                continue
            fig["tried"] += 1
            failed = _check_restores(st, saved, {cid}, {"restore_refused": 0, "restore_exact": 0})
            assert failed, f"{kind} of {cid.hex()} met by no restore"
            fig["refused"] += len(failed)
            assert st.stats().quarantined == 1, "the restore that found the damage did not quarantine it"
            fig["quarantined"] += 1
            for _sid, (toks, state) in saved.items():
                m = st.match(toks)
                if m is None or m.n_tokens < len(toks):
                    fig["match_after_quarantine_none_or_shorter"] += 1
                    continue
                into = {name: np.zeros_like(v) for name, v in state.items()}
                st.restore(m, into=into)  # a match never needs the quarantined chunk: no error
                same = [s2 for t2, s2 in saved.values() if len(t2) == len(toks) and np.array_equal(t2, toks)]
                assert any(all(into[k].tobytes() == s2[k].tobytes() for k in state) for s2 in same)
                fig["match_after_quarantine_exact"] += 1
            for _sid, (toks, state) in order:
                assert st.save(toks, state).ok
            after = st.stats()
            assert after.quarantined == 0, "a save of the right bytes did not heal the chunk"
            fig["healed"] += after.healed
            for _sid, (toks, state) in saved.items():
                m = st.match(toks)
                assert m is not None and m.n_tokens == len(toks)
                into = {name: np.zeros_like(v) for name, v in state.items()}
                st.restore(m, into=into)
                same = [s2 for t2, s2 in saved.values() if len(t2) == len(toks) and np.array_equal(t2, toks)]
                assert any(all(into[k].tobytes() == s2[k].tobytes() for k in state) for s2 in same)
                fig["exact_after_heal"] += 1
            for sid, (_toks, state) in saved.items():  # the damaged snapshots themselves are whole again
                into = {name: np.zeros_like(v) for name, v in state.items()}
                st.restore(sid, into=into)
                assert all(into[k].tobytes() == state[k].tobytes() for k in state)
            rep = st.verify(deep=True)
            assert rep.ok, rep.problems
            fig["clean_after_heal"] += 1
        finally:
            st.close()
    FIGURES[f"heal-{codec}"] = fig
    print(f"quarantine and heal ({codec}):", json.dumps(fig))
    assert fig["tried"] >= HEAL_TRIALS * 0.8 and fig["clean_after_heal"] == fig["tried"]


def _reset(tmpl: str, work: str, tmpl_files: set[str]) -> None:
    """Make ``work`` a byte copy of the template again (cheaper than a fresh copytree)."""
    have = {os.path.relpath(os.path.join(d, f), work) for d, _, fs in os.walk(work) for f in fs}
    for rel in have - tmpl_files:
        os.unlink(os.path.join(work, rel))
    for rel in tmpl_files:
        src, dst = os.path.join(tmpl, rel), os.path.join(work, rel)
        if rel not in have or rel == "snapstore.db" or os.path.getsize(src) != os.path.getsize(dst) or \
                open(src, "rb").read(HEADER_SIZE) != open(dst, "rb").read(HEADER_SIZE) or \
                open(src, "rb").read() != open(dst, "rb").read():
            shutil.copyfile(src, dst)


def ss_repo(path: str) -> Any:
    from snapstore.chunks.repo import Repo
    return Repo.open(path)


def test_reserved_header_bytes_damage_detected(template: Any, tmp_path: Any) -> None:
    """Bytes 56..63 of a chunk header are reserved (written as zeros) but no check covers them."""
    tmpl, codec, _ = template
    work = str(tmp_path / "w")
    shutil.copytree(tmpl, work)
    st = _open(work, codec=codec)
    try:
        victim = sorted(p for _, p in st._repo.blob_files())[0]
        data = bytearray(open(victim, "rb").read())
        data[60] ^= 0xFF
        open(victim, "wb").write(bytes(data))
        rep = st.verify(deep=True)
        assert bytes.fromhex(os.path.basename(victim)) in rep.damaged_chunks
    finally:
        st.close()


def test_sqlite_page_damage(template: Any, tmp_path: Any) -> None:
    tmpl, codec, saved = template
    rng = np.random.default_rng(7)
    fig = {"tried": 0, "open_refused": 0, "verify_flagged": 0, "verify_clean": 0, "restore_exact": 0,
           "restore_refused": 0}
    db_size = os.path.getsize(os.path.join(tmpl, "snapstore.db"))
    pages = db_size // 4096
    assert pages > 1 and not os.path.exists(os.path.join(tmpl, "snapstore.db-wal"))
    work = str(tmp_path / "work")
    shutil.copytree(tmpl, work)
    tmpl_files = {os.path.relpath(os.path.join(d, f), tmpl) for d, _, fs in os.walk(tmpl) for f in fs}
    for _t in range(PAGE_TRIALS):
        _reset(tmpl, work, tmpl_files)
        db = os.path.join(work, "snapstore.db")
        page = int(rng.integers(pages))
        with open(db, "r+b") as f:
            f.seek(page * 4096)
            f.write(bytes(4096) if rng.random() < 0.3 else bytes(rng.integers(0, 256, 4096, dtype=np.uint8)))
        fig["tried"] += 1
        try:
            st = _open(work, codec=codec)
        except ss.SnapstoreError:
            fig["open_refused"] += 1
            continue
        try:
            try:
                rep = st.verify(deep=True)
                fig["verify_clean" if rep.ok else "verify_flagged"] += 1
            except ss.SnapstoreError:
                fig["verify_flagged"] += 1
            for _sid, (toks, state) in saved.items():
                try:
                    m = st.match(toks)
                    if m is None or m.n_tokens != len(toks):
                        continue
                    into = {name: np.zeros_like(v) for name, v in state.items()}
                    st.restore(m, into=into)
                except ss.SnapstoreError:
                    fig["restore_refused"] += 1
                    continue
                # several saves may share these tokens (conversation 3 starts like 2): any of them is right
                same = [s2 for t2, s2 in saved.values() if len(t2) == len(toks) and np.array_equal(t2, toks)]
                got = {name: into[name].tobytes() for name in state}
                assert any(all(got[name] == s2[name].tobytes() for name in state) for s2 in same), \
                    "restore after page damage returned bytes no save of these tokens had"
                fig["restore_exact"] += 1
        finally:
            try:
                st.close()
            except ss.SnapstoreError:
                pass
    FIGURES[f"sqlite-{codec}"] = fig
    print(f"sqlite page damage ({codec}):", json.dumps(fig))
