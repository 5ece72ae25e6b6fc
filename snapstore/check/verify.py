"""verify: prove a store is intact, and (``repair``) remove what is confirmed damaged.

Works on a :class:`Repo` (any identity) so the CLI and ``Store.verify`` share it. Removal of
files goes through the repository's write path (rows first, files after commit).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3

from snapstore._config import pending_lease as resolve_lease
from snapstore._errors import CorruptionError, StoreFormatError
from snapstore.catalog.queries import PartRow, Txn
from snapstore.chunks.chunkfile import (
    HEADER_SIZE,
    ChunkHeader,
    checksum,
    decode_payload,
    header_matches,
    open_chunk,
    parse_header,
    read_exact,
)
from snapstore.chunks.repo import Repo
from snapstore.lifecycle.gc import Progress, collect_orphans, temp_files
from snapstore.lifecycle.liveness import Liveness
from snapstore.lifecycle.rules import drop_leaf

__all__ = ["VerifyReport", "verify"]

@dataclass
class VerifyReport:
    """What verify found. ``ok`` is True when nothing is damaged (cleanable leftovers are not damage).

    ``damaged_snapshots`` are the snapshots with a problem of their own (with the reasons in
    ``damage``); ``affected_snapshots`` adds every snapshot whose chain includes one of them.
    With ``repair``, ``removed_snapshots`` is exactly ``affected_snapshots`` (as found inside the
    repair transaction), ``pruned_snapshots`` the chain links left without a purpose (superseded,
    no children; the library prunes these on every drop), and the orphan/temp files older than the
    grace period are removed (``removed_files``).
    """

    deep: bool
    checked_chunks: int = 0
    checked_bytes: int = 0
    sqlite_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    damaged_chunks: list[bytes] = field(default_factory=list)
    damaged_snapshots: list[int] = field(default_factory=list)
    affected_snapshots: list[int] = field(default_factory=list)
    damage: dict[int, list[str]] = field(default_factory=dict)
    orphan_files: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    dead_pending: list[int] = field(default_factory=list)
    repaired: bool = False
    removed_snapshots: list[int] = field(default_factory=list)
    pruned_snapshots: list[int] = field(default_factory=list)
    removed_files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No damage found (orphans, temp files and dead pending captures are gc's, not damage)."""
        return not (self.sqlite_errors or self.problems or self.damaged_chunks or self.damaged_snapshots)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (chunk ids as hex; ``damage`` as a list of {snapshot, problems})."""
        d = asdict(self)
        d["damaged_chunks"] = [c.hex() for c in self.damaged_chunks]
        d["damage"] = [{"snapshot": sid, "problems": list(p)} for sid, p in sorted(self.damage.items())]
        d["ok"] = self.ok
        return d



# -- verify ----------------------------------------------------------------------------------
def _check_chunk(repo: Repo, cid: bytes, raw_len: int, stored_len: int, csum: bytes, scope: bytes, deep: bool,
                 scratch: bytearray) -> str | None:
    try:
        path = repo.blob_path(cid)
    except CorruptionError as e:
        return str(e)
    try:  # open first, then look at what was opened: no window between the checks and the read
        fd, st = open_chunk(path)
    except FileNotFoundError:
        return "missing chunk file"
    except CorruptionError as e:
        return str(e)
    except OSError as e:
        return f"cannot open: {e.strerror}"
    try:
        if st.st_size != stored_len:
            return f"size {st.st_size}, catalog says {stored_len}"
        head: ChunkHeader = parse_header(os.pread(fd, HEADER_SIZE, 0))
        if not header_matches(head, raw_len, csum, stored_len):
            return "header disagrees with the catalog"
        if not deep:
            return None
        payload = memoryview(bytearray(head.payload_len))
        read_exact(fd, payload, HEADER_SIZE)
        if len(scratch) < raw_len:
            scratch.extend(bytes(raw_len - len(scratch)))
        out = memoryview(scratch)[:raw_len]
        decode_payload(head, payload, out)
        if checksum(out) != csum:
            return "checksum mismatch"
        if blake3.blake3(out, key=scope).digest() != cid:
            return "content does not match its address"
    except CorruptionError as e:
        return str(e)
    except OSError as e:
        return f"read error: {e.strerror}"
    finally:
        os.close(fd)
    return None


def _structure(c: Txn, report: VerifyReport) -> dict[int, list[str]]:
    """Chains, segments and accounting; returns the snapshots damaged structurally, with reasons."""
    bad: dict[int, list[str]] = {}

    def flag(sid: int, why: str) -> None:
        report.problems.append(f"snapshot {sid}: {why}")
        bad.setdefault(sid, []).append(why)

    idents = {row[0] for row in c.identities()}
    snaps = {s.id: s for s in c.snapshots()}
    parts: dict[int, dict[str, PartRow]] = {}
    for sid in snaps:
        try:
            parts[sid] = {p.name: p for p in c.parts(sid)}
        except StoreFormatError as e:  # a damaged catalog field: this snapshot's damage, not verify's end
            flag(sid, str(e))
            parts[sid] = {}
    for s in snaps.values():
        if s.identity_id not in idents:
            flag(s.id, f"its identity {s.identity_id} is missing")
        if s.parent_id is not None:
            p = snaps.get(s.parent_id)
            if p is None:
                flag(s.id, f"parent {s.parent_id} is missing")
                continue
            if s.base_tokens != p.n_tokens or s.depth != p.depth + 1:
                flag(s.id, f"does not continue parent {p.id} (starts at {s.base_tokens}, parent ends at {p.n_tokens})")
            if p.identity_id != s.identity_id or p.namespace != s.namespace:
                flag(s.id, f"parent {p.id} belongs to another identity or namespace")
        elif s.base_tokens != 0:
            flag(s.id, "a root that does not start at token 0")
        if len(s.tokens) != s.token_width * (s.n_tokens - s.base_tokens):
            flag(s.id, "token blob has the wrong length")
        for name, part in parts[s.id].items():
            chunks = c.part_chunks(s.id, name)
            if any(ch is None for ch in chunks):
                flag(s.id, f"part {name!r} references a chunk row that is missing")
            elif sum(ch.raw_len for ch in chunks if ch is not None) != part.nbytes:
                flag(s.id, f"part {name!r}: its chunks do not add up to its size")
            if part.kind == 1:
                start = 0
                if s.parent_id is not None and s.parent_id in parts:
                    pp = parts[s.parent_id].get(name)
                    start = pp.row_end if pp is not None else -1
                if part.row_start != start:
                    flag(s.id, f"part {name!r}: rows start at {part.row_start}, the chain ends at {start}")
                if part.row_end < part.row_start:
                    flag(s.id, f"part {name!r}: rows end before they start")
    for cid, refs, n in c.refcount_mismatches():
        report.problems.append(f"chunk {cid.hex()}: refcount {refs}, referenced {n} times")
    stored = sum(ch.stored_len for ch in c.all_chunks())
    if stored != c.stored_bytes():
        report.problems.append(f"stored-bytes counter {c.stored_bytes()} != {stored} in the catalog")
    return bad


def verify(repo: Repo, *, deep: bool = False, repair: bool = False, progress: Progress | None = None,
           grace: float = 3600.0, pending_lease: float | None = None) -> VerifyReport:
    """Check SQLite integrity, chunk files (re-hashed with ``deep``), chains and accounting.

    ``repair`` removes exactly the damaged snapshots and every snapshot whose chain includes one
    (then chain links left purposeless, rows of damaged chunks, and orphan/temp files older than
    ``grace``), and corrects the refcounts and the stored-bytes counter. It removes only damage it
    re-confirms inside its write transaction (a writer may have dropped and re-saved a chunk since
    the scan). ``pending_lease`` (default ``$SNAPSTORE_PENDING_LEASE_S``, else 300 s) applies to
    owners of the old token form when listing dead pending captures.
    """
    report = VerifyReport(deep=deep)
    db = repo.db
    lease = resolve_lease(pending_lease)

    def snapshot_state(c: Txn) -> tuple[list[str], list[str], dict[int, list[str]], list[Any], list[int]]:
        errs = c.integrity_check()
        fks = [f"foreign key: a {r[0]} row refers to a missing {r[2]} row"
               for r in c.foreign_key_check()]
        bad = _structure(c, report) if not errs else {}
        dead = [s.id for s in Liveness(repo.root, c, lease).dead_pending(c)]
        return errs, fks, bad, list(c.all_chunks()), dead

    errs, fks, bad, chunks, dead_pending = db.read(snapshot_state)
    report.sqlite_errors = errs
    report.problems[:0] = list(dict.fromkeys(fks))
    report.dead_pending = sorted(dead_pending)
    total = sum(ch.stored_len for ch in chunks)
    done = 0
    scratch = bytearray()
    damaged: dict[bytes, str] = {}
    if progress is not None:
        progress(0, total)
    for ch in chunks:
        problem = _check_chunk(repo, ch.id, ch.raw_len, ch.stored_len, ch.checksum, ch.scope, deep, scratch)
        report.checked_chunks += 1
        done += ch.stored_len
        if problem is not None:
            # beside a running engine a chunk may have been dropped since we listed it, or dropped
            # and saved again (another codec: another size): only damage against its current row counts
            problem = _recheck(repo, ch.id, deep, scratch)
        if problem is not None:
            damaged[ch.id] = problem
            report.problems.append(f"chunk {ch.id.hex()}: {problem}")
        if progress is not None:
            progress(done, total)
    report.checked_bytes = done
    report.damaged_chunks = list(damaged)

    def users(c: Txn) -> tuple[dict[int, list[str]], list[int]]:
        dmg = {sid: list(why) for sid, why in bad.items()}
        for cid, problem in damaged.items():
            for sid in c.chunk_users(cid):
                dmg.setdefault(sid, []).append(f"chunk {cid.hex()}: {problem}")
        affected = set(dmg)
        for sid in dmg:
            affected.update(c.descendants(sid))
        return dmg, sorted(affected)

    report.damage, report.affected_snapshots = db.read(users)
    report.damaged_snapshots = sorted(report.damage)
    known = {ch.id for ch in chunks}
    report.orphan_files = sorted(path for cid, path in repo.blob_files() if cid not in known)
    report.temp_files = temp_files(repo, time.time(), 0.0)
    if repair and not report.sqlite_errors:
        _repair(repo, report, bad, damaged, grace)
    return report


def _recheck(repo: Repo, cid: bytes, deep: bool, scratch: bytearray) -> str | None:
    """A suspect chunk checked again against its row as it is now (None: gone, or healthy now)."""
    row = repo.db.read(lambda c: c.chunk(cid))
    if row is None:
        return None
    return _check_chunk(repo, cid, row.raw_len, row.stored_len, row.checksum, row.scope, deep, scratch)


def _repair(repo: Repo, report: VerifyReport, bad: dict[int, list[str]], damaged: dict[bytes, str],
            grace: float) -> None:
    """Drop what the scan found damaged, after re-confirming it inside the write transaction.

    The scan ran without the write lock: beside a running engine a chunk it found damaged (or
    missing, or of another size) may since have been dropped and saved again, healthy, by a
    snapshot the scan never saw. Under the lock no writer can drop, re-save or unlink a chunk, so
    each suspect file is re-checked against its current row there, structural damage is
    re-derived, and the damaged set comes only from what is confirmed, never from the scan alone.
    """
    scratch = bytearray()

    def fix(c: Txn) -> tuple[dict[bytes, str], dict[int, list[str]], list[int], list[int]]:
        confirmed: dict[bytes, str] = {}
        for cid in damaged:
            row = c.chunk(cid)
            if row is None:
                continue  # dropped since the scan: no snapshot uses it any more
            again = _check_chunk(repo, cid, row.raw_len, row.stored_len, row.checksum, row.scope, report.deep,
                                 scratch)
            if again is not None:
                confirmed[cid] = again
        still_bad = _structure(c, VerifyReport(deep=report.deep)) if bad else {}
        dmg: dict[int, list[str]] = {sid: list(still_bad[sid]) for sid in bad if sid in still_bad}
        for cid, problem in confirmed.items():
            for sid in c.chunk_users(cid):
                dmg.setdefault(sid, []).append(f"chunk {cid.hex()}: {problem}")
        # the descendants as they are now: a child saved since the scan is removed too
        doomed: set[int] = set(dmg)
        for sid in dmg:
            doomed.update(c.descendants(sid))
        rows = [s for s in (c.snapshot(sid) for sid in doomed) if s is not None]
        parents = {s.parent_id for s in rows if s.parent_id is not None} - doomed
        for s in sorted(rows, key=lambda s: (-s.depth, -s.id)):
            c.delete_snapshot(s.id)
        pruned: list[int] = []
        for pid in sorted(parents):
            p = c.snapshot(pid)
            if p is not None and not p.matchable and p.state == 1 and not c.has_children(pid):
                own, links = drop_leaf(c, pid)
                pruned += own + links
        for sid in c.orphan_part_owners():  # parts whose snapshot row was deleted
            c.delete_snapshot(sid)
        for cid, _refs, n in c.refcount_mismatches():
            c.set_refs(cid, n)
        # rows of damaged chunks, and chunks left unreferenced by the refcount fix
        for ch in list(c.all_chunks()):
            if ch.refs == 0:
                c.delete_chunk_row(ch.id)  # its file goes after the commit
        c.set_counter("stored_bytes", sum(ch.stored_len for ch in c.all_chunks()))
        return confirmed, dmg, sorted(s.id for s in rows), sorted(pruned)

    confirmed, dmg, removed, pruned = repo.write(fix)  # unlinks the files of the rows it removed
    repo.sweep(confirmed)  # a damaged file whose row is gone: removed even if young
    # the report tells what was confirmed and removed, not what the unlocked scan suspected
    stale = {f"chunk {cid.hex()}: {why}" for cid, why in damaged.items()}
    stale |= {f"snapshot {sid}: {why}" for sid, whys in bad.items() for why in whys}
    report.problems = [p for p in report.problems if p not in stale]
    report.problems += [f"snapshot {sid}: {why}" for sid, whys in sorted(dmg.items()) for why in whys
                        if not why.startswith("chunk ")]
    report.problems += [f"chunk {cid.hex()}: {why}" for cid, why in confirmed.items()]
    report.damaged_chunks = list(confirmed)
    report.damage = dmg
    report.damaged_snapshots = sorted(dmg)
    report.affected_snapshots = removed
    report.removed_snapshots = removed
    report.pruned_snapshots = pruned
    report.repaired = not report.ok  # damage was confirmed and removed
    orphans, temps, _ = collect_orphans(repo, grace, dry_run=False)
    report.removed_files = orphans + temps
