"""Import an export file into a store: every byte checked before the catalog changes.

Order (docs/format.md "Export files", "Importing"):

1. the preamble and header are read and checked; the identity decision is made (the file's
   identity must be the store's, or the caller's ``accept_identity`` must name the file's) and,
   for a Store, the layout is checked against the store's (a chain it could not restore is refused);
2. the frames are read in order. A chunk this store already holds at the file's address (same
   identity and namespace, a healthy row of the same checksum) is only read and checked: nothing
   is written. Any other is streamed into ``tmp/`` while checked, fsynced, and published at the
   address it has *in this store* (keyed BLAKE3 under this store's scope: an import under another
   identity re-addresses every chunk), unless a chunk is there already;
3. the trailer: the frame count and the whole file's BLAKE3, and nothing after it;
4. one write transaction adds the new chunks' rows, inserts the chain's links (a link already
   here, of equal tokens and content, is reused), names the leaf, and evicts LRU leaves to the
   budget (the chain itself never).

Any failure before the commit removes the chunk files the import published (those no row
references; a crash leaves them as orphans that gc collects after its grace period): nothing
is half-imported.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import BinaryIO

import numpy as np

from snapstore._errors import (
    ConfigError,
    CorruptChunkError,
    CorruptionError,
    DestinationError,
    ExportFileError,
    LayoutError,
    SnapshotUnavailableError,
    StateError,
)
from snapstore._layout import Fixed, Layout, Rows
from snapstore._tokens import TokenIndex, decode_tokens
from snapstore.catalog.find_keys import find_keys, stored_key
from snapstore.catalog.queries import PartKind, SnapRow, Txn
from snapstore.chunks.chunkfile import header_at, header_matches, scope_key
from snapstore.chunks.publish import create_temp, discard, finish_temp, fsync_dirs, link_new, write_all
from snapstore.chunks.repo import Repo
from snapstore.chunks.settle import held, settle
from snapstore.lifecycle.access import Access, Retry
from snapstore.lifecycle.capacity import Capacity
from snapstore.lifecycle.eviction import evict_until
from snapstore.lifecycle.naming import check_name, name_snapshot
from snapstore.plan.chain_rows import ChainRows
from snapstore.plan.fit import saved_layout_key
from snapstore.plan.prefix import ContentSegment, content_key_of, content_tag, record_prefixes
from snapstore.plan.restore_plan import check_plan, parts_fit
from snapstore.transfer.chunkcheck import BadChunk, ChunkVerify
from snapstore.transfer.destination import path_arg
from snapstore.transfer.format import ChunkEntry, ExportHeader
from snapstore.transfer.policy import identity_decision
from snapstore.transfer.reader import ExportReader
from snapstore.transfer.results import ImportResult

__all__ = ["check_layout", "import_export", "open_export", "read_header"]


class _Gone(Exception):
    """A chunk the import found here was evicted before its transaction: run the import again."""


def open_export(path: str | os.PathLike[str]) -> BinaryIO:
    """Open an export file for reading: a regular file, never through a FIFO or device (no blocking)."""
    p = path_arg(path, "the export file")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"cannot open the export file {p}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{p} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)


def read_header(path: str | os.PathLike[str]) -> ExportHeader:
    """The checked header of an export file (its frames not read): what the CLI opens a store with.
    A damaged one is refused naming the file, as an import is (issue 46 item 14)."""
    shown = path_arg(path, "the export file")
    with open_export(path) as f, _named_file(shown):
        return ExportReader(f, shown).header


def check_layout(h: ExportHeader, layout: Layout) -> None:
    """LayoutError unless every part of the file has the same spec in ``layout`` (and the same
    tokens per row): a chain the store could not restore is not imported."""
    mine = layout.parts
    for name, spec in sorted(h.layout.parts.items()):
        have = mine.get(name)
        if isinstance(have, Rows) and have.lag:  # a stream's lag is no part of what is stored or exported
            have = replace(have, lag=0)         # (docs/format.md §6): the file's Rows never carry it
        if have != spec:
            raise LayoutError(f"the export file's part {name!r} is {spec}, this store's layout has {have}; "
                              "nothing imported (open the store with the layout the snapshot was saved with)")
    if (h.layout.tokens_per_row or 1) != (layout.tokens_per_row or 1):
        raise LayoutError(f"the export file holds {h.layout.tokens_per_row or 1} tokens a row, this store's layout "
                          f"{layout.tokens_per_row or 1}; nothing imported")


@dataclass
class _Chunks:
    ids: list[bytes]  # per table entry: its address in this store
    keys: list[bytes]  # per table entry: the scope key of that address
    created: list[bytes]  # chunk files this import published
    written: int = 0


def import_export(repo: Repo, path: str | os.PathLike[str], *, access: Access, layout: Layout | None,
                  capacity: Capacity, accept_identity: str | None, name: str | None,
                  progress: Callable[[int, int], None] | None = None) -> ImportResult:
    """Import the export file at ``path`` into ``repo`` under ``access``'s identity (see the module).
    ``progress(done, total)``: called as the frames are read, in chunk bytes (the CLI's meter)."""
    repo.refuse_write("import an export file")
    if name is not None:
        check_name(name)
    shown = path_arg(path, "the export file")
    with open_export(path) as f, _named_file(shown):
        reader = ExportReader(f, shown)
        h = reader.header
        imported_from = identity_decision(h.identity, access.identity, accept_identity, shown, h.imported_from)
        if layout is not None:
            check_layout(h, layout)
        upper = sum(e.stored_len for e in h.chunks)
        why = capacity.precheck(upper, 0)
        if why == "larger_than_budget":
            raise StateError(f"{shown} holds {upper} bytes of chunks, more than the disk budget "
                             f"({capacity.budget.disk_bytes}); nothing imported")
        chunks = _Chunks([], [], [])
        try:
            _read_frames(repo, reader, h, access, chunks, shown, progress)
            reader.finish()
        except BaseException:
            repo.sweep(chunks.created)
            raise
    fsync_dirs({os.path.dirname(repo.blob_path(cid)) for cid in chunks.created})
    nm = name if name is not None else h.name
    now = time.time()

    def txn(t: Txn) -> tuple[int, int]:
        return _commit(t, repo, h, access, layout if layout is not None else h.layout, capacity, chunks,
                       imported_from, nm, now, shown)

    for attempt in range(2):
        try:
            leaf, added = repo.write(txn, discard=chunks.created)
            break
        except Retry as r:
            if not r.identity_gone or attempt:
                raise
            access.ensure_identity(repo.db)  # dropped as stale by another process meanwhile: re-created
        except _Gone:
            raise SnapshotUnavailableError(f"a chunk {shown} shares with this store was evicted during the import; "
                                           "nothing imported: import it again") from None
    return ImportResult(leaf, h.n_tokens, h.namespace or None, nm, len(h.chain), added, len(h.chunks),
                        len(chunks.created), chunks.written, access.identity_key, imported_from)


def _read_frames(repo: Repo, reader: ExportReader, h: ExportHeader, access: Access, chunks: _Chunks,
                 shown: str, progress: Callable[[int, int], None] | None = None) -> None:
    mine = access.identity_key
    same_scope = h.identity.key == mine
    ns = h.namespace
    total, done = sum(e.stored_len for e in h.chunks), 0
    for i, e, pieces in reader.frames():
        if progress is not None:
            progress(done, total)  # before the frame: the last call below says all of it was read
        done += e.stored_len
        spec = h.spec(e.part)
        shape = spec.shape if isinstance(spec, Fixed) else spec.row_shape
        key = scope_key(mine, ns, spec.dtype, shape)
        where = f"chunk frame {i} (part {e.part!r})"
        # a chunk is "here" only when its row is healthy and its file's header vouches for the row: a lost or
        # damaged file, or a quarantined row, is written (and the row healed) as a save would (issue 46 item 6)
        have = repo.db.read(partial(held, cid=e.id, path=repo.blob_path(e.id))) if same_scope else None
        try:
            if have is not None and have.checksum == e.checksum \
                    and have.raw_len == e.raw_len and have.scope in (key, scope_key(mine, ns)):
                check = ChunkVerify(e.raw_len, e.stored_len, e.codec, e.checksum, have.scope)
                for piece in pieces:  # already here: read and checked, nothing written
                    check.feed(piece)
                if check.finish() != e.id:
                    raise BadChunk("its content does not match its address")
                chunks.ids.append(e.id)
                chunks.keys.append(have.scope)
                continue
            cid = _publish(repo, e, key, pieces, chunks)
        except BadChunk as bad:
            raise ExportFileError(f"{where} is altered: {bad}") from None
        chunks.ids.append(cid)
        chunks.keys.append(key)
    if progress is not None:
        progress(total, total)


@contextmanager
def _named_file(shown: str) -> Iterator[None]:
    """Every ExportFileError of one import names the file and says that nothing was imported."""
    try:
        yield
    except ExportFileError as e:
        raise ExportFileError(f"{shown} is refused: {e}; nothing imported") from None


def _publish(repo: Repo, e: ChunkEntry, key: bytes, pieces: Iterator[memoryview], chunks: _Chunks) -> bytes:
    """Stream one frame into a temp file while checking it; publish it at its address here unless
    a healthy chunk is there already. Its address."""
    fd, tmp = create_temp(repo.tmp)
    check = ChunkVerify(e.raw_len, e.stored_len, e.codec, e.checksum, key)

    def fill(fd: int) -> bool:
        for piece in pieces:
            check.feed(piece)
            write_all(fd, piece)
        return True

    finish_temp(fd, tmp, fill)  # removes the temp on any error (a BadChunk, a cut file)
    try:
        cid = check.finish()
    except BaseException:
        discard(tmp)
        raise
    # as a save publishes (save.chunker): a new address is linked; a taken one (a healthy row, whose
    # file settle() keeps if its header vouches for it; a quarantined row; a lost or damaged file; an
    # orphan) is settled under the write lock, which heals the row when it places this file
    dest = repo.blob_path(cid)
    state = repo.db.read(lambda c: c.chunk_state(cid))
    if state == 0 and link_new(tmp, dest):
        chunks.created.append(cid)
        chunks.written += e.stored_len
    elif settle(repo.db, cid, tmp, dest, e.stored_len, e.codec) is None:  # this file placed (the row healed)
        chunks.created.append(cid)
        chunks.written += e.stored_len
    return cid


def _commit(t: Txn, repo: Repo, h: ExportHeader, access: Access, layout: Layout, capacity: Capacity,
            chunks: _Chunks, imported_from: str | None, name: str | None, now: float,
            shown: str) -> tuple[int, int]:
    """The import's one transaction: chunk rows, the chain, the name, the budget. (leaf id, links added)."""
    iid = access.iid(t)
    ns = h.namespace
    for i, e in enumerate(h.chunks):
        cid = chunks.ids[i]
        if t.chunk(cid) is not None:
            continue
        try:
            head, size = header_at(repo.blob_path(cid))
        except (OSError, CorruptionError):
            raise _Gone() from None
        if not header_matches(head, e.raw_len, e.checksum, size):
            raise _Gone()
        t.add_chunk(cid, e.raw_len, size, head.codec, e.checksum, chunks.keys[i], now)
    toks = np.concatenate([decode_tokens(ln.tokens, ln.token_width, ln.n_tokens - ln.base_tokens) for ln in h.chain])
    index, keys = TokenIndex(toks), find_keys(toks)  # the chain's tokens, hashed once for every link
    tag = content_tag(h.layout)
    parent: SnapRow | None = None
    ids: list[int] = []
    added = 0
    for ln in h.chain:
        segs = []
        for p in ln.parts:
            spec = h.spec(p.name)
            kind, shape = (0, spec.shape) if isinstance(spec, Fixed) else (1, spec.row_shape)
            segs.append(ContentSegment(p.name, kind, spec.dtype, tuple(shape), p.row_start, p.row_end,
                                       [chunks.ids[x] for x in p.chunks]))
        ckey = content_key_of(parent.content_key if parent else None, tag, segs)
        pkey = index.prefix_key(ln.n_tokens)
        same = t.same_link(iid, ns, parent.id if parent else None, pkey, ckey)
        if same is not None and (same.imported_from is None or same.imported_from == imported_from) and (
                same.matchable or not ln.matchable):
            t.touch(same.id, now, False)  # already here (equal tokens and content): reused
            sid = same.id
        else:
            blob = ln.tokens
            sid = t.insert_snapshot(
                identity_id=iid, namespace=ns, parent_id=parent.id if parent else None,
                depth=parent.depth + 1 if parent else 0, n_tokens=ln.n_tokens, base_tokens=ln.base_tokens,
                token_width=ln.token_width, tokens=blob, find_key=stored_key(keys, ln.n_tokens),
                anchor=index.anchor(ln.n_tokens), prefix_key=pkey,
                content_key=ckey, session=None, state=1, owner=None, now=now, logical_bytes=ln.logical_bytes,
                layout_key=saved_layout_key(layout, [p.name for p in ln.parts]), imported_from=imported_from)
            for p, seg in zip(ln.parts, segs):
                t.insert_part(sid, p.name, PartKind.FIXED if seg.kind == 0 else PartKind.ROWS, seg.dtype, seg.shape,
                              h.spec(p.name).component, p.row_start, p.row_end, p.nbytes, seg.chunk_ids,
                              p.tokens_per_row)
            if not ln.matchable:
                t.set_unmatchable(sid)  # a superseded chain link stays one (its fixed parts are not in the file)
            elif imported_from is None:  # an import under an override is never matched: no prefix index
                record_prefixes(t, layout, sid, toks[:ln.n_tokens])
            added += 1
        parent = t.snapshot(sid)
        assert parent is not None
        ids.append(sid)
    _check_restorable(t, h, ids, layout, shown)
    if name is not None:
        name_snapshot(t, access, ids[-1], ns, name, None, now)
    ok, _ = evict_until(t, lambda _freed: capacity.excess(t) is None, set(ids))
    if not ok:
        raise StateError(f"the imported chain does not fit the store's budget ({capacity.excess(t)}) even after "
                         "evicting every unpinned snapshot; nothing imported")
    t.add_counter("imports", 1)
    return ids[-1], added


_UNRESTORABLE = (SnapshotUnavailableError, CorruptChunkError, DestinationError)  # what check_plan refuses with


def _check_restorable(t: Txn, h: ExportHeader, ids: list[int], layout: Layout, shown: str) -> None:
    """The whole chain, as inserted (inside the import's transaction), passes the checks a restore
    makes (:func:`snapstore.plan.restore_plan.check_plan`) before the one commit (issue 46 item 7):
    the leaf into the file's own layout (else the file is malformed: ExportFileError) and into this
    store's layout (else LayoutError), and every other matchable link that match() would serve
    here. A chain that would be matched and then fail every restore is never imported."""
    chain = t.chain(ids[-1])
    leaf = chain[-1]
    comps = {spec.component for spec in layout.parts.values() if spec.component is not None}
    reads = ChainRows(t, [link.id for link in chain])  # every link's parts and chunks, read once for every check
    try:  # into the file's own layout, every component asked for
        check_plan(reads, leaf.id, chain, h.layout, {v.component for v in h.layout.parts.values() if v.component})
    except _UNRESTORABLE as err:
        raise ExportFileError(f"{shown} is refused: its chain does not restore ({err}); nothing imported") from None
    try:
        check_plan(reads, leaf.id, chain, layout, comps)
    except _UNRESTORABLE as err:
        raise LayoutError(f"{shown}'s snapshot does not restore into this store's layout ({err}); nothing "
                          "imported (open the store with the layout the snapshot was saved with)") from None
    for i, link in enumerate(chain[:-1]):
        if not link.matchable or not parts_fit(reads.parts(link.id), layout):
            continue  # never served by match() here
        try:
            check_plan(reads, link.id, chain[:i + 1], layout, comps)
        except _UNRESTORABLE as err:
            raise ExportFileError(f"{shown} is refused: chain link {i} (of {link.n_tokens} tokens) would be matched "
                                  f"and never restore ({err}); nothing imported") from None
