"""verify and gc: prove a store is intact, and reclaim what nothing references.

Both work on a :class:`Repo` (any identity) so the CLI and ``Store.verify``/``Store.gc`` share
them. Removal of files always goes through the transaction-checked unlink of the Repo, and
files younger than the grace period are never collected, so gc is safe beside running writers.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import blake3

from ._chunkfile import HEADER_SIZE, ChunkHeader, checksum, decode_payload, parse_header, read_exact
from ._config import Budget
from ._db import Conn, Database
from ._errors import CorruptionError
from ._lifecycle import drop_subtree, evict_until
from ._publish import TEMP_PREFIX
from ._repo import Repo, owner_alive

__all__ = ["GcReport", "VerifyReport", "gc", "verify"]

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass
class VerifyReport:
    """What verify found. ``ok`` is True when nothing is damaged (cleanable leftovers are not damage)."""

    deep: bool
    checked_chunks: int = 0
    checked_bytes: int = 0
    sqlite_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    damaged_chunks: list[bytes] = field(default_factory=list)
    damaged_snapshots: list[int] = field(default_factory=list)
    affected_snapshots: list[int] = field(default_factory=list)
    orphan_files: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    dead_pending: list[int] = field(default_factory=list)
    repaired: bool = False
    removed_snapshots: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No damage found (orphans, temp files and dead pending captures are gc's, not damage)."""
        return not (self.sqlite_errors or self.problems or self.damaged_chunks or self.damaged_snapshots)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (chunk ids as hex)."""
        d = asdict(self)
        d["damaged_chunks"] = [c.hex() for c in self.damaged_chunks]
        d["ok"] = self.ok
        return d


@dataclass
class GcReport:
    """What gc removed (or, with dry_run, would remove)."""

    dry_run: bool
    removed_snapshots: list[int] = field(default_factory=list)
    dead_pending: list[int] = field(default_factory=list)
    expired: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    orphan_files: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    freed_chunks: int = 0
    bytes_freed: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)


def _check_chunk(repo: Repo, cid: bytes, raw_len: int, stored_len: int, csum: bytes, deep: bool,
                 scratch: bytearray) -> str | None:
    path = repo.blob_path(cid)
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return "missing chunk file"
    except OSError as e:
        return f"cannot stat chunk file: {e.strerror}"
    if not os.path.isfile(path) or os.path.islink(path):
        return "not a regular file"
    if st.st_size != stored_len:
        return f"size {st.st_size}, catalog says {stored_len}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return f"cannot open: {e.strerror}"
    try:
        head: ChunkHeader = parse_header(os.pread(fd, HEADER_SIZE, 0))
        if head.raw_len != raw_len or head.checksum != csum or HEADER_SIZE + head.payload_len != stored_len:
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
        if blake3.blake3(out).digest() != cid:
            return "content does not match its address"
    except CorruptionError as e:
        return str(e)
    except OSError as e:
        return f"read error: {e.strerror}"
    finally:
        os.close(fd)
    return None


def _structure(c: Conn, report: VerifyReport) -> set[int]:
    """Chains, segments and accounting; returns snapshots damaged structurally."""
    bad: set[int] = set()
    snaps = {s.id: s for s in Database.snapshots(c)}
    parts = {sid: {p.name: p for p in Database.parts(c, sid)} for sid in snaps}
    for s in snaps.values():
        if s.parent_id is not None:
            p = snaps.get(s.parent_id)
            if p is None:
                report.problems.append(f"snapshot {s.id}: parent {s.parent_id} is missing")
                bad.add(s.id)
                continue
            if s.base_tokens != p.n_tokens or s.depth != p.depth + 1:
                report.problems.append(f"snapshot {s.id}: does not continue parent {p.id} "
                                       f"(starts at {s.base_tokens}, parent ends at {p.n_tokens})")
                bad.add(s.id)
        elif s.base_tokens != 0:
            report.problems.append(f"snapshot {s.id}: a root that does not start at token 0")
            bad.add(s.id)
        if len(s.tokens) != s.token_width * (s.n_tokens - s.base_tokens):
            report.problems.append(f"snapshot {s.id}: token blob has the wrong length")
            bad.add(s.id)
        for name, part in parts[s.id].items():
            chunks = Database.part_chunks(c, s.id, name)
            if any(ch is None for ch in chunks):
                report.problems.append(f"snapshot {s.id} part {name!r}: references a chunk row that is missing")
                bad.add(s.id)
            elif sum(ch.raw_len for ch in chunks if ch is not None) != part.nbytes:
                report.problems.append(f"snapshot {s.id} part {name!r}: chunks do not add up to its size")
                bad.add(s.id)
            if part.kind == 1:
                start = 0
                if s.parent_id is not None and s.parent_id in parts:
                    pp = parts[s.parent_id].get(name)
                    start = pp.row_end if pp is not None else -1
                if part.row_start != start:
                    report.problems.append(f"snapshot {s.id} part {name!r}: rows start at {part.row_start}, "
                                           f"the chain ends at {start}")
                    bad.add(s.id)
    for cid, refs, n in Database.refcount_mismatches(c):
        report.problems.append(f"chunk {cid.hex()}: refcount {refs}, referenced {n} times")
    stored = sum(ch.stored_len for ch in Database.all_chunks(c))
    if stored != Database.stored_bytes(c):
        report.problems.append(f"stored-bytes counter {Database.stored_bytes(c)} != {stored} in the catalog")
    return bad


def verify(repo: Repo, *, deep: bool = False, repair: bool = False, progress: Progress | None = None,
           grace: float = 3600.0) -> VerifyReport:
    """Check SQLite integrity, chunk files (re-hashed with ``deep``), chains and accounting."""
    report = VerifyReport(deep=deep)
    db = repo.db

    def snapshot_state(c: Conn) -> tuple[list[str], set[int], list[Any], list[Any]]:
        errs = Database.integrity_check(c) + [f"foreign key: {r}" for r in Database.foreign_key_check(c)]
        bad = _structure(c, report) if not errs else set()
        return errs, bad, list(Database.all_chunks(c)), Database.pending(c)

    errs, bad, chunks, pending = db.read(snapshot_state)
    report.sqlite_errors = errs
    report.dead_pending = [s.id for s in pending if not owner_alive(s.owner)]
    total = sum(ch.stored_len for ch in chunks)
    done = 0
    scratch = bytearray()
    damaged: list[bytes] = []
    for ch in chunks:
        problem = _check_chunk(repo, ch.id, ch.raw_len, ch.stored_len, ch.checksum, deep, scratch)
        report.checked_chunks += 1
        done += ch.stored_len
        if problem is not None:
            # a chunk may have been dropped (and unlinked) by a writer since we listed it
            if problem == "missing chunk file" and db.read(lambda c: Database.chunk(c, ch.id)) is None:
                continue
            damaged.append(ch.id)
            report.problems.append(f"chunk {ch.id.hex()}: {problem}")
        if progress is not None:
            progress(done, total)
    report.checked_bytes = done
    report.damaged_chunks = damaged

    def users(c: Conn) -> tuple[list[int], list[int]]:
        dmg = set(bad)
        for cid in damaged:
            dmg.update(Database.chunk_users(c, cid))
        affected = set(dmg)
        for sid in dmg:
            affected.update(Database.descendants(c, sid))
        return sorted(dmg), sorted(affected)

    report.damaged_snapshots, report.affected_snapshots = db.read(users)
    now = time.time()
    known = {ch.id for ch in chunks}
    for cid, path in repo.blob_files():
        if cid not in known:
            report.orphan_files.append(path)
    report.temp_files = _temp_files(repo, now, 0.0)
    if repair and not report.sqlite_errors:
        def fix(c: Conn) -> tuple[list[bytes], list[int]]:
            freed: list[bytes] = []
            removed: list[int] = []
            for sid in report.damaged_snapshots:
                if Database.snapshot(c, sid) is not None:
                    f, gone = drop_subtree(c, sid)
                    freed += f
                    removed += gone
            for cid in damaged:  # rows of damaged chunks that no snapshot uses any more
                row = Database.chunk(c, cid)
                if row is not None and row.refs == 0:
                    c.execute("DELETE FROM chunks WHERE id = ?", (cid,))
                    Database.add_counter(c, "stored_bytes", -row.stored_len)
                    freed.append(cid)
            for cid, refs, n in Database.refcount_mismatches(c):
                c.execute("UPDATE chunks SET refs = ? WHERE id = ?", (n, cid))
            Database.set_counter(c, "stored_bytes", sum(ch.stored_len for ch in Database.all_chunks(c)))
            return freed, removed

        freed, removed = db.write(fix)
        repo.unlink_unreferenced(freed)
        for cid in damaged:  # damaged file whose row is gone: remove it even if young
            repo.unlink_unreferenced([cid])
        report.removed_snapshots = sorted(removed)
        report.repaired = True
        _remove_orphans(repo, grace, dry_run=False)
    return report


def _temp_files(repo: Repo, now: float, grace: float) -> list[str]:
    out = []
    try:
        with os.scandir(repo.tmp) as it:
            for e in it:
                if e.name.startswith(TEMP_PREFIX) and e.is_file(follow_symlinks=False):
                    if now - e.stat(follow_symlinks=False).st_mtime >= grace:
                        out.append(e.path)
    except FileNotFoundError:
        pass
    return sorted(out)


def _remove_orphans(repo: Repo, grace: float, dry_run: bool) -> tuple[list[str], list[str], int]:
    now = time.time()
    known = set(repo.db.read(lambda c: [ch.id for ch in Database.all_chunks(c)]))
    old: list[bytes] = []
    paths: list[str] = []
    for cid, path in repo.blob_files():
        if cid in known:
            continue
        try:
            age = now - os.stat(path, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if age >= grace:
            old.append(cid)
            paths.append(path)
    temps = _temp_files(repo, now, grace)
    freed = 0
    if not dry_run:
        freed = repo.unlink_unreferenced(old)
        for t in temps:
            try:
                freed += os.stat(t).st_size
                os.unlink(t)
            except FileNotFoundError:
                pass
    return paths, temps, freed


class _DryRun(Exception):
    def __init__(self, result: Any):
        self.result = result


def gc(repo: Repo, *, budget: Budget | None = None, grace: float = 3600.0, dry_run: bool = False,
       ttl: float | None = None, drop_identity: str | None = None, keep_identity: str | None = None) -> GcReport:
    """Remove dead pending captures, expired/stale snapshots, over-budget leaves, then orphan files."""
    report = GcReport(dry_run=dry_run)
    b = budget.resolved() if budget is not None else None
    ttl = ttl if ttl is not None else (b.ttl if b is not None else None)
    now = time.time()

    def txn(c: Conn) -> list[bytes]:
        freed: list[bytes] = []

        def drop(sid: int, bucket: list[int]) -> None:
            nonlocal freed
            if Database.snapshot(c, sid) is None:
                return
            f, gone = drop_subtree(c, sid)
            freed += f
            bucket.extend(gone)
            report.removed_snapshots.extend(gone)

        for s in Database.pending(c):
            if not owner_alive(s.owner):
                drop(s.id, report.dead_pending)
        for ident_id, key, *_ in Database.identities(c):
            if (drop_identity is not None and key == drop_identity) or (
                    keep_identity is not None and key != keep_identity):
                for s in sorted(Database.snapshots(c, ident_id), key=lambda s: -s.depth):
                    drop(s.id, report.stale)
                Database.delete_identity(c, ident_id)
        if ttl:
            for s in Database.expired(c, now - ttl):
                if Database.snapshot(c, s.id) is not None and not Database.has_children(c, s.id):
                    drop(s.id, report.expired)
        if b is not None:
            def fits(_: list[bytes]) -> bool:
                if Database.stored_bytes(c) > (b.disk_bytes or 0):
                    return False
                return b.max_entries is None or Database.entry_count(c) <= b.max_entries
            before = {s.id for s in Database.snapshots(c)}
            _, f, _ = evict_until(c, fits, set())
            freed += f
            after = {s.id for s in Database.snapshots(c)}
            report.evicted.extend(sorted(before - after))
            report.removed_snapshots.extend(sorted(before - after))
        report.freed_chunks = len(set(freed))
        report.bytes_freed = 0
        for cid in set(freed):
            try:
                report.bytes_freed += os.stat(repo.blob_path(cid)).st_size
            except OSError:
                pass
        if dry_run:
            raise _DryRun(freed)
        return freed

    try:
        freed = repo.db.write(txn)
        repo.unlink_unreferenced(freed)
    except _DryRun:
        pass
    report.removed_snapshots = sorted(set(report.removed_snapshots))
    orphans, temps, freed_bytes = _remove_orphans(repo, grace, dry_run)
    report.orphan_files, report.temp_files = orphans, temps
    report.bytes_freed += freed_bytes
    return report
