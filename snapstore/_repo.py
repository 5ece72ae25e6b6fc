"""A store directory on disk: its paths, its catalog, and the safe removal of chunk files.

Shared by :class:`snapstore.Store` (an engine's view, bound to one identity) and the CLI
(maintenance across identities).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from typing import TypeVar

from ._chunkfile import is_hex_id
from ._db import Database, Txn
from ._db_copy import MemDatabase, snapshot_catalog
from ._errors import ConfigError, CorruptionError, SnapstoreError, StoreFormatError
from ._publish import ensure_dir, fsync_dir, io_error

__all__ = ["Repo"]

DB_NAME = "snapstore.db"
_HEX2 = [f"{i:02x}" for i in range(256)]
T = TypeVar("T")


class Repo:
    """Paths and catalog of one store directory, and its write path (rows first, files after commit)."""

    def __init__(self, root: str, *, readonly: bool = False, db: Database | None = None) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError(f"store path must be a path, got {root!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.blobs = os.path.join(self.root, "blobs")
        self.tmp = os.path.join(self.root, "tmp")
        self.db_path = os.path.join(self.root, DB_NAME)
        self.readonly = readonly
        self.db = db if db is not None else Database(self.db_path, readonly=readonly)

    @classmethod
    def open(cls, root: str, *, readonly: bool = False, create: bool = True) -> Repo:
        """Open the store directory at ``root`` (creating its directories and catalog if ``create``)."""
        repo = cls(root, readonly=readonly)
        if readonly or not create:
            if not os.path.isfile(repo.db_path):
                raise StoreFormatError(f"{repo.root} is not a snapstore store (no {DB_NAME})")
        else:
            repo._create_dirs()
        repo.db.open()
        return repo

    def _create_dirs(self) -> None:
        fresh = not os.path.exists(self.blobs)
        try:
            os.makedirs(os.path.dirname(self.root) or ".", mode=0o700, exist_ok=True)
        except OSError as e:
            raise io_error(f"cannot create the store directory {self.root}", e) from None
        ensure_dir(self.root)
        ensure_dir(self.blobs)
        ensure_dir(self.tmp)
        if fresh or not os.path.isdir(os.path.join(self.blobs, "ff")):
            for h in _HEX2:
                ensure_dir(os.path.join(self.blobs, h))
            try:
                fsync_dir(self.blobs)
                fsync_dir(self.root)
            except OSError as e:
                raise io_error(f"cannot fsync {self.root}", e) from None

    def write(self, fn: Callable[[Txn], T], *, durable: bool = True, discard: Iterable[bytes] = (),
              committed: Callable[[], None] | None = None, deferred: Callable[[], None] | None = None) -> T:
        """Run ``fn`` in a write transaction, then unlink the chunk files it freed.

        The one place chunk files leave the store: rows first, files after the commit. ``discard``:
        chunk files this call published for the transaction, unlinked (when still unreferenced) if
        it fails. ``committed`` runs right after the commit (a test hook). After the commit nothing
        may fail the call: a file that cannot be unlinked now (the catalog locked too long, an I/O
        error) stays as an orphan that gc removes later, and ``deferred`` is called.
        """
        try:
            result, freed = self.db.write_collect(fn, durable=durable)
        except BaseException:
            try:
                self.sweep(discard)  # the retry (or the caller) republishes what it needs: no orphans
            except SnapstoreError:
                pass  # left as orphans for gc; the transaction's own error is the one to report
            raise
        if committed is not None:
            committed()
        try:
            self.sweep(freed)
        except SnapstoreError:
            if deferred is not None:
                deferred()
        return result

    def sweep(self, ids: Iterable[bytes], batch: int = 1 << 30) -> int:
        """Unlink chunk files whose rows are gone, ``batch`` per write transaction; returns bytes freed.

        The one way files leave the store: the write path after its commit, gc, verify's repair, a
        save's or a fetch's rollback of files it published, all call this (a read-only repo: none)."""
        todo = list(dict.fromkeys(ids))
        done = 0
        for i in range(0, len(todo), batch):
            done += 0 if self.readonly else _unlink_gone(self.db, self.blob_path, todo[i:i + batch])
        return done

    def blob_path(self, cid: bytes) -> str:
        """blobs/<2 hex>/<64 hex>: built only from a 32-byte digest, through a real directory.

        CorruptionError for an id of the wrong form (a damaged catalog row) or a ``blobs/<xx>``
        that is not a real directory (a planted symlink is never followed out of the store; the
        last component is opened with O_NOFOLLOW by every reader).
        """
        if not isinstance(cid, bytes) or len(cid) != 32:
            raise CorruptionError(f"catalog holds a malformed chunk id {bytes(cid)[:40].hex()!r}; run "
                                  "`snapstore verify --repair`")
        h = cid.hex()
        sub = os.path.join(self.blobs, h[:2])
        try:
            st = os.lstat(sub)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise CorruptionError(f"{sub} is not a real directory (a symlink?); refusing to follow it")
        return os.path.join(sub, h)

    def blob_files(self) -> Iterable[tuple[bytes, str]]:
        """Every chunk-named file under blobs/ (other names are reported by verify, never followed)."""
        for sub in _HEX2:
            d = os.path.join(self.blobs, sub)
            try:
                with os.scandir(d) as it:
                    for e in it:
                        if is_hex_id(e.name) and e.name.startswith(sub):
                            yield bytes.fromhex(e.name), e.path
            except FileNotFoundError:
                continue

    def close(self) -> None:
        """Close the catalog."""
        self.db.close()


class SnapshotRepo(Repo):
    """A store seen through a private in-memory copy of its catalog, taken without writing a byte.

    The copy comes from one read transaction of a read-only connection; when the store has a
    ``-shm`` file (an engine has it open, or one crashed) the connection uses ``readonly_shm`` so
    that not even SQLite's shared-memory index is written, otherwise the ``-wal``/``-shm`` files
    it had to create are removed again (:func:`release_wal`). Chunk files are read live.
    """

    @classmethod
    def open(cls, root: str, *, readonly: bool = True, create: bool = False) -> SnapshotRepo:
        """Copy the catalog of the store at ``root`` into memory (never writing to the store)."""
        path = os.path.join(os.path.abspath(os.fspath(root)), DB_NAME)
        if not os.path.isfile(path):
            raise StoreFormatError(f"{os.path.abspath(os.fspath(root))} is not a snapstore store (no {DB_NAME})")
        return cls(root, readonly=True, db=MemDatabase(snapshot_catalog(path), path).open())


def _unlink_gone(db: Database, blob_path: Callable[[bytes], str], ids: Iterable[bytes]) -> int:
    """Unlink chunk files whose rows are gone, inside a write transaction (so no concurrent save
    can commit a reference to a file between the check and the unlink). Returns bytes freed."""
    todo = list(dict.fromkeys(ids))
    if not todo:
        return 0

    def run(t: Txn) -> int:
        freed = 0
        for cid in todo:
            if t.chunk(cid) is None:
                try:
                    path = blob_path(cid)
                except CorruptionError:
                    continue  # never unlink through a planted symlink
                try:
                    freed += os.stat(path, follow_symlinks=False).st_size
                    os.unlink(path)
                except OSError:
                    pass  # already gone, or not removable now: an orphan for gc, never an error here
        return freed

    return db.write(run)
