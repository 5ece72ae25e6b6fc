"""The export file: one chain of snapshots as a portable, self-describing, checksummed file.

Byte layout (docs/format.md, "Export files", is the specification; every integer little-endian)::

    preamble   64 bytes   "SNAPEXP\\0", u16 version, u16 flags (bit 0: the state is marked imported under
                          an identity override), u32 reserved (0), u64 header length H,
                          BLAKE3-256 of the header, the first 8 bytes of BLAKE3-256 of bytes 0..56
    header     H bytes    canonical JSON (UTF-8): identity, namespace, name, the override mark, layout, the
                          chain, the chunk table
    frames     one per chunk-table entry, in table order:
                          "SNAPFRM\\0", u64 index, the chunk file's bytes (stored_len of them),
                          BLAKE3-256 of the frame's head and chunk bytes
    trailer    48 bytes   "SNAPEND\\0", u64 frame count, BLAKE3-256 of every byte before the trailer

A chunk frame carries a chunk file exactly as a store keeps it (the 64-byte chunk header, then
the payload, raw or compressed: docs/format.md "Chunk files"), so its XXH3-128 of the raw bytes
is checked too. Parsing is pure data: ``json.loads`` and every field type- and range-checked; a
reader holds the header and one piece of a frame at a time (bounded memory at any chain size).
Every failure is an :class:`ExportFileError` that names the section and what is wrong. Reading a file
in order, checking as it goes, is :mod:`snapstore.transfer.reader`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from snapstore._errors import ExportFileError, InvalidInputError, LayoutError
from snapstore._identity import Identity, canonical_json
from snapstore._layout import Fixed, Layout, Rows
from snapstore._refs import name_problem, namespace_problem
from snapstore._tokens import as_token_array
from snapstore.chunks.chunkfile import CODEC_NAMES, HEADER_SIZE

__all__ = ["FLAG_MARKED", "FORMAT", "FRAME_HEAD", "FRAME_TAIL", "PREAMBLE", "TRAILER", "VERSION", "ChainLink",
           "ChunkEntry", "ExportHeader", "LinkPart", "Preamble", "Trailer", "decode_header",
           "encode_header", "frame_head", "pack_preamble", "pack_trailer"]

FORMAT = "snapstore-export"
VERSION = 1  # a reader refuses any other major version (docs/format.md "Versioning")
MAGIC, FRAME_MAGIC, END_MAGIC = b"SNAPEXP\x00", b"SNAPFRM\x00", b"SNAPEND\x00"
PREAMBLE, FRAME_HEAD, FRAME_TAIL, TRAILER = 64, 16, 32, 48
MAX_HEADER = 256 << 20  # a header longer than this is refused unread
MAX_CHUNK = 1 << 30  # no store writes a larger chunk (chunk_bytes <= 1 GiB): a compressed one is decoded whole
PIECE = 4 << 20  # bytes read or written at once
_PRE = struct.Struct("<8sHHIQ32s")  # magic, version, flags, reserved, header length, header BLAKE3
_FRAME = struct.Struct("<8sQ")
_END = struct.Struct("<8sQ32s")
_NAME = re.compile(r"^[^\x00-\x1f]{1,256}$")  # a layout part's name
FLAG_MARKED = 1  # preamble flag: the header's "imported_from" names the identity that computed the state
_KEY = re.compile(r"^id-[0-9a-f]{32}$")  # an identity key (Identity.key)


# -- the fixed-size sections ---------------------------------------------------------------------
@dataclass(frozen=True)
class Preamble:
    version: int
    header_len: int
    header_digest: bytes
    flags: int = 0


def pack_preamble(header: bytes, flags: int = 0) -> bytes:
    """The 64-byte preamble of a file whose header is ``header`` (``flags``: :data:`FLAG_MARKED` or 0)."""
    head = _PRE.pack(MAGIC, VERSION, flags, 0, len(header), blake3.blake3(header).digest())
    return head + blake3.blake3(head).digest()[:8]


def parse_preamble(data: bytes) -> Preamble:
    if len(data) < PREAMBLE:
        raise ExportFileError(f"truncated: the preamble has {len(data)} of {PREAMBLE} bytes")
    magic, version, flags, reserved, hlen, digest = _PRE.unpack(data[:56])
    if magic != MAGIC:
        raise ExportFileError("not a snapstore export file (the preamble's magic is wrong)")
    if blake3.blake3(data[:56]).digest()[:8] != data[56:64]:
        raise ExportFileError("the preamble is altered (its checksum does not match)")
    if version != VERSION:
        raise ExportFileError(f"export format version {version} is not supported (this snapstore reads "
                              f"version {VERSION}); export it again with a matching snapstore")
    if flags & ~FLAG_MARKED or reserved:
        raise ExportFileError(f"the preamble has unknown flags {flags} / reserved {reserved} (a newer writer?)")
    if hlen > MAX_HEADER:
        raise ExportFileError(f"the header claims {hlen} bytes, over the {MAX_HEADER}-byte limit")
    return Preamble(version, hlen, digest, flags)


def frame_head(index: int) -> bytes:
    return _FRAME.pack(FRAME_MAGIC, index)


@dataclass(frozen=True)
class Trailer:
    frames: int
    digest: bytes


def pack_trailer(frames: int, digest: bytes) -> bytes:
    return _END.pack(END_MAGIC, frames, digest)


# -- the header ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkEntry:
    """One chunk-table entry: the chunk file a frame carries, and the part spec that scopes its address."""

    raw_len: int
    stored_len: int
    codec: int
    checksum: bytes  # XXH3-128 of the raw bytes (big-endian digest), as in the chunk header
    id: bytes  # its address in the exporting store (a hint: an importer computes its own)
    part: str  # the part (of the layout) whose dtype and shape scope the address


@dataclass(frozen=True)
class LinkPart:
    name: str
    row_start: int
    row_end: int
    nbytes: int
    tokens_per_row: int | None
    chunks: tuple[int, ...]  # indexes into the chunk table


@dataclass(frozen=True)
class ChainLink:
    n_tokens: int
    base_tokens: int
    token_width: int
    tokens: bytes  # tokens [base_tokens, n_tokens), little-endian of token_width bytes each
    logical_bytes: int
    parts: tuple[LinkPart, ...]
    matchable: bool = True  # False: a superseded chain link (its fixed parts dropped), kept for its children


@dataclass(frozen=True)
class ExportHeader:
    identity: Identity
    namespace: str
    name: str | None
    layout: Layout
    chain: tuple[ChainLink, ...]  # root first
    chunks: tuple[ChunkEntry, ...]
    snapshot_id: int  # the leaf's id in the exporting store (informational)
    writer: str
    created: float
    # the key of the identity that computed this state when the exporting store held it as an import
    # under an identity override (snapshots.imported_from): the mark travels with the state, and an
    # importer requires the override again (docs/format.md §14); None: the header's identity computed it
    imported_from: str | None = None

    @property
    def n_tokens(self) -> int:
        return self.chain[-1].n_tokens

    def spec(self, part: str) -> Fixed | Rows:
        return self.layout.parts[part]


def _layout_doc(layout: Layout) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, spec in sorted(layout.parts.items()):
        fixed = isinstance(spec, Fixed)
        out.append({"name": name, "kind": "fixed" if fixed else "rows", "dtype": spec.dtype,
                    "shape": list(spec.shape if isinstance(spec, Fixed) else spec.row_shape),
                    "component": spec.component})
    return out


def encode_header(h: ExportHeader) -> bytes:
    """The header's bytes: canonical JSON (sorted keys, no whitespace, ASCII)."""
    doc = {
        "format": FORMAT, "v": VERSION, "writer": h.writer, "created": h.created,
        "identity": h.identity.to_dict(), "identity_key": h.identity.key, "namespace": h.namespace, "name": h.name,
        "imported_from": h.imported_from,
        "snapshot_id": h.snapshot_id, "layout": _layout_doc(h.layout), "tokens_per_row": h.layout.tokens_per_row,
        "chain": [{"n_tokens": ln.n_tokens, "base_tokens": ln.base_tokens, "token_width": ln.token_width,
                   "tokens": base64.b64encode(ln.tokens).decode(), "logical_bytes": ln.logical_bytes,
                   "matchable": ln.matchable,
                   "parts": [{"name": p.name, "row_start": p.row_start, "row_end": p.row_end, "nbytes": p.nbytes,
                              "tokens_per_row": p.tokens_per_row, "chunks": list(p.chunks)} for p in ln.parts]}
                  for ln in h.chain],
        "chunks": [{"raw_len": e.raw_len, "stored_len": e.stored_len, "codec": e.codec,
                    "checksum": e.checksum.hex(), "id": e.id.hex(), "part": e.part} for e in h.chunks],
    }
    return canonical_json(doc).encode()


def _bad(why: str) -> ExportFileError:
    return ExportFileError(f"the header is malformed: {why}")


def _get(d: Any, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    if not isinstance(d, dict) or key not in d:
        raise _bad(f"{where}{key!r} is missing")
    v = d[key]
    if isinstance(v, bool) and kind is not bool:
        raise _bad(f"{where}{key!r} has the wrong type")
    if not isinstance(v, kind):
        raise _bad(f"{where}{key!r} has the wrong type")
    return v


def _count(d: Any, key: str, where: str = "", hi: int = 1 << 62) -> int:
    v = _get(d, key, int, where)
    if not 0 <= v <= hi:
        raise _bad(f"{where}{key!r} is out of range")
    return int(v)


def _hexb(d: Any, key: str, n: int, where: str) -> bytes:
    v = _get(d, key, str, where)
    if len(v) != 2 * n or v.lower() != v:
        raise _bad(f"{where}{key!r} is not {n} bytes of lowercase hex")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise _bad(f"{where}{key!r} is not hex") from None


def _no_constants(name: str) -> Any:
    raise _bad(f"non-finite number {name}")


def _layout_of(doc: dict[str, Any]) -> Layout:
    fixed: dict[str, Fixed] = {}
    rows: dict[str, Rows] = {}
    for i, p in enumerate(_get(doc, "layout", list)):
        where = f"layout[{i}]: "
        name = _get(p, "name", str, where)
        if not _NAME.match(name) or name in fixed or name in rows:
            raise _bad(f"{where}bad or repeated part name")
        kind = _get(p, "kind", str, where)
        comp = p.get("component")
        if comp is not None and not isinstance(comp, str):
            raise _bad(f"{where}'component' has the wrong type")
        shape = _get(p, "shape", list, where)
        if len(shape) > 64:
            raise _bad(f"{where}too many dimensions")
        try:
            if kind == "fixed":
                fixed[name] = Fixed(_get(p, "dtype", str, where), tuple(shape), comp)
            elif kind == "rows":
                rows[name] = Rows(_get(p, "dtype", str, where), tuple(shape), comp)
            else:
                raise _bad(f"{where}kind must be 'fixed' or 'rows'")
        except LayoutError as err:
            raise _bad(f"{where}{err}") from None
    g = doc.get("tokens_per_row")
    if g is not None and (not isinstance(g, int) or isinstance(g, bool)):
        raise _bad("'tokens_per_row' has the wrong type")
    try:
        return Layout(fixed=fixed, rows=rows, tokens_per_row=g)
    except LayoutError as err:
        raise _bad(f"layout: {err}") from None


def decode_header(data: bytes) -> ExportHeader:
    """Parse and check the header; ExportFileError says what is wrong with it."""
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError) as err:
        raise _bad(f"not JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad("not a snapstore export header")
    if doc.get("v") != VERSION:
        raise _bad(f"header version {doc.get('v')!r} is not supported (this snapstore reads {VERSION})")
    try:
        ident = Identity.from_dict(_get(doc, "identity", dict))
    except Exception as err:  # ConfigError, or a TypeError of a malformed field
        raise _bad(f"identity: {err}") from None
    if ident.key != _get(doc, "identity_key", str):
        raise _bad("identity_key does not match the identity")
    ns = _get(doc, "namespace", str)
    # the API's own rules (snapstore._refs): a file brings in no namespace or name a call cannot reach
    if ns and namespace_problem(ns) is not None:
        raise _bad(f"'namespace': {namespace_problem(ns)}")
    name = doc.get("name")
    if name is not None and name_problem(name) is not None:
        raise _bad(f"'name': {name_problem(name)}")
    mark = doc.get("imported_from")
    if mark is not None and (not isinstance(mark, str) or not _KEY.match(mark)):
        raise _bad("'imported_from' must be null or an identity key")
    layout = _layout_of(doc)
    specs = layout.parts
    table = []
    for i, c in enumerate(_get(doc, "chunks", list)):
        where = f"chunks[{i}]: "
        codec = _count(c, "codec", where, 255)
        if codec not in CODEC_NAMES:
            raise _bad(f"{where}unknown codec {codec}")
        part = _get(c, "part", str, where)
        if part not in specs:
            raise _bad(f"{where}part {part!r} is not in the layout")
        raw_len = _count(c, "raw_len", where, MAX_CHUNK)
        stored = _count(c, "stored_len", where, MAX_CHUNK + 2048)
        if stored < HEADER_SIZE:
            raise _bad(f"{where}stored_len is shorter than a chunk header")
        table.append(ChunkEntry(raw_len, stored, codec, _hexb(c, "checksum", 16, where), _hexb(c, "id", 32, where),
                                part))
    used = [False] * len(table)
    chain: list[ChainLink] = []
    ends: dict[str, int] = {}  # each stream's rows so far: segments are contiguous from row 0
    prev = 0
    links = _get(doc, "chain", list)
    if not links:
        raise _bad("the chain is empty")
    for j, ln in enumerate(links):
        where = f"chain[{j}]: "
        n = _count(ln, "n_tokens", where)
        base = _count(ln, "base_tokens", where, n)
        if base != prev or (j > 0 and n <= base):
            raise _bad(f"{where}tokens [{base}, {n}) do not continue the link below (which ends at {prev})")
        prev = n
        width = _get(ln, "token_width", int, where)
        if width not in (4, 8):
            raise _bad(f"{where}token_width must be 4 or 8")
        try:
            toks = base64.b64decode(_get(ln, "tokens", str, where), validate=True)
        except (binascii.Error, ValueError):
            raise _bad(f"{where}tokens are not base64") from None
        if len(toks) != width * (n - base):
            raise _bad(f"{where}the token segment's length does not match n_tokens - base_tokens")
        try:  # the API's token rule: ints in [0, 2**63) (a negative token is the file's fault, not the store's)
            as_token_array(np.frombuffer(toks, dtype="<i4" if width == 4 else "<i8"), what=f"{where}tokens")
        except InvalidInputError as err:
            raise _bad(str(err)) from None
        parts = []
        seen: set[str] = set()
        for k, p in enumerate(_get(ln, "parts", list, where)):
            pw = f"{where}parts[{k}]: "
            pname = _get(p, "name", str, pw)
            if pname not in specs or pname in seen:
                raise _bad(f"{pw}part {pname!r} is not in the layout, or repeated")
            seen.add(pname)
            spec = specs[pname]
            r0, r1, nbytes = _count(p, "row_start", pw), _count(p, "row_end", pw), _count(p, "nbytes", pw)
            per = p.get("tokens_per_row")
            if per is not None and (not isinstance(per, int) or isinstance(per, bool) or not 1 <= per < 1 << 31):
                raise _bad(f"{pw}tokens_per_row must be null or a positive int")
            if isinstance(spec, Fixed):
                if (r0, r1) != (0, 0) or nbytes != spec.nbytes or per is not None:
                    raise _bad(f"{pw}a fixed part holds rows 0..0 and exactly its {spec.nbytes} bytes")
            else:
                if r0 != ends.get(pname, 0) or r1 < r0 or nbytes != (r1 - r0) * spec.row_bytes:
                    raise _bad(f"{pw}rows [{r0}, {r1}) of {nbytes} bytes do not continue stream {pname!r} "
                               f"(at row {ends.get(pname, 0)}, {spec.row_bytes} bytes a row)")
                ends[pname] = r1
            idx = _get(p, "chunks", list, pw)
            total = 0
            for x in idx:
                if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < len(table):
                    raise _bad(f"{pw}a chunk index is out of range")
                e = table[x]
                s2 = specs[e.part]
                if (type(s2), s2.dtype, getattr(s2, "shape", None), getattr(s2, "row_shape", None)) != (
                        type(spec), spec.dtype, getattr(spec, "shape", None), getattr(spec, "row_shape", None)):
                    raise _bad(f"{pw}chunk {x} is scoped by a part of another dtype or shape")
                used[x] = True
                total += e.raw_len
            if total != nbytes:
                raise _bad(f"{pw}its chunks hold {total} bytes, the part {nbytes}")
            parts.append(LinkPart(pname, r0, r1, nbytes, per, tuple(idx)))
        matchable = ln.get("matchable", True)
        if not isinstance(matchable, bool) or (not matchable and j == len(links) - 1):
            raise _bad(f"{where}'matchable' must be a bool, and true for the leaf")
        chain.append(ChainLink(n, base, width, toks, _count(ln, "logical_bytes", where), tuple(parts), matchable))
    if not all(used):
        raise _bad(f"chunk {used.index(False)} is referenced by no part")
    created = _get(doc, "created", (int, float))
    if not math.isfinite(created):
        raise _bad("'created' is not finite")
    return ExportHeader(ident, ns, name, layout, tuple(chain), tuple(table), _count(doc, "snapshot_id"),
                        _get(doc, "writer", str), float(created), mark)
