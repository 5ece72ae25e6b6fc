"""A store directory on disk: its paths, its catalog, and the safe removal of chunk files.

Shared by :class:`snapstore.Store` (an engine's view, bound to one identity) and the CLI
(maintenance across identities).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from snapstore._errors import ConfigError, CorruptionError, SnapstoreError, StoreFormatError, StoreIOError
from snapstore.catalog.chain_cache import ChainCache, shared_memo
from snapstore.catalog.copy import MemDatabase, snapshot_catalog
from snapstore.catalog.db import APPLICATION_ID, Database, Txn
from snapstore.catalog.foreign import foreign_error, foreign_file
from snapstore.catalog.readonly import read_only_error
from snapstore.chunks.chunkfile import is_hex_id
from snapstore.chunks.open_files import OpenFiles
from snapstore.chunks.publish import ensure_dir, fsync_dir, io_error
from snapstore.chunks.tree import DB_NAME, check_tree, list_dir, remove_in, write_refusal

__all__ = ["DB_NAME", "Repo"]

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
        # plan reads kept while the catalog generation stands, one memo per catalog file in this
        # process; none where no trigger guards the file (read-only, a private copy)
        self.plans = ChainCache(enabled=False) if self.db.readonly else shared_memo(self.db_path)
        # the small chunk files those plans opened, kept open under the same stamp (chunks.open_files);
        # a plan of any store of this process on the catalog that reads a newer stamp closes them
        self.files = OpenFiles()
        if self.plans.enabled:
            self.plans.on_move(self.files)

    @classmethod
    def open(cls, root: str, *, readonly: bool = False, create: bool = True) -> Repo:
        """Open the store directory at ``root`` (creating its directories and catalog if ``create``).

        The one way a store is opened (the library, the CLI, read-only or not): its entries are
        checked first (:func:`check_tree`: no link, nothing of the wrong kind), and a store that
        cannot be written is refused unless ``readonly``, in one sentence saying why.
        """
        repo = cls(root, readonly=readonly)
        if os.path.exists(repo.root) and not os.path.isdir(repo.root):  # not "cannot examine …/blobs" (issue 46)
            raise ConfigError(f"{repo.root} is a file, not a directory: a store is a directory (snapstore.db, "
                              "blobs/, tmp/); pass a directory, or a path that does not exist yet to create one")
        check_tree(repo.root)
        if readonly or not create:
            if not os.path.isfile(repo.db_path):
                raise StoreFormatError(f"{repo.root} is not a snapstore store (no {DB_NAME})")
        if not readonly:
            refusal = write_refusal(repo.root) if os.path.isdir(repo.root) else None
            if refusal is not None:
                raise StoreIOError(refusal[0], f"cannot open the store at {repo.root} for writing: {refusal[1]}; "
                                   "to read it, open it with read_only=True (snapstore inspect, stats, verify "
                                   "and gc --dry-run do so by themselves)")
            if foreign_file(repo.db_path, APPLICATION_ID):  # refused before a directory is made beside it
                raise foreign_error(repo.db_path)
            if create:
                repo._create_dirs()
        repo.db = repo._catalog().open()
        return repo

    def _catalog(self) -> Database:
        """The catalog :meth:`open` opens: the database file itself."""
        return self.db

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

    def refuse_write(self, what: str) -> None:
        """StateError when the store was opened read-only: called before a change begins (a save
        publishes chunk files before its transaction), so nothing is written."""
        if self.readonly:
            raise read_only_error(self.root, what)

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
            self._discard(discard)
            raise
        self._committed(freed, committed, deferred)
        return result

    @contextmanager
    def writing(self, *, discard: Iterable[bytes] = (), committed: Callable[[], None] | None = None,
                deferred: Callable[[], None] | None = None) -> Iterator[Txn]:
        """:meth:`write` as a block (:meth:`Database.writing`: opened and committed where the caller
        reads it), under the same rule: ``discard`` unlinked if it fails, freed files after the commit."""
        try:
            with self.db.writing() as t:
                yield t
        except BaseException:
            self._discard(discard)
            raise
        self._committed(t.freed, committed, deferred)

    def _discard(self, ids: Iterable[bytes]) -> None:
        """A failed write's own files, unlinked when still unreferenced (its retry republishes them)."""
        try:
            self.sweep(ids)
        except SnapstoreError:
            pass  # left as orphans for gc; the transaction's own error is the one to report

    def _committed(self, freed: Iterable[bytes], committed: Callable[[], None] | None,
                   deferred: Callable[[], None] | None) -> None:
        """After a commit: the hook, then the freed files unlinked; nothing here fails the call."""
        if committed is not None:
            committed()
        try:
            self.sweep(freed)
        except SnapstoreError:
            if deferred is not None:
                deferred()

    def sweep(self, ids: Iterable[bytes], batch: int = 1 << 30) -> int:
        """Unlink chunk files whose rows are gone, ``batch`` per write transaction; returns bytes freed.

        The one way files leave the store: the write path after its commit, gc, verify's repair, a
        save's or a fetch's rollback of files it published, all call this (a read-only repo: none)."""
        todo = list(dict.fromkeys(ids))
        done = 0
        for i in range(0, len(todo), batch):
            done += 0 if self.readonly else _unlink_gone(self.db, self.remove_blob, todo[i:i + batch])
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
        sub = self.blobs + os.sep + h[:2]  # not os.path.join: two of those were a tenth of opening a chunk
        try:
            st = os.lstat(sub)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise CorruptionError(f"{sub} is not a real directory (a symlink?); refusing to follow it")
        return sub + os.sep + h

    def remove_blob(self, cid: bytes) -> int | None:
        """Unlink chunk file ``cid`` through the real directories blobs/ and blobs/<xx> (never a link);
        its size, or None when it is not there (or not a regular file). Only :meth:`sweep` calls it."""
        if not isinstance(cid, bytes) or len(cid) != 32:
            return None
        h = cid.hex()
        return remove_in(self.root, ("blobs", h[:2]), h)

    def blob_files(self) -> Iterable[tuple[bytes, str]]:
        """Every chunk-named file under blobs/ (other names are reported by verify, never followed)."""
        for sub in _HEX2:
            for name in list_dir(self.root, "blobs", sub):  # a link in place of blobs/<xx> lists nothing
                if is_hex_id(name) and name.startswith(sub):
                    yield bytes.fromhex(name), os.path.join(self.blobs, sub, name)

    def close(self) -> None:
        """Close the catalog and the chunk files kept open."""
        try:
            self.files.close()
        finally:
            self.db.close()


class SnapshotRepo(Repo):
    """A store seen through a private in-memory copy of its catalog, taken without writing a byte.

    The copy comes from one read transaction of a read-only connection that writes nothing, not
    even SQLite's -wal/-shm (:func:`snapstore.catalog.db.readonly_source`). Chunk files are read live.
    """

    @classmethod
    def open(cls, root: str, *, readonly: bool = True, create: bool = False) -> SnapshotRepo:
        """Copy the catalog of the store at ``root`` into memory (never writing to the store)."""
        repo = super().open(root, readonly=True, create=False)
        assert isinstance(repo, SnapshotRepo)
        return repo

    def _catalog(self) -> Database:
        """A private in-memory copy of the catalog, taken without writing a byte."""
        return MemDatabase(snapshot_catalog(self.db_path), self.db_path)


def _unlink_gone(db: Database, remove: Callable[[bytes], int | None], ids: Iterable[bytes]) -> int:
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
                    freed += remove(cid) or 0  # never through a link (blobs/ or blobs/<xx> replaced by one)
                except OSError:
                    pass  # not removable now: an orphan for gc, never an error here
        return freed

    return db.write(run)
