"""The catalog rows a restore plan reads, kept per process while the catalog generation stands.

A restore plan reads three things of a snapshot: its row with its identity's key, its chain and
every link's parts and chunk references. Of a small restore (a few thousand tokens, a dozen links)
those reads cost a third of the call (issue 31), and a server reads the same ones for every request
that shares a system prompt. :class:`ChainCache` keeps them for committed snapshots, tagged with
``catalog_gen`` (schema 13, docs/format.md): triggers bump it in the transaction of every change a
plan depends on, from any process. Each read transaction reads the counter first (one statement)
and uses the kept rows only when it is the one they were read under, so a deleted, quarantined,
superseded or re-keyed snapshot is never planned from memory. Every check of the plan still runs
on the rows (ownership, contiguity, sizes, destinations) and every chunk is still checksummed.

One memo serves every store a process opens on the same catalog file (:func:`shared_memo`): a
vLLM scheduler's lookup plans a snapshot, and the worker's load of it in the same process plans
from what the lookup read. What is kept is the same for every identity (a row and its identity's
*key*); each store's own checks (:class:`snapstore.lifecycle.access.Access`) run on it every time.
The catalog's random nonce goes with the counter: a store removed and created again at the same
path never has another catalog's rows taken for its own.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from snapstore._forks import ProcessLock
from snapstore.catalog.queries import ChunkRow, PartRow, SnapRow, SnapState, Txn

__all__ = ["ChainCache", "ChainReads", "Stamp", "StampListener", "shared_memo", "stamp_moves"]

_MAX_ENTRIES = 1024
_MAX_BYTES = 32 << 20  # token blobs and rows kept at most (an estimate: a 128K-token chain is ~0.5 MiB)
_ROW_BYTES = 1024  # what one kept row costs besides its token blob (a frozen row object and its bytes fields)
_CHECKED = 4  # checked plans kept per snapshot (a server asks for one or two: whole, a block prefix)

Found = tuple[SnapRow, str | None]
Stamp = tuple[bytes, int]  # the catalog's nonce and generation
Parts = list[tuple[PartRow, list[ChunkRow | None]]]


class StampListener(Protocol):
    """What keeps something under a stamp besides the memo (chunks.open_files.OpenFiles)."""

    def advance(self, stamp: Stamp) -> None:
        """A plan read ``stamp``: drop what was kept under an older one."""


def stamp_moves(held: Stamp, read: Stamp) -> tuple[bool, bool]:
    """The one rule of what is kept under a stamp: given the ``held`` stamp and one a transaction
    ``read``, (drop everything and hold ``read`` — another catalog, or a later generation;
    may the transaction use and fill what is kept — it read the stamp now held)."""
    moved = read[0] != held[0] or read[1] > held[1]
    return moved, moved or read == held


@dataclass
class _Entry:
    """One committed snapshot's rows: filled step by step as a plan reads them."""

    found: Found
    chain: list[SnapRow] | None = None
    parts: Parts | None = None
    nbytes: int = _ROW_BYTES
    # checked plans of these rows (plan.restore_plan.CheckedPlan) by (layout key, components,
    # rows_from, rows_to): the same for every store that asks with an equal layout
    checked: dict[tuple[Any, ...], object] | None = None
    # the chain's token blobs joined, as one root segment (blob, width, 0, n_tokens), when every link
    # has one width and they are contiguous from token 0; False: they are not (match checks link by link)
    spelled: tuple[bytes, int, int, int] | bool | None = None


class ChainCache:
    """A memo of plan reads, validated by the catalog's nonce and generation (module docstring).

    ``enabled`` False (a read-only or private catalog, whose file another program may replace
    without triggers) makes :meth:`reads` hand back the transaction itself."""

    def __init__(self, enabled: bool, max_entries: int = _MAX_ENTRIES, max_bytes: int = _MAX_BYTES) -> None:
        self.enabled = enabled
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._lock = ProcessLock()  # a forked child gets it fresh
        self._stamp: Stamp = (b"", -1)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        self.hits = 0  # plans served from memory, for tests and benchmarks
        self._listeners: weakref.WeakSet[StampListener] = weakref.WeakSet()

    def on_move(self, listener: StampListener) -> None:
        """Tell ``listener`` (held weakly) each newer stamp a plan of this process reads, whichever
        store's: what it keeps under an older one is dropped then (chunks.open_files)."""
        with self._lock:
            self._listeners.add(listener)

    def reads(self, c: Txn) -> Txn | ChainReads:
        """What a plan in transaction ``c`` reads through: the memo when enabled, else ``c``."""
        if not self.enabled:
            return c
        stamp = c.catalog_gen()
        if stamp is None:  # the counter's row is gone (a damaged catalog): nothing vouches for kept rows
            return c
        listeners: list[StampListener] = []
        with self._lock:
            moved, current = stamp_moves(self._stamp, stamp)  # an older transaction neither uses nor fills it
            if moved:
                self._entries.clear()
                self._bytes = 0
                self._stamp = stamp
                listeners = list(self._listeners)
        for listener in listeners:  # outside the memo's lock: a listener takes its own
            listener.advance(stamp)
        return ChainReads(c, self, stamp) if current else c

    def _get(self, stamp: Stamp, sid: int) -> _Entry | None:
        with self._lock:
            if stamp != self._stamp:
                return None
            e = self._entries.get(sid)
            if e is not None:
                self._entries.move_to_end(sid)
            return e

    def _put(self, stamp: Stamp, sid: int, e: _Entry, grew: int) -> None:
        """Keep ``e`` (grown by ``grew`` bytes) for ``sid``, if ``stamp`` is still current; oldest out first."""
        with self._lock:
            if stamp != self._stamp:
                return  # the generation moved on while this transaction read: its rows are not kept
            old = self._entries.get(sid)
            if old is not e:  # new, or dropped meanwhile: (re)counted whole
                if old is not None:
                    self._bytes -= old.nbytes
                self._entries[sid] = e
                self._bytes += e.nbytes
            e.nbytes += grew
            self._bytes += grew
            while self._entries and (len(self._entries) > self._max_entries or self._bytes > self._max_bytes):
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def _grow(self, stamp: Stamp, e: _Entry, nbytes: int) -> None:
        """Count ``nbytes`` more held by ``e`` (oldest entries out first), if ``e`` is still kept."""
        with self._lock:
            if stamp != self._stamp or self._entries.get(e.found[0].id) is not e:
                return
            e.nbytes += nbytes
            self._bytes += nbytes
            while self._entries and self._bytes > self._max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def _keep_checked(self, stamp: Stamp, e: _Entry, key: tuple[Any, ...], plan: object, nbytes: int) -> None:
        """Keep ``plan`` under ``key`` with ``e``'s rows (``nbytes`` more held), if ``e`` is still kept."""
        with self._lock:
            if stamp != self._stamp or self._entries.get(e.found[0].id) is not e:
                return  # a dropped entry's plans are not kept (nor counted)
            if e.checked is None:
                e.checked = {}
            if key not in e.checked:
                if len(e.checked) >= _CHECKED:
                    del e.checked[next(iter(e.checked))]  # its bytes stay counted: a bound, not an account
                e.nbytes += nbytes
                self._bytes += nbytes
            e.checked[key] = plan


class ChainReads:
    """The reads of one plan in one read transaction: from the memo where it holds them, else from
    the transaction, keeping what concerns committed snapshots. Stands in for a Txn in
    ``Access.readable``, ``Access.chain`` and ``ChainRows``."""

    __slots__ = ("_c", "_cache", "_stamp")

    def __init__(self, c: Txn, cache: ChainCache, stamp: Stamp) -> None:
        self._c = c
        self._cache = cache
        self._stamp = stamp

    @property
    def stamp(self) -> Stamp:
        """The catalog stamp this transaction read: what a plan made through it was read under."""
        return self._stamp

    def snapshot_and_key(self, sid: int) -> Found | None:
        """As :meth:`Txn.snapshot_and_key`."""
        e = self._cache._get(self._stamp, sid)
        if e is not None:
            self._cache.hits += 1
            return e.found
        found = self._c.snapshot_and_key(sid)
        if found is not None and found[0].state == SnapState.COMMITTED:
            self._cache._put(self._stamp, sid, _Entry(found), len(found[0].tokens))
        return found

    def chain(self, sid: int) -> list[SnapRow]:
        """As :meth:`Txn.chain`; kept when every link is committed."""
        e = self._cache._get(self._stamp, sid)
        if e is not None and e.chain is not None:
            return e.chain
        chain = self._c.chain(sid)
        if e is not None and all(link.state == SnapState.COMMITTED for link in chain):
            e.chain = chain
            self._cache._put(self._stamp, sid, e, sum(len(link.tokens) + _ROW_BYTES for link in chain))
        return chain

    def kept_chain(self, sid: int) -> list[SnapRow] | None:
        """The chain kept for committed snapshot ``sid`` (root first, its own row last), or None when
        not kept: reads nothing. match() checks a candidate's links against it instead of the
        catalog (issue 48)."""
        e = self._cache._get(self._stamp, sid)
        return e.chain if e is not None else None

    def kept_spelling(self, sid: int) -> tuple[bytes, int, int, int] | None:
        """The kept chain of ``sid`` as one root token segment ``(blob, width, 0, n_tokens)`` — its
        links' blobs joined, when all have one width, the right lengths and follow each other from
        token 0 — so match() compares a prompt with the whole chain in one memcmp; None: not kept,
        or not so (then the links are compared one by one). Joined once per kept chain."""
        e = self._cache._get(self._stamp, sid)
        if e is None or e.chain is None:
            return None
        if e.spelled is None:
            chain, pos = e.chain, 0
            width = chain[0].token_width if chain else 0
            for link in chain:
                if link.token_width != width or link.base_tokens != pos or link.n_tokens < pos \
                        or len(link.tokens) != width * (link.n_tokens - pos):
                    pos = -1
                    break
                pos = link.n_tokens
            joined = b"".join(link.tokens for link in chain) if pos > 0 and width in (4, 8) else b""
            e.spelled = (joined, width, 0, pos) if joined else False
            self._cache._grow(self._stamp, e, len(joined))
        return e.spelled if isinstance(e.spelled, tuple) else None

    def chain_parts(self, ids: Sequence[int]) -> Parts:
        """As :meth:`Txn.chain_parts`; kept for the exact chain of a kept snapshot."""
        e = self._cache._get(self._stamp, ids[-1]) if ids else None
        same = e is not None and e.chain is not None and [link.id for link in e.chain] == list(ids)
        if same and e is not None and e.parts is not None:
            return e.parts
        parts = self._c.chain_parts(ids)
        if same and e is not None:
            e.parts = parts
            self._cache._put(self._stamp, ids[-1], e, sum(_ROW_BYTES * (1 + len(chunks)) for _, chunks in parts))
        return parts

    def checked(self, sid: int, key: tuple[Any, ...]) -> object | None:
        """The checked plan kept for ``sid``'s kept rows under ``key``, if any."""
        e = self._cache._get(self._stamp, sid)
        return e.checked.get(key) if e is not None and e.checked is not None else None

    def keep_checked(self, sid: int, ids: Sequence[int], key: tuple[Any, ...], plan: object, n_reads: int) -> None:
        """Keep ``plan`` (``n_reads`` chunk reads), checked from ``sid``'s rows as kept for its
        chain ``ids``, under ``key``."""
        e = self._cache._get(self._stamp, sid)
        if e is not None and e.parts is not None and e.chain is not None and [x.id for x in e.chain] == list(ids):
            self._cache._keep_checked(self._stamp, e, key, plan, _ROW_BYTES // 4 * (4 + n_reads))

    def identity_key(self, identity_id: int) -> str | None:
        """As :meth:`Txn.identity_key` (not kept: asked only of a link of another identity row)."""
        return self._c.identity_key(identity_id)


_shared: weakref.WeakValueDictionary[str, ChainCache] = weakref.WeakValueDictionary()
_shared_lock = ProcessLock()


def shared_memo(db_path: str) -> ChainCache:
    """The memo of every store this process has open on the catalog at ``db_path`` (an absolute
    path); it lives while one of them holds it."""
    with _shared_lock:
        memo = _shared.get(db_path)
        if memo is None:
            memo = _shared[db_path] = ChainCache(enabled=True)
        return memo
