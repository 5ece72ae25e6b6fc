"""The store directory's own entries: the one check every open makes, and removal only through them.

A store's ``blobs/``, ``tmp/`` and ``owners/`` must be real directories of the store and its
database files regular files, never symbolic links (invariant 13: a link would let gc or a sweep
remove files wherever it points). :func:`check_tree` refuses a store that breaks this, and
:func:`writable` says why a store cannot be written. Every removal (chunk files, temp files, owner
lock files) goes through :func:`remove_in`, relative to a directory descriptor opened component by
component with ``O_NOFOLLOW``, so a link planted after the open is not followed either.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from snapstore._errors import StoreFormatError, StoreIOError

__all__ = ["DB_FILES", "DB_NAME", "STORE_DIRS", "check_tree", "list_dir", "open_dir", "remove_in", "remove_tree_at",
           "write_refusal"]

DB_NAME = "snapstore.db"
DB_FILES = (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm")
STORE_DIRS = ("blobs", "tmp", "owners")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def check_tree(root: str) -> None:
    """Refuse a store whose ``blobs/``, ``tmp/``, ``owners/`` or database files are links or of the
    wrong kind (StoreFormatError naming the entry). Absent entries pass: an open creates them."""
    for name, want, kind in [(d, stat.S_ISDIR, "directory") for d in STORE_DIRS] + \
                            [(f, stat.S_ISREG, "regular file") for f in DB_FILES]:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StoreIOError(e.errno or errno.EIO, f"cannot examine {path}: {e.strerror}") from None
        if want(st.st_mode):
            continue
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a " + kind
        raise StoreFormatError(f"{path} is {what}; a store's {name} must be a real {kind} inside the store "
                               "(snapstore never follows a link out of its directory): put what it should "
                               "be in its place, or move the store aside")


def write_refusal(root: str) -> tuple[int, str] | None:
    """Why this process cannot write the existing store at ``root``, as (errno, cause); None when
    it can, as far as can be told before trying."""
    try:
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            return errno.EROFS, "its file system is mounted read-only"
    except OSError:
        return None  # the open reports what is wrong with the path itself
    for path in (root, os.path.join(root, DB_NAME)):
        if os.path.exists(path) and not os.access(path, os.W_OK):
            return errno.EACCES, f"this user (uid {os.geteuid()}) has no write permission on {path}"
    return None


def open_dir(root: str, *parts: str) -> int:
    """A descriptor of ``root/parts...``, each part opened relative to the one before without
    following a link (OSError ELOOP/ENOTDIR for a link). ``root`` itself may be a link: where a
    store lives is its owner's choice, what is inside it is not."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            sub = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _dir(root: str, parts: tuple[str, ...]) -> Iterator[int | None]:
    try:
        fd: int | None = open_dir(root, *parts)
    except OSError:
        fd = None  # absent, or not a real directory: nothing in it is the store's to touch
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def list_dir(root: str, *parts: str) -> list[str]:
    """The names in the real directory ``root/parts...`` ([] when it is absent or not real)."""
    with _dir(root, parts) as fd:
        return [] if fd is None else os.listdir(fd)


def remove_in(root: str, parts: tuple[str, ...], name: str,
              keep: Callable[[os.stat_result], bool] | None = None) -> int | None:
    """Unlink the regular file ``name`` from the real directory ``root/parts...``; its size, or None
    when it is absent, not a regular file, its directory is not real, or ``keep(stat)`` says so.
    Errors other than "gone" propagate as OSError."""
    with _dir(root, parts) as fd:
        if fd is None:
            return None
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode) or (keep is not None and keep(st)):
            return None
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return None
        return st.st_size


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove the directory ``name`` under ``dir_fd`` and everything in it, each entry relative to its
    parent's descriptor: a link inside is unlinked, never followed; ``name`` itself being a link
    fails (ELOOP/ENOTDIR) and removes nothing."""
    fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        with os.scandir(fd) as entries:
            for entry in list(entries):
                if entry.is_dir(follow_symlinks=False):
                    remove_tree_at(fd, entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)
