"""The one error hierarchy of snapstore.

Every error the library raises is a :class:`SnapstoreError`; where a builtin fits, the class
also subclasses it so generic handlers keep working::

    SnapstoreError
    ├── ConfigError(ValueError)            bad option, environment variable or path
    ├── InvalidInputError(ValueError)      bad tokens, parts, rows or arguments
    │   └── LayoutError                    part names, dtypes or shapes disagree with the layout
    │       └── UnsupportedCacheError(NotImplementedError)  a runtime cache type no integration handles
    ├── IdentityError(ValueError)          a snapshot id or store of another identity/namespace
    ├── NotFoundError(KeyError)            no such snapshot (evicted, abandoned, never saved)
    ├── StateError(RuntimeError)           commit/abandon of a save in the wrong state; a closed store
    ├── StoreFormatError                   not a snapstore store, a newer format, an old SQLite
    ├── StoreIOError(OSError)              the file system failed (disk full, EIO, permissions)
    ├── CorruptionError                    stored bytes fail their checksum or do not parse
    │   └── ExportFileError                an export file is truncated, altered or not one; nothing imported
    ├── RemoteError(OSError)               the shared tier (object storage) failed or is misconfigured
    ├── SourceError                        a save's source (device, reader) failed; nothing was saved
    └── RestoreError                       a restore failed; .touched says if the destination was written
        ├── DestinationError(LayoutError)  the destination does not fit the snapshot
        ├── SnapshotUnavailableError       the snapshot or part of its chain is gone
        └── CorruptChunkError(CorruptionError)  a chunk failed its checksum while streaming
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CorruptChunkError",
    "CorruptionError",
    "DestinationError",
    "ExportFileError",
    "IdentityError",
    "InvalidInputError",
    "LayoutError",
    "NotFoundError",
    "RemoteError",
    "RestoreError",
    "SnapshotUnavailableError",
    "SnapstoreError",
    "SourceError",
    "StateError",
    "StoreFormatError",
    "StoreIOError",
    "UnsupportedCacheError",
]


class SnapstoreError(Exception):
    """Base class of every error snapstore raises."""


class ConfigError(SnapstoreError, ValueError):
    """An option, environment variable or store path is invalid."""


class InvalidInputError(SnapstoreError, ValueError):
    """Arguments to save/match/restore are malformed (tokens, rows, parent, parts)."""


class LayoutError(InvalidInputError):
    """Parts do not agree with the layout: unknown or missing names, dtype, shape or size."""


class UnsupportedCacheError(LayoutError, NotImplementedError):
    """A model runtime's cache (a transformers layer type, a speculative mode) no integration handles."""


class IdentityError(SnapstoreError, ValueError):
    """A snapshot belongs to another identity or namespace than the one asked for."""


class NotFoundError(SnapstoreError, KeyError):
    """No such snapshot: never saved, evicted, superseded or abandoned."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class StateError(SnapstoreError, RuntimeError):
    """commit()/abandon() called on a save that is not pending (or a closed store used)."""


class StoreFormatError(SnapstoreError):
    """The directory is not a snapstore store, was written by a newer version, or SQLite is too old."""


class StoreIOError(SnapstoreError, OSError):
    """The file system refused an operation (disk full, I/O error, permissions)."""


class CorruptionError(SnapstoreError):
    """Stored bytes fail their checksum or do not parse as the format says."""


class ExportFileError(CorruptionError):
    """An export file (``Store.export``) is truncated, altered or not one; the message names the section.

    Raised by ``Store.import_file`` before anything is imported: the catalog is unchanged and the
    chunk files the import wrote are removed again (or left as orphans for gc).
    """


class RestoreError(SnapstoreError):
    """A restore failed. ``touched`` is True when the destination was already partly written.

    With ``touched`` False the destination holds exactly what it held before the call; with
    ``touched`` True its contents are undefined and the engine must re-read the prompt.
    """

    def __init__(self, message: str, *, touched: bool = False, snapshot_id: int | None = None):
        super().__init__(message)
        self.touched = touched
        self.snapshot_id = snapshot_id


class DestinationError(RestoreError, LayoutError):
    """The destination buffers do not fit the snapshot (missing part, dtype, shape, size, read-only)."""


class SnapshotUnavailableError(RestoreError):
    """The snapshot or part of its chain is gone or incomplete (evicted, missing chunk file)."""


class CorruptChunkError(RestoreError, CorruptionError):
    """A chunk failed its checksum or could not be decoded while streaming."""


class RemoteError(SnapstoreError, OSError):
    """The shared tier (S3-compatible object storage) failed or is misconfigured; the local tier is intact."""


class SourceError(SnapstoreError):
    """A save's source failed while its bytes were read (a device error, the engine's reader raised).

    Nothing was saved: no snapshot was created and the chunk files this save had published are
    removed again; the store is as before the call. The cause is chained (``__cause__``).
    """
