"""gc: reclaim what nothing references — dead pending captures, stale identities, expired and
over-budget snapshots (the lifecycle policies the Store applies at open and close, from
:mod:`snapstore.lifecycle.rules`), then orphan chunk files and temp files older than the grace period.

Files younger than the grace period are never collected, so gc is safe beside running writers.
A dry-run gc computes its plan on an in-memory copy of the catalog (SQLite's backup API over a
read transaction) with the very same code the real run uses, so what it lists is what a real run
would remove, and nothing in the store directory is written.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from snapstore._config import Budget
from snapstore._config import pending_lease as resolve_lease
from snapstore._errors import CorruptionError
from snapstore.catalog.copy import catalog_copy
from snapstore.catalog.db import rolled_back
from snapstore.catalog.fence import inside
from snapstore.catalog.queries import Txn
from snapstore.chunks.publish import SCRATCH_PREFIX, TEMP_PREFIX
from snapstore.chunks.repo import Repo
from snapstore.chunks.tree import list_dir, open_dir, remove_in, remove_tree_at
from snapstore.lifecycle.eviction import evict_until, over_budget
from snapstore.lifecycle.liveness import Liveness, reap_lock_files
from snapstore.lifecycle.rules import (
    IdentityDrop,
    drop_dead_pending,
    drop_identities,
    drop_stale,
    expire,
    log_drops,
)

__all__ = ["GcReport", "Progress", "collect_orphans", "gc", "path_or_id", "temp_files"]

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
_UNLINK_BATCH = 256  # chunk files unlinked per write transaction (keeps the lock short beside writers)


@dataclass
class GcReport:
    """What gc removed (or, with dry_run, would remove)."""

    dry_run: bool
    removed_snapshots: list[int] = field(default_factory=list)
    dead_pending: list[int] = field(default_factory=list)
    expired: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    chunk_files: list[str] = field(default_factory=list)
    orphan_files: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    freed_chunks: int = 0
    bytes_freed: int = 0
    stored_bytes_before: int = 0
    stored_bytes_after: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)



def path_or_id(repo: Repo, cid: bytes) -> str:
    """The chunk file's path, or its hex id when the id is malformed."""
    try:
        return repo.blob_path(cid)
    except CorruptionError:
        return bytes(cid).hex()


# -- files -----------------------------------------------------------------------------------
def temp_files(repo: Repo, now: float, grace: float) -> list[str]:
    """Leftover temp files of interrupted writes, and scratch store directories of an interrupted
    ``snapstore bench``, older than ``grace`` seconds (in the real tmp/ only: a link in its place
    lists nothing, and a link inside it is never followed)."""
    out = []
    for name in list_dir(repo.root, "tmp"):
        if name.startswith(TEMP_PREFIX):
            path = os.path.join(repo.tmp, name)
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            scratch = stat.S_ISDIR(st.st_mode) and name.startswith(SCRATCH_PREFIX)
            if (stat.S_ISREG(st.st_mode) or scratch) and now - st.st_mtime >= grace:
                out.append(path)
    return sorted(out)


def _size(path: str) -> int:
    """A temp file's bytes, or a scratch directory's (its regular files, no link followed)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for folder, _dirs, files in os.walk(path):
        for f in files:
            try:
                fst = os.stat(os.path.join(folder, f), follow_symlinks=False)
            except OSError:
                continue
            total += fst.st_size if stat.S_ISREG(fst.st_mode) else 0
    return total


def _remove_temp(repo: Repo, path: str) -> int:
    """Remove one of :func:`temp_files`' entries, never through a link; the bytes freed. A scratch
    directory is removed relative to a descriptor of the real tmp/ (``open_dir``: a link planted in
    place of tmp/ since the listing fails it), following no link inside it (``remove_tree_at``)."""
    name = os.path.basename(path)
    if not name.startswith(SCRATCH_PREFIX):
        return remove_in(repo.root, ("tmp",), name) or 0
    size = _size(path)
    fd = open_dir(repo.root, "tmp")
    try:
        if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            return 0
        remove_tree_at(fd, name)
    finally:
        os.close(fd)
    return size


def _unlink_chunks(repo: Repo, ids: Iterable[bytes], progress: Progress | None = None,
                   done: int = 0, total: int = 0) -> int:
    """Unlink chunk files whose rows are gone, a batch per write transaction; returns bytes freed."""
    todo = list(dict.fromkeys(ids))
    freed = 0
    for i in range(0, len(todo), _UNLINK_BATCH):
        freed += repo.sweep(todo[i:i + _UNLINK_BATCH])
        if progress is not None:
            progress(min(total, done + freed), total)
    return freed


def collect_orphans(repo: Repo, grace: float, dry_run: bool, progress: Progress | None = None
                     ) -> tuple[list[str], list[str], int]:
    """Chunk files no catalog row names and temp files, both older than ``grace``; removed unless dry_run."""
    now = time.time()
    known = set(repo.db.read(lambda c: [ch.id for ch in c.all_chunks()]))
    old: list[bytes] = []
    paths: list[str] = []
    nbytes = 0
    for cid, path in repo.blob_files():
        if cid in known:
            continue
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if now - st.st_mtime >= grace:
            old.append(cid)
            paths.append(path)
            nbytes += st.st_size
    temps = temp_files(repo, now, grace)
    temp_bytes = sum(_size(t) for t in temps)
    if dry_run:
        return sorted(paths), temps, nbytes + temp_bytes
    total = nbytes + temp_bytes
    freed = _unlink_chunks(repo, old, progress, 0, total)
    for t in temps:
        try:
            freed += _remove_temp(repo, t)
        except OSError:
            pass  # not removable now: the next gc tries again
        if progress is not None:
            progress(min(total, freed), total)
    return sorted(paths), temps, freed


# -- gc --------------------------------------------------------------------------------------
def gc(repo: Repo, *, budget: Budget | None = None, grace: float = 3600.0, dry_run: bool = False,
       ttl: float | None = None, drop_identity: str | None = None, keep_identity: str | None = None,
       disk_bytes: int | None = None, max_entries: int | None = None,
       progress: Progress | None = None, pending_lease: float | None = None) -> GcReport:
    """Remove dead pending captures, stale-identity and expired snapshots, over-budget leaves, then orphans.

    The budget is ``budget`` (resolved: the library's view) or else ``disk_bytes``/``max_entries``
    (None: no limit). Eviction pops least-recently-used committed leaves, as the library does.
    ``dry_run`` plans on an in-memory copy of the catalog and writes nothing. Dead pending
    captures are judged by the one liveness rule (:mod:`snapstore.lifecycle.owner`); ``pending_lease``
    (default ``$SNAPSTORE_PENDING_LEASE_S``, else 300 s) applies to owners of the old token form.
    ``drop_identity``: drop that identity (any model); ``keep_identity``: drop the identities the
    one staleness rule calls stale for it (:func:`snapstore.lifecycle.rules.drop_stale`: the same model under
    another build, kv mode, draft setting or extra keys; other models' snapshots stay).
    """
    report = GcReport(dry_run=dry_run)
    lease = resolve_lease(pending_lease)
    owners_left: list[str] = []
    dropped: list[IdentityDrop] = []
    if budget is not None:
        b = budget.resolved()
        disk_bytes, max_entries = b.disk_bytes, b.max_entries
        ttl = ttl if ttl is not None else b.ttl
    now = time.time()

    def txn(t: Txn) -> None:
        report.stored_bytes_before = t.stored_bytes()
        live = Liveness(repo.root, t, lease, now)
        gone, pruned, _dead = drop_dead_pending(t, live)
        report.dead_pending.extend(gone)
        report.removed_snapshots.extend(gone + pruned)
        owners_left[:] = list(t.owners())
        drops: list[IdentityDrop] = []
        if drop_identity is not None:  # asked for by name: that identity, whatever its model
            drops += drop_identities(t, lambda key, _fields: key == drop_identity, live)
        if keep_identity is not None:  # the one staleness rule: the keeper's model's other identities
            drops += drop_stale(t, keep_identity, live)
        dropped[:] = drops
        for d in drops:
            report.stale.extend(d.snapshots)
            report.removed_snapshots.extend(d.snapshots)
        if ttl:
            old = expire(t, now - ttl)
            report.expired.extend(old)
            report.removed_snapshots.extend(old)
        if disk_bytes is not None or max_entries is not None:
            _, evicted = evict_until(t, lambda _freed: over_budget(t, disk_bytes, max_entries) is None, set())
            report.evicted.extend(evicted)
            report.removed_snapshots.extend(evicted)
        report.stored_bytes_after = t.stored_bytes()

    if dry_run:
        with inside():  # the private copy is SQLite too: a fork waits for it (catalog.fence)
            mem = catalog_copy(repo.db.conn())
            try:
                _, freed = rolled_back(mem, txn)
            finally:
                mem.close()
    else:
        freed = repo.db.write_collect(txn)[1]  # unlinked below, with progress, a batch at a time
        log_drops(dropped, "gc " + ("--drop-identity" if drop_identity is not None else "--keep-identity"))
    freed = list(dict.fromkeys(freed))
    for bucket in (report.removed_snapshots, report.dead_pending, report.stale, report.expired, report.evicted):
        bucket[:] = sorted(set(bucket))
    report.freed_chunks = len(freed)
    report.chunk_files = sorted(path_or_id(repo, cid) for cid in freed)
    chunk_bytes = sum(_size(p) for p in report.chunk_files)
    if dry_run:
        orphans, temps, orphan_bytes = collect_orphans(repo, grace, True)
        report.bytes_freed = chunk_bytes + orphan_bytes
    else:
        if progress is not None:
            progress(0, chunk_bytes)
        report.bytes_freed = _unlink_chunks(repo, freed, progress, 0, chunk_bytes)
        orphans, temps, orphan_bytes = collect_orphans(repo, grace, False, progress)
        report.bytes_freed += orphan_bytes
        # lock files of owners that are gone (a crash leaves them; only this kernel's are judged)
        reap_lock_files(repo.root, None, registered=owners_left)
    report.orphan_files, report.temp_files = orphans, temps
    return report
