"""The catalog's row types: snapshot states and part kinds, one frozen dataclass per table row,
and the column lists and converters the queries build them with."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import apsw

from ._errors import CorruptionError

__all__ = ["CHUNK_COLS", "N_SNAP", "SNAP_COLS", "ChunkRow", "OwnerRow", "PartKind", "PartRow", "SnapRow", "SnapState",
           "part_row", "scalar", "snap_row"]


class SnapState(enum.IntEnum):
    """``snapshots.state``: a pending capture (invisible to match) or a committed snapshot."""

    PENDING = 0
    COMMITTED = 1


class PartKind(enum.IntEnum):
    """``parts.kind``: a fixed part stored whole, or a row-stream segment."""

    FIXED = 0
    ROWS = 1


CHUNK_COLS = "id, raw_len, stored_len, codec, checksum, refs, created, scope, quarantined"
SNAP_COLS = ("id, identity_id, namespace, parent_id, depth, n_tokens, base_tokens, token_width, tokens, "
              "anchor, prefix_key, content_key, session, state, owner, matchable, created, last_used, "
              "hits, logical_bytes, shared")
N_SNAP = len(SNAP_COLS.split(","))  # columns of a snapshot row (a query may select more after them)


@dataclass(frozen=True)
class SnapRow:
    """One row of ``snapshots``."""

    id: int
    identity_id: int
    namespace: str
    parent_id: int | None
    depth: int
    n_tokens: int
    base_tokens: int
    token_width: int
    tokens: bytes
    anchor: bytes
    prefix_key: bytes
    content_key: bytes
    session: str | None
    state: int
    owner: str | None
    matchable: int
    created: float
    last_used: float
    hits: int
    logical_bytes: int
    shared: int = 0  # used outside its session (schema v4): supersede detaches it instead (_lifecycle)


@dataclass(frozen=True)
class PartRow:
    """One row of ``parts``: a fixed part whole, or a row-stream segment."""

    snapshot_id: int
    name: str
    kind: int
    dtype: str
    shape: tuple[int, ...]
    component: str | None
    row_start: int
    row_end: int
    nbytes: int
    # a row segment's tokens per row as saved (schema v7; 1: one per token); None: a fixed part, or a
    # segment saved before v7 (not recorded). The restore's part check compares it (_prefix_match).
    tokens_per_row: int | None = None


@dataclass(frozen=True)
class ChunkRow:
    """One row of ``chunks``."""

    id: bytes
    raw_len: int
    stored_len: int
    codec: int
    checksum: bytes
    refs: int
    created: float
    scope: bytes
    quarantined: float | None = None  # when a restore found the file damaged; None: healthy


@dataclass(frozen=True)
class OwnerRow:
    """One row of ``owners``: an open Store that may own pending captures, and its lease."""

    id: str
    kernel: str
    host: str
    pid: int
    lease: float
    renewed: float
    created: float


def scalar(c: apsw.Connection, sql: str, args: tuple[Any, ...] = ()) -> int:
    """The integer a one-row, one-column aggregate query returns."""
    row = c.execute(sql, args).fetchone()
    assert row is not None
    return int(row[0])


def snap_row(row: Sequence[Any]) -> SnapRow:
    return SnapRow(*row)


def part_row(row: Sequence[Any]) -> PartRow:
    sid, name, kind, dtype, shape, comp, rs, re_, nb, per = row
    try:
        dims = json.loads(shape)
        if not isinstance(dims, list) or not all(isinstance(d, int) and d >= 0 for d in dims):
            raise ValueError(shape)
    except ValueError:
        raise CorruptionError(f"snapshot {sid} part {name!r} has a malformed shape {shape!r}") from None
    return PartRow(sid, name, kind, dtype, tuple(dims), comp, rs, re_, nb, per)
