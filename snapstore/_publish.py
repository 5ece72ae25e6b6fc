"""Crash-safe file publishing: the one helper every file write of the store goes through.

Temp file (0600, O_EXCL) in the store's ``tmp/`` → write → fsync → close → ``link()`` into
place (EEXIST means "already there": content-addressed, so identical) → unlink the temp →
fsync the target directory. ``tmp/`` and ``blobs/`` live on the same file system, so the link is
atomic. Callers batch the directory fsyncs of one save with :func:`fsync_dirs`.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from ._errors import StoreIOError

__all__ = ["TEMP_PREFIX", "ensure_dir", "fsync_dir", "fsync_dirs", "publish", "write_temp"]

TEMP_PREFIX = "w-"
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


def write_temp(tmp_dir: str, pieces: Iterable[bytes | memoryview]) -> str:
    """Write pieces to a fresh temp file in ``tmp_dir``, fsync and close it; return its path."""
    path = os.path.join(tmp_dir, TEMP_PREFIX + secrets.token_hex(12))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
    except OSError as e:
        raise io_error(f"cannot create temp file in {tmp_dir}", e) from None
    try:
        for piece in pieces:
            mv = memoryview(piece).cast("B")
            while mv:
                n = os.write(fd, mv)
                mv = mv[n:]
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        _unlink_quiet(path)
        raise io_error("cannot write a chunk file", e) from None
    os.close(fd)
    return path


def publish(tmp_path: str, dest: str) -> bool:
    """Move a durable temp file to ``dest``; False if an identical-named file was already there.

    Callers publish only chunks the catalog does not hold, so a file already at ``dest`` is an
    orphan (a crashed or concurrent writer's) whose payload nobody has vouched for: it is replaced
    by this fsynced temp either way (atomic; the content is the same when it is intact). The caller
    fsyncs ``dest``'s directory afterwards, once per batch, whatever this returns.
    """
    try:
        try:
            os.link(tmp_path, dest)
            created = True
        except FileExistsError:
            os.replace(tmp_path, dest)
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            os.replace(tmp_path, dest)  # file systems without hard links: rename is atomic too
            return True
    except OSError as e:
        _unlink_quiet(tmp_path)
        raise io_error(f"cannot publish {dest}", e) from None
    _unlink_quiet(tmp_path)
    return created


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
