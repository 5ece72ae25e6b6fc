"""Where an output file may go (invariant 15: nothing a command does destroys a store): the one check
and the one publish step of every file the library writes at a caller's path — an export file
(``Store.export``, ``snapstore export``; issue 46 item 10).

An output is never written inside a store directory (any directory holding a store's catalog, or
below one: ``blobs/``, ``tmp/``, ``owners/``), never carries a store's own file name, and never
replaces an existing file unless the caller asked for it (``overwrite=True``, ``--force``); it is
written to a temporary file beside the destination and published by one rename (or, without
``overwrite``, one hard link, which refuses a file that appeared meanwhile).
"""

from __future__ import annotations

import errno
import os
import stat

from snapstore._errors import ConfigError, StoreIOError
from snapstore.chunks.publish import fsync_dir
from snapstore.chunks.repo import DB_NAME

__all__ = ["check_destination", "path_arg", "publish_output", "store_holding"]

# a store's own entries (docs/format.md §1): no output takes one of these names, wherever it goes
_STORE_NAMES = frozenset({DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", DB_NAME + "-journal"})


def store_holding(folder: str) -> str | None:
    """The store directory ``folder`` is (or lies inside), or None: the nearest directory at or
    above it, links resolved, that holds a store's catalog (``snapstore.db``)."""
    here = os.path.realpath(folder)
    while True:
        if os.path.isfile(os.path.join(here, DB_NAME)):
            return here
        up = os.path.dirname(here)
        if up == here:
            return None
        here = up


def path_arg(path: object, what: str) -> str:
    """A caller's file path as a str: a str or an ``os.PathLike`` of str, as ``Store.open``'s path;
    anything else (None, an int, bytes) is a :class:`ConfigError` naming ``what``, not a TypeError."""
    p = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(p, str):
        raise ConfigError(f"{what} path must be a str (or os.PathLike of str), got {path!r:.80}")
    return p


_ASK = "pass overwrite=True (`snapstore export --force`) to replace it"


def check_destination(path: str | os.PathLike[str], *, overwrite: bool, store_root: str | None = None,
                      what: str = "the export file") -> str:
    """``path`` as a string, once it is a place an output may go; else a :class:`ConfigError` saying why.

    ``store_root``: the store being read (refused even if its catalog is momentarily absent).
    """
    dest = path_arg(path, what)
    if not dest or dest.endswith(os.sep):
        raise ConfigError(f"{what} path {dest!r} names no file")
    folder = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write {what} {dest}: the directory {folder} does not exist")
    inside = store_holding(folder)
    if inside is None and store_root is not None:
        root = os.path.realpath(store_root)
        real = os.path.realpath(folder)
        if os.path.commonpath([root, real]) == root:
            inside = root
    if inside is not None:
        raise ConfigError(f"refusing to write {what} {dest}: it is inside the snapstore store {inside}, whose files "
                          "only the store writes; write it outside any store directory")
    if os.path.basename(dest) in _STORE_NAMES:
        raise ConfigError(f"refusing to write {what} {dest}: {os.path.basename(dest)} is a store's own file name")
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return dest
    except OSError as err:
        raise StoreIOError(err.errno or errno.EIO, f"cannot examine {dest}: {err.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"cannot write {what} {dest}: it is a directory; name a file")
    if not overwrite:
        raise ConfigError(f"refusing to write {what} {dest}: a file is there already; {_ASK}")
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"cannot replace {dest}: it is not a regular file")
    return dest


def publish_output(tmp: str, dest: str, *, overwrite: bool) -> None:
    """Put the finished temporary file ``tmp`` (beside ``dest``) in place in one step, then make the
    directory entry durable. Without ``overwrite`` a file that appeared at ``dest`` since the check
    is kept and ``tmp`` removed (:class:`ConfigError`). ``tmp`` is removed on any failure."""
    folder = os.path.dirname(os.path.abspath(dest))
    try:
        if overwrite:
            os.replace(tmp, dest)
        else:
            try:
                os.link(tmp, dest)  # fails with EEXIST rather than replace anything
            except FileExistsError:
                raise ConfigError(f"refusing to write {dest}: a file appeared there while it was written; "
                                  f"{_ASK}") from None
            except OSError as err:
                if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
                    raise
                if os.path.lexists(dest):  # no hard links here: check, then rename (a narrow window)
                    raise ConfigError(f"refusing to write {dest}: a file appeared there while it was written; "
                                      f"{_ASK}") from None
                os.rename(tmp, dest)
            _unlink(tmp)
        fsync_dir(folder)
    except OSError as err:
        _unlink(tmp)
        raise StoreIOError(err.errno or errno.EIO, f"cannot write {dest}: {err.strerror}") from None
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
