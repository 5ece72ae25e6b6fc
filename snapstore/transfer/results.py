"""What ``Store.export`` and ``Store.import_file`` (and ``snapstore export`` / ``import``) report."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ExportResult", "ImportResult"]


@dataclass(frozen=True)
class ExportResult:
    """An export file written: the leaf it holds and what went into the file."""

    path: str
    snapshot_id: int
    n_tokens: int
    links: int  # chain links, root to leaf
    chunks: int  # chunk frames (each distinct chunk once)
    file_bytes: int
    identity_key: str
    namespace: str | None
    name: str | None
    # the identity that computed the state when it was imported here under an override: the file
    # carries that mark, and importing it requires the override again (None: this store's own state)
    imported_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ImportResult:
    """An export file imported: the leaf's id in this store, and what the import wrote.

    ``chunks_written`` / ``bytes_written``: chunk files this import added (0 when every chunk was
    already here: a second import of one file writes no chunk bytes); ``links_added``: chain
    links inserted (the others were already here, of equal tokens and content). ``imported_from``:
    the file's identity key when it was imported under ``accept_identity`` (else None).
    """

    snapshot_id: int
    n_tokens: int
    namespace: str | None
    name: str | None
    links: int
    links_added: int
    chunks: int
    chunks_written: int
    bytes_written: int
    identity_key: str
    imported_from: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
