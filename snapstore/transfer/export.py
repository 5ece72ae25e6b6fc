"""Write one committed snapshot's chain as an export file (:mod:`snapstore.transfer.format`).

The chain's metadata is read in one read transaction (links root first, their parts and chunk
rows, the identity); then each distinct chunk file is streamed into the file, checked as it is
read (header, XXH3-128 and its content address in this store: a damaged chunk is never exported),
one piece at a time. The file is written under a temporary name beside ``path``, fsynced and
renamed into place, so ``path`` is either absent or complete. A chain imported here under an
identity override is exported with that mark (the header's ``imported_from``, preamble flag bit
0): importing the file anywhere requires the override again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata

import blake3

from snapstore._errors import CorruptionError, SnapshotUnavailableError, StateError, StoreIOError
from snapstore._identity import Identity
from snapstore._layout import Fixed, Layout, Rows
from snapstore.catalog.queries import PartKind, SnapRow, SnapState, Txn
from snapstore.chunks.chunkfile import open_chunk
from snapstore.chunks.repo import Repo
from snapstore.transfer.chunkcheck import BadChunk, ChunkVerify
from snapstore.transfer.format import (
    FLAG_MARKED,
    PIECE,
    ChainLink,
    ChunkEntry,
    ExportHeader,
    LinkPart,
    encode_header,
    frame_head,
    pack_preamble,
    pack_trailer,
)
from snapstore.transfer.output_file import OutputFile
from snapstore.transfer.results import ExportResult

__all__ = ["ChainCheck", "write_export"]

ChainCheck = Callable[[Txn, SnapRow], list[SnapRow]]  # the snapshot's chain, root first, after the caller's checks


@dataclass(frozen=True)
class _Plan:
    header: ExportHeader
    scopes: list[bytes]  # per chunk-table entry: the scope key of its address in this store


def _writer() -> str:
    try:
        return f"snapstore {metadata.version('snapstore')}"
    except metadata.PackageNotFoundError:
        return "snapstore"


def _plan(c: Txn, sid: int, chain_of: ChainCheck, name: str | None) -> _Plan:
    snap = c.snapshot(sid)
    if snap is None:
        raise SnapshotUnavailableError(f"snapshot {sid} does not exist (evicted, deleted or never saved)",
                                       snapshot_id=sid)
    if snap.state != SnapState.COMMITTED or not snap.matchable:
        what = "a pending capture" if snap.state != SnapState.COMMITTED else "superseded (a chain link only)"
        raise StateError(f"snapshot {sid} is {what}: only a committed, matchable snapshot can be exported "
                         "(export the longer one over it)")
    chain = chain_of(c, snap)
    # the override mark travels with the state (issue 46 item 1): a chain holding state another
    # identity computed is exported marked, and importing it needs the override again
    marks = sorted({link.imported_from for link in chain if link.imported_from is not None})
    if len(marks) > 1:
        raise StateError(f"snapshot {sid}'s chain holds state imported under overrides from several identities "
                         f"({', '.join(marks)}): one file cannot say which computed it; nothing exported")
    canonical = {i: canon for i, _key, canon, _c, _o in c.identities()}.get(snap.identity_id)
    if canonical is None:
        raise CorruptionError(f"snapshot {sid}'s identity row is missing; run `snapstore verify`")
    identity = Identity.from_dict(json.loads(canonical))
    specs: dict[str, Fixed | Rows] = {}
    grains: set[int] = set()
    table: list[ChunkEntry] = []
    scopes: list[bytes] = []
    index: dict[tuple[bytes, str, str], int] = {}  # (chunk id, dtype, shape): one frame per address scope
    links: list[ChainLink] = []
    for link in chain:
        if link.identity_id != snap.identity_id or link.namespace != snap.namespace:
            raise CorruptionError(f"snapshot {sid}: chain link {link.id} is of another identity or namespace; "
                                  "run `snapstore verify`")
        parts = []
        for p in c.parts(link.id):
            spec: Fixed | Rows = (Fixed(p.dtype, p.shape, p.component) if p.kind == PartKind.FIXED
                                  else Rows(p.dtype, p.shape, p.component))
            if specs.setdefault(p.name, spec) != spec:
                raise CorruptionError(f"snapshot {sid}: part {p.name!r} has another spec in chain link {link.id}; "
                                      "such a chain cannot be described by one layout")
            if p.kind == PartKind.ROWS and p.tokens_per_row is not None:
                grains.add(p.tokens_per_row)
            idx = []
            for row in c.part_chunks(link.id, p.name):
                if row is None:
                    raise SnapshotUnavailableError(f"snapshot {sid}: a chunk of part {p.name!r} (link {link.id}) "
                                                   "has no catalog row; run `snapstore verify`", snapshot_id=sid)
                key = (row.id, p.dtype, repr(p.shape))
                if key not in index:
                    index[key] = len(table)
                    table.append(ChunkEntry(row.raw_len, row.stored_len, row.codec, row.checksum, row.id, p.name))
                    scopes.append(row.scope)
                idx.append(index[key])
            parts.append(LinkPart(p.name, p.row_start, p.row_end, p.nbytes, p.tokens_per_row, tuple(idx)))
        links.append(ChainLink(link.n_tokens, link.base_tokens, link.token_width, bytes(link.tokens),
                               link.logical_bytes, tuple(parts), bool(link.matchable)))
    if len(grains) > 1:
        raise CorruptionError(f"snapshot {sid}: its row streams were saved at several granularities {sorted(grains)}")
    g = next(iter(grains), 1)
    layout = Layout(fixed={k: v for k, v in specs.items() if isinstance(v, Fixed)},
                    rows={k: v for k, v in specs.items() if isinstance(v, Rows)},
                    tokens_per_row=g if g > 1 else None)
    header = ExportHeader(identity, snap.namespace, name, layout, tuple(links), tuple(table), sid, _writer(),
                          time.time(), marks[0] if marks else None)
    return _Plan(header, scopes)


def write_export(repo: Repo, sid: int, path: str | os.PathLike[str], *, chain_of: ChainCheck,
                 name: str | None = None, overwrite: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> ExportResult:
    """Write snapshot ``sid``'s chain to ``path``; what was written. Never inside a store directory,
    never over an existing file unless ``overwrite`` (:class:`~snapstore.transfer.output_file.OutputFile`).
    ``progress(done, total)``: called after each chunk frame, in chunk bytes (the CLI's meter).

    ``chain_of(txn, snapshot)``: the chain, root first, after the caller's ownership checks (the
    Store's :meth:`Access.chain`; the CLI's plain walk). ``name``: recorded in the file (an
    importer names the snapshot so unless told another name).
    """
    out = OutputFile(path, overwrite=overwrite, store_root=repo.root, what="the export file")  # before any work
    plan = repo.db.read(lambda c: _plan(c, sid, chain_of, name))
    h = plan.header
    whole = blake3.blake3()
    size = 0

    def put(data: bytes | memoryview) -> None:
        nonlocal size
        out.write(data)
        whole.update(data)
        size += len(data)

    with out:  # published whole when the block ends; an error or an interrupt leaves nothing
        header = encode_header(h)
        put(pack_preamble(header, FLAG_MARKED if h.imported_from is not None else 0))
        put(header)
        total, done = sum(e.stored_len for e in h.chunks), 0
        for i, e in enumerate(h.chunks):
            head = frame_head(i)
            frame = blake3.blake3(head)
            put(head)
            for piece in _chunk_pieces(repo, e, plan.scopes[i], sid):
                frame.update(piece)
                put(piece)
            put(frame.digest())
            done += e.stored_len
            if progress is not None:
                progress(done, total)
        out.write(pack_trailer(len(h.chunks), whole.digest()))
        size += 48
    return ExportResult(out.path, sid, h.n_tokens, len(h.chain), len(h.chunks), size, h.identity.key,
                        h.namespace or None, name, h.imported_from)


def _chunk_pieces(repo: Repo, e: ChunkEntry, scope: bytes, sid: int) -> Iterator[memoryview]:
    """The chunk file's bytes in pieces, checked against its catalog row and its address as read."""
    what = f"snapshot {sid}: chunk {e.id.hex()}"
    try:
        fd, st = open_chunk(repo.blob_path(e.id))
    except FileNotFoundError:
        raise SnapshotUnavailableError(f"{what} is missing (evicted meanwhile, or lost); nothing exported "
                                       "(`snapstore verify`)", snapshot_id=sid) from None
    except OSError as err:
        raise StoreIOError(err.errno or 5, f"{what}: cannot open it: {err.strerror}") from None
    try:
        if st.st_size != e.stored_len:
            raise CorruptionError(f"{what} is {st.st_size} bytes, its row says {e.stored_len}; nothing exported "
                                  "(`snapstore verify --repair`)")
        check = ChunkVerify(e.raw_len, e.stored_len, e.codec, e.checksum, scope)
        off = 0
        while off < e.stored_len:
            piece = os.pread(fd, min(PIECE, e.stored_len - off), off)
            if not piece:
                raise CorruptionError(f"{what} was cut short while exporting; nothing exported")
            check.feed(memoryview(piece))
            off += len(piece)
            yield memoryview(piece)
        if check.finish() != e.id:
            raise BadChunk("its content does not match its address")
    except BadChunk as bad:
        raise CorruptionError(f"{what} is damaged ({bad}); nothing exported (`snapstore verify --deep`)") from None
    finally:
        os.close(fd)
