"""Reading a catalog without writing a byte: which SQLite URI does it (:func:`readonly_source`),
the file state an immutable read relies on (:func:`file_state`), and the error of a change asked
of a store opened read-only. Used by :class:`snapstore.catalog.db.Database` and :mod:`snapstore.catalog.copy`."""

from __future__ import annotations

import errno
import os
import urllib.parse

from snapstore._errors import StateError, StoreIOError

__all__ = ["FileState", "file_state", "file_uri", "read_only_error", "readonly_source"]

# (st_dev, st_ino, st_size, st_mtime_ns, whether the -wal holds frames) of a database file
FileState = tuple[int, int, int, int, bool]


def file_state(path: str) -> FileState:
    """What changes when anyone writes the database at ``path``: its file, and frames in its -wal."""
    st = os.stat(path)
    try:
        wal = os.stat(path + "-wal").st_size > 0
    except FileNotFoundError:
        wal = False
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, wal


def file_uri(path: str) -> str:
    """An SQLite ``file:`` URI naming ``path`` byte for byte: a path that is not valid UTF-8 (a
    directory name in another encoding, kept by Python as surrogates) cannot be passed as text."""
    quoted = urllib.parse.quote(os.fsencode(path))
    # an absolute path after an empty authority ("file:///a", "file:////a" for "//a": never a host)
    return ("file://" if quoted.startswith("/") else "file:") + quoted


def readonly_source(path: str) -> tuple[str, FileState | None]:
    """How to read the catalog at ``path`` without writing a byte (no -wal, no -shm, no lock file):
    (SQLite URI, the file state it relies on, or None).

    A WAL database read-only still wants its -shm; SQLite would create it (and a -wal), which a
    read-only medium refuses. When the -wal holds no frames the database file alone is the whole
    catalog: read it as ``immutable``, valid while :func:`file_state` stays what it was (the caller
    re-checks after each read and reopens if a writer came). When the -wal holds frames and a -shm
    exists (an engine has the store open, or crashed), read through them with ``readonly_shm``.
    Frames without a -shm cannot be read without creating one: refused, saying what to do.
    """
    state = file_state(path)
    uri = file_uri(path) + "?mode=ro"
    if not state[4]:
        return uri + "&immutable=1", state
    if os.path.exists(path + "-shm"):
        return uri + "&readonly_shm=1", None
    name = os.path.basename(path)
    raise StoreIOError(errno.EROFS, f"{path}-wal holds changes not yet in {name} and there is no {name}-shm "
                                    "to read them through (a writer stopped without closing the store), so it "
                                    "cannot be read without writing: open it once read-write where it is "
                                    f"writable (`snapstore gc --dir {os.path.dirname(path)}`), then read it")


def read_only_error(root: str, what: str) -> StateError:
    """The error of a change asked of a store opened read-only."""
    return StateError(f"the store at {root} is open read-only (read_only=True), so it cannot {what}; open it "
                      "without read_only=True, where it is writable, to change it")
