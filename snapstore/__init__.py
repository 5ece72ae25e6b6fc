"""snapstore: an embedded, SQLite-indexed, content-addressed store for LLM inference-state snapshots.

Save the state an engine holds after reading a prompt prefix; restore it exactly in a later
request, process or restart that starts with the same tokens. See docs/api.md.
"""

from __future__ import annotations

from ._async_save import SaveHandle
from ._buffers import Destination, PartReader, PartSource, PartWriter
from ._config import Budget
from ._errors import (
    ConfigError,
    CorruptChunkError,
    CorruptionError,
    DestinationError,
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
from ._gc import GcReport
from ._identity import Identity
from ._layout import DTYPE_NAMES, Fixed, Layout, Rows, dtype_size
from ._meta import EngineMeta
from ._paged import PagedRows
from ._refs import SnapshotRef
from ._results import DeleteResult, Match, MatchDetails, RestoreResult, SaveResult, SnapshotInfo, Stats
from ._rowspan import RowSpan, row_span
from ._store import Store
from ._tokens import TokensLike
from ._turn import Turn
from ._uploader import FlushResult
from ._verify import VerifyReport

__version__ = "0.1.0"

__all__ = [
    "DTYPE_NAMES",
    "Budget",
    "ConfigError",
    "CorruptChunkError",
    "CorruptionError",
    "DeleteResult",
    "Destination",
    "DestinationError",
    "EngineMeta",
    "Fixed",
    "FlushResult",
    "GcReport",
    "Identity",
    "IdentityError",
    "InvalidInputError",
    "Layout",
    "LayoutError",
    "Match",
    "MatchDetails",
    "NotFoundError",
    "RemoteError",
    "PagedRows",
    "PartReader",
    "PartSource",
    "PartWriter",
    "RestoreError",
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
    "dtype_size",
    "row_span",
]
