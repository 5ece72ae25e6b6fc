"""Crash-safe file publishing: the one helper every file write of the store goes through.

Temp file (0600, O_EXCL) in the store's ``tmp/`` → write → fsync → close → ``link()`` into
place → unlink the temp → fsync the target directory. ``tmp/`` and ``blobs/`` live on the same
file system, so the link is atomic. When the name is taken, the file there is replaced (rename)
only if the catalog says no live row vouches for it, decided under the write lock by the caller
(see ``chunks.settle.settle``). Callers batch the directory fsyncs of one save with :func:`fsync_dirs`.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from snapstore._errors import StoreIOError

__all__ = ["TEMP_PREFIX", "create_temp", "discard", "ensure_dir", "finish_temp", "fsync_dir", "fsync_dirs",
           "link_new", "replace_into", "write_all", "write_temp"]

TEMP_PREFIX = "w-"
SCRATCH_PREFIX = TEMP_PREFIX + "bench-"  # a scratch store directory in tmp/ (`snapstore bench`); gc removes it
_FILE_MODE = 0o600
_DIR_MODE = 0o700


def io_error(what: str, e: OSError) -> StoreIOError:
    """Wrap an OSError in a StoreIOError whose message says what failed and what to do."""
    hint = ""
    if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
        hint = " (the file system is full: free space or lower the disk budget)"
    elif e.errno == errno.EACCES or e.errno == errno.EPERM:
        hint = " (permission denied: the store directory must be owned by this user)"
    err = StoreIOError(e.errno or 0, f"{what}: {e.strerror or e}{hint}")
    err.filename = e.filename
    return err


def ensure_dir(path: str) -> None:
    """Create a directory (0700) if missing; refuse a symlink in its place."""
    try:
        os.mkdir(path, _DIR_MODE)
    except FileExistsError:
        if os.path.islink(path) or not os.path.isdir(path):
            raise StoreIOError(errno.ENOTDIR, f"{path} exists and is not a real directory") from None
    except OSError as e:
        raise io_error(f"cannot create directory {path}", e) from None


def fsync_dir(path: str) -> None:
    """fsync a directory so the names created in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs(paths: Iterable[str], pool: ThreadPoolExecutor | None = None) -> None:
    """fsync several directories; in parallel when a pool is given (journal commits coalesce)."""
    unique = sorted(set(paths))
    try:
        if pool is not None and len(unique) > 1:
            list(pool.map(fsync_dir, unique))
        else:
            for p in unique:
                fsync_dir(p)
    except OSError as e:
        raise io_error("cannot fsync a store directory", e) from None


def create_temp(tmp_dir: str, extra_flags: int = 0) -> tuple[int, str]:
    """Create a fresh temp file (0600, O_EXCL) in ``tmp_dir``; return (descriptor, path).

    ``extra_flags``: e.g. O_DIRECT (an EINVAL from a file system that refuses it keeps its errno).
    """
    path = os.path.join(tmp_dir, TEMP_PREFIX + secrets.token_hex(12))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | extra_flags,
                     _FILE_MODE)
    except OSError as e:
        raise io_error(f"cannot create temp file in {tmp_dir}", e) from None
    return fd, path


def write_all(fd: int, piece: bytes | memoryview) -> None:
    """write(2) until every byte of ``piece`` is written (OSError as raised)."""
    mv = memoryview(piece).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def finish_temp(fd: int, path: str, fill: Callable[[int], bool]) -> str | None:
    """Run ``fill(fd)`` on a temp file from :func:`create_temp`, then fsync and close it and return
    its path; when ``fill`` returns False the file is not wanted: closed and removed, no fsync, None.

    Any error removes the temp file; an OSError becomes a StoreIOError that says what failed.
    """
    try:
        keep = fill(fd)
        if keep:
            os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        _unlink_quiet(path)
        if isinstance(e, OSError):
            raise io_error("cannot write a chunk file", e) from None
        raise
    os.close(fd)
    if not keep:
        _unlink_quiet(path)
        return None
    return path


def write_temp(tmp_dir: str, pieces: Iterable[bytes | memoryview]) -> str:
    """Write pieces to a fresh temp file in ``tmp_dir``, fsync and close it; return its path."""
    fd, path = create_temp(tmp_dir)

    def fill(fd: int) -> bool:
        for piece in pieces:
            write_all(fd, piece)
        return True

    done = finish_temp(fd, path, fill)
    assert done is not None
    return done


def link_new(tmp_path: str, dest: str) -> bool:
    """Give a durable temp file the name ``dest`` if nothing has that name yet.

    True: linked, the temp removed. False: ``dest`` exists (or the file system has no hard links)
    and the temp is kept: whether the file there may be replaced is the catalog's call, under
    the write lock (a committed row may reference it), so the caller decides and finishes with
    :func:`replace_into` or :func:`discard`. The caller fsyncs ``dest``'s directory afterwards.
    """
    try:
        os.link(tmp_path, dest)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            return False  # no hard links here: rename (atomic, but replacing) under the caller's lock
        _unlink_quiet(tmp_path)
        raise io_error(f"cannot publish {dest}", e) from None
    _unlink_quiet(tmp_path)
    return True


def replace_into(tmp_path: str, dest: str) -> None:
    """Atomically move a durable temp file over ``dest`` (whatever is there); fsync dest's directory."""
    try:
        os.replace(tmp_path, dest)
        fsync_dir(os.path.dirname(dest))
    except OSError as e:
        _unlink_quiet(tmp_path)
        raise io_error(f"cannot publish {dest}", e) from None


def discard(path: str) -> None:
    """Remove a temp file that is no longer needed (errors ignored: gc collects leftovers)."""
    _unlink_quiet(path)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
