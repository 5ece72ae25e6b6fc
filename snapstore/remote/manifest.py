"""Manifests: a snapshot's metadata as one immutable object of the shared tier.

A manifest holds what a node needs to find, check and restore one chain link: identity and
namespace, its token segment, the block-hash keys match() uses, its parts and their chunk ids, and
the name of its parent's manifest. The object is canonical JSON (sorted keys, no whitespace)::

    {"body": {...}, "blake3": "<hex of BLAKE3-256 of canonical_json(body)>", "format": "snapstore-manifest", "v": 1}

Parsing is pure data: ``json.loads`` with every field type- and range-checked, the checksum
recomputed, ids only as validated hex. Nothing read is evaluated. See docs/format.md.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import blake3

from snapstore._errors import CorruptionError
from snapstore._identity import canonical_json

__all__ = ["FORMAT", "VERSION", "ChunkEntry", "Manifest", "PartEntry", "decode", "encode", "parse_name"]

FORMAT = "snapstore-manifest"
VERSION = 1
MAX_BYTES = 256 << 20  # a manifest larger than this is refused unread
_NAME = re.compile(r"^([0-9a-f]{32})/([0-9]{12})-([0-9a-f]{32})-([0-9a-f]{32})$")
_DTYPE = re.compile(r"^[a-z0-9]{1,16}$")
_PART = re.compile(r"^[^\x00-\x1f]{1,256}$")


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk a part references: its content address and what its object must hold."""

    id: bytes
    raw_len: int
    stored_len: int
    codec: int
    checksum: bytes


@dataclass(frozen=True)
class PartEntry:
    """A fixed part whole (kind 0) or a row-stream segment (kind 1) of one chain link."""

    name: str
    kind: int
    dtype: str
    shape: tuple[int, ...]
    component: str | None
    row_start: int
    row_end: int
    nbytes: int
    chunks: tuple[ChunkEntry, ...]
    tokens_per_row: int | None = None  # a row segment's granularity (absent in manifests written before it)


@dataclass(frozen=True)
class Manifest:
    """One chain link as the shared tier stores it (see docs/format.md "Shared tier")."""

    identity_key: str
    identity: str  # canonical JSON of the identity
    namespace: str
    n_tokens: int
    base_tokens: int
    token_width: int
    tokens: bytes  # tokens [base_tokens, n_tokens), little-endian int32/int64
    anchor: bytes
    prefix_key: bytes
    content_key: bytes
    parent: str | None  # the parent's manifest name
    matchable: bool
    logical_bytes: int
    created: float
    writer: str
    parts: tuple[PartEntry, ...]

    @property
    def name(self) -> str:
        """``<anchor>/<n_tokens:012d>-<prefix_key>-<content_key>``: its key below the scope."""
        return manifest_name(self.anchor, self.n_tokens, self.prefix_key, self.content_key)

    @property
    def chunk_ids(self) -> list[bytes]:
        """Every chunk this link references (with repeats, in part order)."""
        return [ch.id for p in self.parts for ch in p.chunks]


def manifest_name(anchor: bytes, n_tokens: int, prefix_key: bytes, content_key: bytes) -> str:
    """The name a manifest has below its scope (sorts by depth inside one anchor)."""
    return f"{anchor.hex()}/{n_tokens:012d}-{prefix_key.hex()}-{content_key.hex()}"


def parse_name(name: str) -> tuple[bytes, int, bytes, bytes] | None:
    """(anchor, n_tokens, prefix_key, content_key) of a manifest name, or None if it is not one."""
    m = _NAME.match(name)
    if m is None:
        return None
    return bytes.fromhex(m[1]), int(m[2]), bytes.fromhex(m[3]), bytes.fromhex(m[4])


def _body(m: Manifest) -> dict[str, Any]:
    return {
        "identity_key": m.identity_key, "identity": m.identity, "namespace": m.namespace,
        "n_tokens": m.n_tokens, "base_tokens": m.base_tokens, "token_width": m.token_width,
        "tokens": base64.b64encode(m.tokens).decode(), "anchor": m.anchor.hex(), "prefix_key": m.prefix_key.hex(),
        "content_key": m.content_key.hex(), "parent": m.parent, "matchable": m.matchable,
        "logical_bytes": m.logical_bytes, "created": m.created, "writer": m.writer,
        "parts": [_part(p) for p in m.parts],
    }


def _part(p: PartEntry) -> dict[str, Any]:
    out = {"name": p.name, "kind": p.kind, "dtype": p.dtype, "shape": list(p.shape), "component": p.component,
           "row_start": p.row_start, "row_end": p.row_end, "nbytes": p.nbytes,
           "chunks": [{"id": c.id.hex(), "raw_len": c.raw_len, "stored_len": c.stored_len, "codec": c.codec,
                       "checksum": c.checksum.hex()} for c in p.chunks]}
    if p.tokens_per_row is not None:  # absent otherwise: a v1 reader ignores it, and reads the object as before
        out["tokens_per_row"] = p.tokens_per_row
    return out


def encode(m: Manifest) -> bytes:
    """The manifest object's bytes (canonical JSON with the body's BLAKE3)."""
    body = _body(m)
    digest = blake3.blake3(canonical_json(body).encode()).hexdigest()
    return canonical_json({"body": body, "blake3": digest, "format": FORMAT, "v": VERSION}).encode()


# -- parsing: every field checked --------------------------------------------------------------
def _bad(why: str) -> CorruptionError:
    return CorruptionError(f"malformed manifest: {why}")


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise _bad(f"missing {key!r}")
    v = d[key]
    if isinstance(v, bool) and kind is not bool and not (isinstance(kind, tuple) and bool in kind):
        raise _bad(f"{key!r} has the wrong type")
    if not isinstance(v, kind):
        raise _bad(f"{key!r} has the wrong type")
    return v


def _count(d: dict[str, Any], key: str, hi: int = 1 << 62) -> int:
    v = _get(d, key, int)
    if not 0 <= v <= hi:
        raise _bad(f"{key!r} out of range")
    return int(v)


def _hexb(d: dict[str, Any], key: str, nbytes: int) -> bytes:
    v = _get(d, key, str)
    if len(v) != 2 * nbytes or v.lower() != v:
        raise _bad(f"{key!r} is not {nbytes} bytes of lowercase hex")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise _bad(f"{key!r} is not hex") from None


def _no_constants(name: str) -> Any:
    raise _bad(f"non-finite number {name}")


def decode(data: bytes) -> Manifest:
    """Parse and check a manifest object; CorruptionError says what is wrong with it."""
    if len(data) > MAX_BYTES:
        raise _bad(f"{len(data)} bytes, over the {MAX_BYTES}-byte limit")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad("not a snapstore manifest")
    if doc.get("v") != VERSION:
        raise _bad(f"version {doc.get('v')!r} is not supported (this snapstore reads version {VERSION})")
    body = _get(doc, "body", dict)
    if blake3.blake3(canonical_json(body).encode()).hexdigest() != doc.get("blake3"):
        raise _bad("checksum mismatch")
    n = _count(body, "n_tokens")
    base = _count(body, "base_tokens", n)
    width = _get(body, "token_width", int)
    if width not in (4, 8):
        raise _bad("token_width must be 4 or 8")
    try:
        tokens = base64.b64decode(_get(body, "tokens", str), validate=True)
    except (binascii.Error, ValueError):
        raise _bad("tokens are not base64") from None
    if len(tokens) != width * (n - base):
        raise _bad("token segment length does not match n_tokens - base_tokens")
    parent = body.get("parent")
    if parent is not None and (not isinstance(parent, str) or parse_name(parent) is None):
        raise _bad("parent is not a manifest name")
    if (parent is None) != (base == 0):
        raise _bad("a root starts at token 0 and only a root has no parent")
    created = _get(body, "created", (int, float))
    if not math.isfinite(created):
        raise _bad("created is not finite")
    parts = []
    for p in _get(body, "parts", list):
        if not isinstance(p, dict):
            raise _bad("a part is not an object")
        name = _get(p, "name", str)
        if not _PART.match(name):
            raise _bad("bad part name")
        kind = _get(p, "kind", int)
        if kind not in (0, 1):
            raise _bad("part kind must be 0 or 1")
        dtype = _get(p, "dtype", str)
        if not _DTYPE.match(dtype):
            raise _bad("bad dtype")
        shape = _get(p, "shape", list)
        if len(shape) > 16 or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 40
                                      for s in shape):
            raise _bad("bad shape")
        comp = p.get("component")
        if comp is not None and (not isinstance(comp, str) or not _PART.match(comp)):
            raise _bad("bad component")
        r0, r1 = _count(p, "row_start"), _count(p, "row_end")
        if r1 < r0:
            raise _bad("row_end < row_start")
        chunks = []
        for c in _get(p, "chunks", list):
            if not isinstance(c, dict):
                raise _bad("a chunk is not an object")
            chunks.append(ChunkEntry(_hexb(c, "id", 32), _count(c, "raw_len", 1 << 32),
                                     _count(c, "stored_len", (1 << 32) + 2048), _count(c, "codec", 255),
                                     _hexb(c, "checksum", 16)))
        nbytes = _count(p, "nbytes")
        if sum(c.raw_len for c in chunks) != nbytes:
            raise _bad(f"part {name!r}: chunks do not add up to its size")
        per = p.get("tokens_per_row")
        if per is not None and (kind != 1 or not isinstance(per, int) or isinstance(per, bool)
                                or not 1 <= per < 1 << 31):
            raise _bad("tokens_per_row must be absent or a positive int on a row segment")
        parts.append(PartEntry(name, kind, dtype, tuple(shape), comp, r0, r1, nbytes, tuple(chunks), per))
    ident = _get(body, "identity", str)
    try:
        if not isinstance(json.loads(ident), dict):
            raise ValueError(ident)
    except ValueError:
        raise _bad("identity is not a JSON object") from None
    return Manifest(
        identity_key=_get(body, "identity_key", str), identity=ident, namespace=_get(body, "namespace", str),
        n_tokens=n, base_tokens=base, token_width=width, tokens=tokens, anchor=_hexb(body, "anchor", 16),
        prefix_key=_hexb(body, "prefix_key", 16), content_key=_hexb(body, "content_key", 16), parent=parent,
        matchable=_get(body, "matchable", bool), logical_bytes=_count(body, "logical_bytes"),
        created=float(created), writer=_get(body, "writer", str), parts=tuple(parts))
