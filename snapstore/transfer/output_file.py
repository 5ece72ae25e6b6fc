"""``OutputFile``: a file written at a caller's path by the one rule every output of the library follows.

Invariant 15 (nothing a command does destroys a store): the destination is checked when the file is
made (:func:`~snapstore.transfer.destination.check_destination`: never inside a store directory,
never a store's own file name, an existing file replaced only with ``overwrite``), the bytes go to a
temporary file beside it, fsynced, and the finished file is put in place in one step
(:func:`~snapstore.transfer.destination.publish_output`). For what an integration writes in its
engine's own format (a llama-server slot file, an mlx_lm prompt cache); ``Store.export`` keeps the
same rule through the same two functions.
"""

from __future__ import annotations

import errno
import os
import secrets
from types import TracebackType

from snapstore._errors import StateError, StoreIOError
from snapstore.chunks.publish import write_all
from snapstore.transfer.destination import check_destination, publish_output

__all__ = ["OutputFile"]


class OutputFile:
    """A file to write at ``path``, put in place whole or not at all.

    Made, it checks ``path`` (ConfigError saying why it may not be written; nothing is created).
    Used as a context manager, it publishes on a clean exit and discards on an exception, so
    ``path`` holds what was there before or the whole new file. ``write(data)`` appends bytes to the
    temporary file; a writer that takes a file name writes ``tmp_path`` instead (its name ends
    with ``suffix``). ``store_root``: the store being read, refused as a destination even while its
    catalog is momentarily absent; ``what`` names the file in messages.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False,
                 store_root: str | os.PathLike[str] | None = None, what: str = "the output file",
                 suffix: str = "") -> None:
        root = None if store_root is None else os.fspath(store_root)
        self.path = check_destination(path, overwrite=overwrite, store_root=root, what=what)
        self.overwrite = overwrite
        self.what = what
        folder, base = os.path.split(os.path.abspath(self.path))
        self.tmp_path = os.path.join(folder, _temporary_name(base, suffix))
        self._fd: int | None = None
        self._done = False

    def __repr__(self) -> str:
        return f"OutputFile({self.path!r}, overwrite={self.overwrite})"

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` to the temporary file (made on the first write: new, not through a link, mode 0600)."""
        if self._done:
            raise StateError(f"{self.path} is already published or discarded; nothing more can be written to it")
        try:
            if self._fd is None:
                self._fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   0o600)
            write_all(self._fd, memoryview(data))
        except OSError as err:
            raise self._failed(err) from None

    def publish(self) -> None:
        """Make the temporary file durable (fsync, mode 0600) and put it at ``path`` in one step."""
        if self._done:
            raise StateError(f"{self.path} is already published or discarded")
        fd, self._fd = self._fd, None
        try:
            if fd is None:  # written by a writer given tmp_path
                fd = os.open(self.tmp_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(fd, 0o600)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            if err.errno == errno.ENOENT:
                self.discard()
                raise StateError(f"nothing was written for {self.path}; it is left as it was") from None
            raise self._failed(err) from None
        except BaseException:  # an interrupt during a long fsync: the temporary file goes too
            self.discard()
            raise
        self._done = True
        publish_output(self.tmp_path, self.path, overwrite=self.overwrite)  # removes the temp file on failure

    def _failed(self, err: OSError) -> StoreIOError:
        """The temporary file dropped, and the error saying what could not be written."""
        self.discard()
        return StoreIOError(err.errno or errno.EIO, f"cannot write {self.what} {self.path}: {err.strerror}")

    def discard(self) -> None:
        """Drop the temporary file; ``path`` stays as it was. Idempotent."""
        self._done = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.tmp_path)
        except OSError:
            pass

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.discard()
        elif not self._done:
            self.publish()


_NAME_MAX = 255  # bytes in one file name (Linux, macOS)


def _temporary_name(base: str, suffix: str) -> str:
    """The temporary file's name beside ``base``: ``.BASE.RANDOM.part`` + ``suffix``, ``BASE`` cut to keep
    it one valid file name (a long but valid ``base`` made it ENAMETOOLONG)."""
    tail = f".{secrets.token_hex(6)}.part{suffix}"
    room = max(_NAME_MAX - 1 - len(os.fsencode(tail)), 0)
    while len(os.fsencode(base)) > room:  # whole characters: a writer given the name may encode it strictly
        base = base[:-1]
    return "." + base + tail
