"""A model of the export file format (docs/format.md §14), written from the spec, not from
snapstore.transfer: what a chain *is* (links of tokens and part bytes), the file it encodes to, and
one-field breakages of it. tests/transfer/test_transfer_trust.py builds malformed files with it;
fuzz/test_export_model.py draws files from it and imports each into a real store.

The writer packs every section itself (struct, json, blake3, xxhash): a header field can be broken
and the file still carry correct checksums, so the import must judge what the fields *say*.
"""

from __future__ import annotations

import base64
import copy
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import blake3
import xxhash

import snapstore as ss

__all__ = ["ModelFile", "ModelLink", "ModelPart", "chunk_file", "encode"]

_CHUNK_HEAD = struct.Struct("<8sHBBIQQ16s")  # docs/format.md "Chunk files": the 64-byte header's first 48


@dataclass(frozen=True)
class ModelPart:
    """One part of the layout: ``kind`` "fixed" (``shape``) or "rows" (``shape`` is the row shape); uint8."""

    name: str
    kind: str
    shape: tuple[int, ...]
    component: str | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def spec(self) -> ss.Fixed | ss.Rows:
        if self.kind == "fixed":
            return ss.Fixed("uint8", self.shape, self.component)
        return ss.Rows("uint8", self.shape, self.component)


@dataclass
class ModelLink:
    """One chain link: its own tokens ``[base, n)`` and, per part, ``(row_start, row_end, bytes)``
    (a fixed part: ``(0, 0, its bytes)``)."""

    tokens: list[int]
    parts: dict[str, tuple[int, int, bytes]]
    matchable: bool = True


@dataclass
class ModelFile:
    identity: ss.Identity
    parts: list[ModelPart]
    links: list[ModelLink]
    namespace: str = ""
    name: str | None = None
    imported_from: str | None = None
    chunk_bytes: int = 48  # each part segment is cut into chunks of at most this many bytes
    token_width: int = 4
    flags: int | None = None  # None: the flag the mark calls for
    tokens_per_row: int | None = None  # block-granular streams (no fixed parts then): n tokens hold n // g rows

    def layout(self) -> ss.Layout:
        return ss.Layout(fixed={p.name: p.spec() for p in self.parts if p.kind == "fixed"},  # type: ignore[misc]
                         rows={p.name: p.spec() for p in self.parts if p.kind == "rows"},  # type: ignore[misc]
                         tokens_per_row=self.tokens_per_row)

    def tokens(self, upto: int | None = None) -> list[int]:
        """The tokens of links ``[0, upto]`` (the whole chain by default)."""
        links = self.links if upto is None else self.links[:upto + 1]
        return [t for ln in links for t in ln.tokens]

    def expected(self, upto: int | None = None) -> dict[str, bytes]:
        """What restoring link ``upto`` (the leaf by default) writes: each stream's rows of every link
        up to it, each fixed part as that link holds it."""
        last = len(self.links) - 1 if upto is None else upto
        out: dict[str, bytes] = {}
        for p in self.parts:
            if p.kind == "fixed":
                if p.name in self.links[last].parts:
                    out[p.name] = self.links[last].parts[p.name][2]
            else:
                out[p.name] = b"".join(ln.parts[p.name][2] for ln in self.links[:last + 1] if p.name in ln.parts)
        return out


def chunk_file(raw: bytes) -> bytes:
    """A raw-codec chunk file (docs/format.md "Chunk files"): the 64-byte header, then the bytes."""
    head = _CHUNK_HEAD.pack(b"SNAPCHK\x00", 1, 0, 0, 64, len(raw), len(raw), xxhash.xxh3_128_digest(raw))
    return head + xxhash.xxh3_64_digest(head) + bytes(8) + raw


@dataclass
class _Built:
    doc: dict[str, Any]
    frames: list[bytes] = field(default_factory=list)  # chunk files, in table order


def _build(m: ModelFile) -> _Built:
    specs = {p.name: p for p in m.parts}
    chunks: list[dict[str, Any]] = []
    frames: list[bytes] = []
    chain = []
    n = 0
    for ln in m.links:
        base, n = n, n + len(ln.tokens)
        fmt = "<i" if m.token_width == 4 else "<q"
        toks = b"".join(struct.pack(fmt, t) for t in ln.tokens)
        parts = []
        for name, (r0, r1, data) in sorted(ln.parts.items()):
            idx = []
            for off in range(0, len(data), m.chunk_bytes):
                raw = data[off:off + m.chunk_bytes]
                idx.append(len(chunks))
                chunks.append({"raw_len": len(raw), "stored_len": 64 + len(raw), "codec": 0,
                               "checksum": xxhash.xxh3_128_digest(raw).hex(), "id": blake3.blake3(raw).hexdigest(),
                               "part": name})
                frames.append(chunk_file(raw))
            per = m.tokens_per_row if specs[name].kind == "rows" else None
            parts.append({"name": name, "row_start": r0, "row_end": r1, "nbytes": len(data), "tokens_per_row": per,
                          "chunks": idx})
        chain.append({"n_tokens": n, "base_tokens": base, "token_width": m.token_width,
                      "tokens": base64.b64encode(toks).decode(), "logical_bytes": sum(len(d) for *_r, d in
                                                                                      ln.parts.values()),
                      "matchable": ln.matchable, "parts": parts})
    doc = {"format": "snapstore-export", "v": 1, "writer": "export_model", "created": 1.0e9,
           "identity": m.identity.to_dict(), "identity_key": m.identity.key, "namespace": m.namespace,
           "name": m.name, "imported_from": m.imported_from, "snapshot_id": 1, "tokens_per_row": m.tokens_per_row,
           "layout": [{"name": p.name, "kind": p.kind, "dtype": "uint8", "shape": list(p.shape),
                       "component": p.component} for p in sorted(specs.values(), key=lambda p: p.name)],
           "chain": chain, "chunks": chunks}
    return _Built(doc, frames)


def encode(m: ModelFile, mutate: Callable[[dict[str, Any], list[bytes]], None] | None = None) -> bytes:
    """The file's bytes. ``mutate(doc, frames)`` may edit the header document and the chunk files
    before they are packed: every checksum is computed after it, so only the fields are wrong."""
    built = _build(m)
    doc, frames = copy.deepcopy(built.doc), list(built.frames)
    if mutate is not None:
        mutate(doc, frames)
    header = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    flags = m.flags if m.flags is not None else (1 if doc.get("imported_from") is not None else 0)
    pre = struct.pack("<8sHHIQ32s", b"SNAPEXP\x00", 1, flags, 0, len(header), blake3.blake3(header).digest())
    out = bytearray(pre + blake3.blake3(pre).digest()[:8] + header)
    for i, body in enumerate(frames):
        head = struct.pack("<8sQ", b"SNAPFRM\x00", i)
        out += head + body + blake3.blake3(head + body).digest()
    out += struct.pack("<8sQ32s", b"SNAPEND\x00", len(frames), blake3.blake3(bytes(out)).digest())
    return bytes(out)
