"""snapstore: an embedded, SQLite-indexed, content-addressed store for LLM inference-state snapshots.

Save the state an engine holds after reading a prompt prefix; restore it exactly in a later
request, process or restart that starts with the same tokens. See docs/api.md.
"""

from __future__ import annotations

from snapstore import _cli_start  # noqa: F401  first: Ctrl-C while the snapstore command starts (issue 46)
from snapstore._config import Budget, default_dir
from snapstore._errors import (
    ConfigError,
    CorruptChunkError,
    CorruptionError,
    DestinationError,
    ExportFileError,
    IdentityError,
    InvalidInputError,
    LayoutError,
    NotFoundError,
    RemoteError,
    RestoreError,
    SnapshotUnavailableError,
    SnapstoreError,
    SourceError,
    StateError,
    StoreFormatError,
    StoreIOError,
    UnsupportedCacheError,
)
from snapstore._identity import Identity
from snapstore._layout import DTYPE_NAMES, Fixed, Layout, Rows, dtype_size
from snapstore._refs import SnapshotRef
from snapstore._results import (
    Considered,
    DeleteResult,
    LoadResult,
    Match,
    MatchDetails,
    RecomputeDecision,
    RestoreEstimate,
    RestoreResult,
    SaveResult,
    SnapshotInfo,
    Stats,
)
from snapstore._tokens import TokensLike
from snapstore.check.verify import VerifyReport
from snapstore.lifecycle.gc import GcReport
from snapstore.parts.buffers import Destination, PartReader, PartSource, PartWriter
from snapstore.parts.meta import EngineMeta
from snapstore.parts.paged import PagedRows
from snapstore.parts.rowspan import RowSpan, row_span
from snapstore.plan.restore_or_recompute import PrefillRate
from snapstore.remote.uploader import FlushResult
from snapstore.save.asynchronous import SaveHandle
from snapstore.store.store import Store
from snapstore.store.turn import Turn
from snapstore.transfer.output_file import OutputFile
from snapstore.transfer.results import ExportResult, ImportResult

__version__ = "0.1.0"

__all__ = [
    "DTYPE_NAMES",
    "Budget",
    "ConfigError",
    "Considered",
    "CorruptChunkError",
    "CorruptionError",
    "DeleteResult",
    "Destination",
    "DestinationError",
    "EngineMeta",
    "ExportFileError",
    "ExportResult",
    "Fixed",
    "FlushResult",
    "GcReport",
    "Identity",
    "IdentityError",
    "ImportResult",
    "InvalidInputError",
    "Layout",
    "LayoutError",
    "LoadResult",
    "Match",
    "MatchDetails",
    "NotFoundError",
    "OutputFile",
    "RemoteError",
    "PagedRows",
    "PartReader",
    "PartSource",
    "PartWriter",
    "PrefillRate",
    "RecomputeDecision",
    "RestoreError",
    "RestoreEstimate",
    "RestoreResult",
    "RowSpan",
    "Rows",
    "SaveHandle",
    "SaveResult",
    "SnapshotInfo",
    "SnapshotRef",
    "SnapshotUnavailableError",
    "SnapstoreError",
    "SourceError",
    "StateError",
    "Stats",
    "Store",
    "StoreFormatError",
    "StoreIOError",
    "TokensLike",
    "UnsupportedCacheError",
    "Turn",
    "VerifyReport",
    "__version__",
    "default_dir",
    "dtype_size",
    "row_span",
]
