"""A store directory on disk: its paths, its catalog, and the safe removal of chunk files.

Shared by :class:`snapstore.Store` (an engine's view, bound to one identity) and the CLI
(maintenance across identities).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable

from ._chunkfile import is_hex_id
from ._db import Conn, Database, MemDatabase, snapshot_catalog
from ._errors import ConfigError, CorruptionError, StoreFormatError
from ._publish import ensure_dir, fsync_dir, io_error

__all__ = ["Repo", "unlink_unreferenced"]

DB_NAME = "snapstore.db"
_HEX2 = [f"{i:02x}" for i in range(256)]


class Repo:
    """Paths and catalog of one store directory."""

    def __init__(self, root: str, *, readonly: bool = False, create: bool = True):
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError(f"store path must be a path, got {root!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.blobs = os.path.join(self.root, "blobs")
        self.tmp = os.path.join(self.root, "tmp")
        self.db_path = os.path.join(self.root, DB_NAME)
        self.readonly = readonly
        if readonly or not create:
            if not os.path.isfile(self.db_path):
                raise StoreFormatError(f"{self.root} is not a snapstore store (no {DB_NAME})")
        else:
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
        self.db = Database(self.db_path, readonly=readonly)

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

    def unlink_unreferenced(self, ids: Iterable[bytes]) -> int:
        """Unlink chunk files whose rows are gone (see :func:`unlink_unreferenced`). Returns bytes freed."""
        return 0 if self.readonly else unlink_unreferenced(self.db, self.blob_path, ids)

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

    def __init__(self, root: str) -> None:  # no super().__init__(): it would open the catalog on disk
        self.root = os.path.abspath(os.fspath(root))
        self.blobs = os.path.join(self.root, "blobs")
        self.tmp = os.path.join(self.root, "tmp")
        self.db_path = os.path.join(self.root, DB_NAME)
        self.readonly = True
        if not os.path.isfile(self.db_path):
            raise StoreFormatError(f"{self.root} is not a snapstore store (no {DB_NAME})")
        self.db = MemDatabase(snapshot_catalog(self.db_path), self.db_path)


def unlink_unreferenced(db: Database, blob_path: Callable[[bytes], str], ids: Iterable[bytes]) -> int:
    """Unlink chunk files whose rows are gone, inside a write transaction (so no concurrent save
    can commit a reference to a file between the check and the unlink). Returns bytes freed."""
    todo = list(dict.fromkeys(ids))
    if not todo:
        return 0

    def run(c: Conn) -> int:
        freed = 0
        for cid in todo:
            if Database.chunk(c, cid) is None:
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
