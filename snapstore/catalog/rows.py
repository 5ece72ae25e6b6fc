"""The catalog's row types: snapshot states and part kinds, one frozen dataclass per table row,
and the column lists and converters the queries build them with."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import apsw

from snapstore._errors import StoreFormatError

__all__ = ["CHUNK_COLS", "MAX_DIMS", "N_SNAP", "SNAP_COLS", "ChunkRow", "OwnerRow", "PartKind", "PartRow", "SnapRow",
           "SnapState", "chunk_row", "identity_fields", "json_field", "part_row", "scalar", "snap_row"]

# Bounds of the catalog's JSON columns, checked before a byte is parsed: a shape has at most
# MAX_DIMS dimensions (numpy's own limit), an identity's canonical JSON at most 64 KiB.
MAX_DIMS = 64
_MAX_SHAPE_TEXT = MAX_DIMS * 21 + 2  # 64 dims of up to 20 digits, commas and brackets
_MAX_IDENTITY_TEXT = 64 * 1024
_MAX_NESTING = 8  # a shape is one flat list, an identity an object holding one flat object


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
              "hits, logical_bytes, shared, layout_key, imported_from")
N_SNAP = len(SNAP_COLS.split(","))  # columns of a snapshot row (a query may select more after them)

R = TypeVar("R")


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
    shared: int = 0  # used outside its session (schema v4): supersede detaches it instead (lifecycle.rules)
    layout_key: bytes | None = None  # its parts' specs (schema v9, _layout_fit); None: saved before v9
    # schema v11: the identity key whose state an import under an override brought in (or that a
    # parent's import did); None: this identity's own state. Never matched (transfer.policy).
    imported_from: str | None = None


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
    # segment saved before v7 (not recorded). The restore's part check compares it (plan.prefix).
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


def _row_builder(cls: type[R]) -> Callable[[Sequence[Any]], R]:
    """A builder of ``cls`` (a frozen dataclass) from one value per field, in field order. It fills
    the instance's ``__dict__`` at once: the generated ``__init__`` sets each field through
    ``object.__setattr__``, which made building a 12-link chain's rows a tenth of a small restore's
    plan (issue 31). The instance is the same: frozen, equal, ``dataclasses.replace`` works."""
    names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    new = object.__new__

    def build(values: Sequence[Any]) -> R:
        obj = new(cls)
        obj.__dict__.update(zip(names, values, strict=True))
        return obj

    return build


_snap = _row_builder(SnapRow)
_chunk = _row_builder(ChunkRow)
_part = _row_builder(PartRow)


def snap_row(row: Sequence[Any]) -> SnapRow:
    """A ``snapshots`` row (``SNAP_COLS``, in order) as a :class:`SnapRow`."""
    return _snap(row)


def chunk_row(row: Sequence[Any]) -> ChunkRow:
    """A ``chunks`` row (``CHUNK_COLS``, in order; the id as apsw returns a blob) as a :class:`ChunkRow`."""
    return _chunk((bytes(row[0]), *row[1:]))


def _nesting(text: str) -> int:
    """How deep ``text``'s brackets nest (an upper bound: brackets inside strings count too)."""
    depth = top = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            top = max(top, depth)
        elif ch in "]}":
            depth -= 1
    return top


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_field(text: Any, where: str, limit: int) -> Any:
    """The one decode of a catalog JSON column: a string of at most ``limit`` characters, nested at
    most ``_MAX_NESTING`` deep, parsed as pure data (no NaN/Infinity). Anything else is damage: a
    StoreFormatError naming ``where`` (the table, row and column), never a RecursionError."""
    if not isinstance(text, str) or len(text) > limit:
        size = f"{len(text)} characters" if isinstance(text, str) else f"a {type(text).__name__}"
        raise StoreFormatError(f"{where} is damaged: {size}, at most {limit} characters of JSON expected; "
                               "run `snapstore verify` (--repair removes the snapshots it breaks)")
    if text.count("[") + text.count("{") > _MAX_NESTING and _nesting(text) > _MAX_NESTING:
        raise StoreFormatError(f"{where} is damaged: JSON nested deeper than {_MAX_NESTING} levels; "
                               "run `snapstore verify` (--repair removes the snapshots it breaks)")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise StoreFormatError(f"{where} is damaged: not JSON ({e}); run `snapstore verify` "
                               "(--repair removes the snapshots it breaks)") from None


# Decoded shapes by their text: a store holds a handful of distinct shapes, and decoding one per
# part row per restore was a tenth of a small restore's plan (issue 31). Only valid texts are kept.
_SHAPES: dict[str, tuple[int, ...]] = {}
_SHAPES_MAX = 1024


def _shape(text: Any, where: str) -> tuple[int, ...]:
    if isinstance(text, str):
        known = _SHAPES.get(text)
        if known is not None:
            return known
    dims = json_field(text, where, _MAX_SHAPE_TEXT)
    if not isinstance(dims, list) or len(dims) > MAX_DIMS or not all(
            type(d) is int and 0 <= d < 2**63 for d in dims):
        raise StoreFormatError(f"{where} is damaged: {str(text)[:80]!r} is not a list of at most {MAX_DIMS} "
                               "non-negative ints; run `snapstore verify` (--repair removes the snapshots it breaks)")
    if len(_SHAPES) >= _SHAPES_MAX:
        _SHAPES.clear()
    _SHAPES[text] = shape = tuple(dims)
    return shape


def identity_fields(canonical: Any, where: str) -> dict[str, Any]:
    """An identity row's canonical JSON decoded (bounded, pure data): a JSON object, else StoreFormatError."""
    fields = json_field(canonical, where, _MAX_IDENTITY_TEXT)
    if not isinstance(fields, dict):
        raise StoreFormatError(f"{where} is damaged: not a JSON object; run `snapstore verify`")
    return fields


def part_row(row: Sequence[Any]) -> PartRow:
    sid, name, kind, dtype, shape, comp, rs, re_, nb, per = row
    dims = _shape(shape, f"catalog row parts(snapshot {sid}, part {name!r}) column shape")
    return _part((sid, name, kind, dtype, dims, comp, rs, re_, nb, per))
