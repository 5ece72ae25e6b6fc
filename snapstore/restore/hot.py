"""Restores repeated into the same buffers, replayed from a plan kept while the catalog stands (issue 48).

A server restores the same small chain (a system prompt's few thousand tokens) into the same
arena, request after request. The full path plans in a read transaction, takes each chunk file's
kept descriptor (a lock, a dup, the header read again), probes the page cache, builds the
stream's runs and closes what it took: about 85 us of Python per restore and 7.5 us per link, where
reading and checking an 85 KiB link from the page cache takes about 6 us (docs/benchmarks.md).
After the second restore with the same key — snapshot, namespace, components, ``rows_from``,
prefix, and the same numpy arrays as destinations — this keeps what that restore did: per chunk an
open descriptor of its file (its header checked against the catalog row when opened), the byte
ranges of the destination it fills, and the checksum the catalog holds. Later restores with the key
replay it: per chunk a read straight into the destination and its XXH3-128 compared with the
catalog's; nothing else.

A plan is replayed only while nothing it was made from changed:

- the catalog: the WAL-index header (:mod:`snapstore.catalog.wal_stamp`) read before the plan's
  transaction is the one there now — no transaction committed since, in any process — or, when it
  moved, the catalog generation (one read transaction) is still the one the plan was read under:
  nothing a plan depends on changed (:mod:`snapstore.catalog.chain_cache`). Else it is dropped.
- the destinations: the same array objects (held weakly: a kept plan never keeps an engine's
  buffer alive), of the same shape and dtype, still writable and C-contiguous.

Every chunk is still checked against the catalog's checksum as it lands. A read that fails or
comes up short, or a checksum that does not match, drops the plan and the restore takes the full
path, which finds, reports and quarantines the damage (its error then says the destination was
touched). A replay writes only raw chunks into whole rows (no ``rows_from`` skip) of numpy arrays;
anything else always takes the full path.

Cold files: the header pass reads each header with ``RWF_NOWAIT`` (else probes the page cache), so
which files are not cached is known before a read brings them in. Their bytes are the restore's
"cold" bytes for the restore rates, the cached files' "warm" (a payload read that would still wait
is read blocking and counted cold). The cold files up to 128 KiB are then asked for at once
(``posix_fadvise(WILLNEED)``), and the later ones at the first payload read that waits; larger ones
are left to their own reads (:func:`snapstore.restore.hot_plan.ask_ahead` says why).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from snapstore._forks import ProcessLock, track
from snapstore.catalog.chain_cache import Stamp
from snapstore.catalog.queries import SnapRow
from snapstore.catalog.wal_stamp import WalStamp
from snapstore.chunks.chunkfile import CODEC_RAW, HEADER_SIZE, header_matches, open_chunk, parse_header
from snapstore.chunks.open_files import OpenFiles, give_descriptors, take_descriptors
from snapstore.parts.buffers import Sink
from snapstore.plan.restore_plan import RestorePlan
from snapstore.restore.hot_plan import HotPlan, Unreadable, headers_stand, read_all
from snapstore.restore.ramtier import RamTier

__all__ = ["HotKey", "HotPlan", "HotRestores", "Replay"]

HotKey = tuple[Any, ...]  # (snapshot id, namespace, components, rows_from, prefix tokens, (name, id(array))...)

_MAX_PLANS = 16  # plans one store keeps (LRU): a server's hot prefixes
_MAX_CHUNKS = 64  # chunks of a plan at most: a small restore (a larger one is not dominated by fixed costs)
_MAX_BYTES = 32 << 20  # bytes of a plan at most (a larger one reads with the full path's threads, or O_DIRECT)
# file bytes one store's plans hold open at most: what files another process deleted keep on disk
# until this process next plans (as chunks.open_files' bound)
_MAX_HELD = 64 << 20
_SEEN = 256  # keys remembered as restored once (kept on the second restore)
_STEP = 512 << 10  # a chunk is read and hashed in steps this size (restore.stream's in-thread step)



@dataclass
class Replay:
    """A replay's outcome: ``plan`` replayed (its bytes read from the page cache and the device in
    ``tiers``), or none (``touched``: it wrote before it gave up: the full path's error says so)."""

    plan: HotPlan | None
    tiers: dict[str, int]
    touched: bool = False


def _close(fds: tuple[int, ...], *, unlocked: bool = False) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    give_descriptors(len(fds), unlocked=unlocked)


def _close_plans(plans: OrderedDict[HotKey, HotPlan]) -> None:
    """Close every plan's files, taking no lock (a store collected unclosed, a forked child's copies)."""
    while plans:
        plan = plans.popitem()[1]
        plan.dead = True
        fds, plan.fds = plan.fds, ()
        _close(fds, unlocked=True)


class HotRestores:
    """A store's kept restores (module docstring). ``enabled`` False (a read-only store, a catalog
    without its generation memo) keeps nothing."""

    def __init__(self, db_path: str, blob_path: Callable[[bytes], str], enabled: bool,
                 files: OpenFiles | None = None) -> None:
        self.enabled = enabled
        self._blob_path = blob_path
        self._files = files  # the full path's kept descriptors: a plan's own replace them
        self._wal = WalStamp(db_path)
        self._lock = ProcessLock()
        self._plans: OrderedDict[HotKey, HotPlan] = OrderedDict()
        self._seen: OrderedDict[HotKey, tuple[weakref.ref[np.ndarray], ...]] = OrderedDict()  # restored once
        self.replays = 0  # restores replayed, for tests and benchmarks
        # a store dropped without close() must not hold its files (and deleted ones' space) for good
        weakref.finalize(self, _close_plans, self._plans)
        track(self)

    def _after_fork_in_child(self) -> None:
        """A forked child closes its copies of the descriptors (the parent keeps its own)."""
        _close_plans(self._plans)
        self._seen.clear()

    def key(self, sid: int, ns: str, components: object, rows_from: int, upto: int | None,
            into: object) -> HotKey | None:
        """The key of a restore a plan may be kept for, or None (never kept: another kind of call)."""
        if not self.enabled or type(into) is not dict or not into:
            return None
        if components is not None:
            if not isinstance(components, (list, tuple, set, frozenset)):
                return None  # an iterator is read once, by the full path
            try:
                components = frozenset(components)
            except TypeError:
                return None  # an unhashable name: the full path rejects it (wanted_components)
        return (sid, ns, components, rows_from, upto, *[(name, id(obj)) for name, obj in into.items()])

    def wal(self) -> bytes | None:
        """The WAL-index header now: read before a restore's plan, for :meth:`learn`."""
        return self._wal.read() if self.enabled else None

    def replay(self, key: HotKey, into: Mapping[str, Any], generation: Callable[[], Stamp | None],
               usable: Callable[[SnapRow], bool], ram: RamTier | None = None) -> Replay | None:
        """Replay the plan kept for ``key`` into ``into``, or None where none stands (``generation``:
        reads the catalog stamp, asked only when the WAL-index header moved; ``usable``: may this
        call restore the plan's snapshot without the full path's bookkeeping — else the plan is
        dropped). ``ram``: the RAM tier, used as the full path uses it — a chunk it holds is copied
        from it (checked when admitted), one read from its file is offered to it."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is None or plan.dead:
                return None
            plan.busy += 1
            self._plans.move_to_end(key)
        try:
            now = self._wal.read()
            if now is None or now != plan.wal:
                if generation() != plan.stamp:
                    self._drop(plan)
                    return None
                plan.wal = now  # read before the generation: nothing committed before it moved the stamp
            views = self._views(plan, into) if usable(plan.snap) else None
            if views is None:
                self._drop(plan)
                return None
            tiers = {"warm": 0, "cold": 0, "ram": 0}
            with ram.restoring() if ram is not None else contextlib.nullcontext():  # admission waits meanwhile
                cold = headers_stand(plan)
                if cold is None:  # damaged in place since: found (and reported) by the full path
                    self._drop(plan)
                    return None
                # taken once nothing can abort the replay before it writes: no RAM hit counted twice
                held = ram.get_all([row.id for _, _, row in plan.chunks]) if ram is not None else None
                try:
                    read_all(plan, views, tiers, held, ram, cold)
                except (Unreadable, OSError):
                    self._drop(plan)
                    return Replay(None, tiers, touched=True)
            self.replays += 1
            return Replay(plan, tiers)
        finally:
            with self._lock:
                plan.busy -= 1
                if plan.dead and plan.busy == 0 and plan.fds:
                    _close(plan.fds)
                    plan.fds = ()

    @staticmethod
    def _views(plan: HotPlan, into: Mapping[str, Any]) -> list[memoryview] | None:
        """Each destination's bytes, if it is the array the plan was made for and still fits it."""
        views = []
        for (ref, shape, dtype), obj in zip(plan.dests, into.values()):
            a = ref()
            if a is None or a is not obj or a.shape != shape or a.dtype != dtype:
                return None
            flags = a.flags
            if not (flags.c_contiguous and flags.writeable):
                return None
            views.append(a.reshape(-1).view(np.uint8).data)
        return views

    def learn(self, key: HotKey | None, wal: bytes | None, snap: SnapRow, plan: RestorePlan,
              into: Mapping[str, Any]) -> None:
        """After a successful full restore: keep its plan on the second restore with ``key`` (``wal``:
        the WAL-index header read before its plan), if it is one a replay can do."""
        if key is None or plan.stamp is None or not _replayable(plan, into):
            return
        arrays = tuple(into.values())
        with self._lock:
            if key in self._plans:
                return
            seen = self._seen.pop(key, None)
            # the same arrays, not others at the same addresses: a key holds id()s, and an engine that
            # allocates per request may get a freed array's id for the next one
            if seen is None or len(seen) != len(arrays) or any(r() is not a for r, a in zip(seen, arrays)):
                self._seen[key] = tuple(weakref.ref(a) for a in arrays)
                if len(self._seen) > _SEEN:
                    self._seen.popitem(last=False)
                return
        built = self._build(key, wal, snap, plan, into)
        if built is None:
            return
        with self._lock:
            old = self._plans.pop(key, None)
            self._plans[key] = built
            dropped = [old] if old is not None else []
            held = sum(p.nbytes for p in self._plans.values())
            while len(self._plans) > 1 and (len(self._plans) > _MAX_PLANS or held > _MAX_HELD):
                gone = self._plans.popitem(last=False)[1]
                held -= gone.nbytes
                dropped.append(gone)
        for p in dropped:
            self._drop(p)
        if self._files is not None:  # the plan holds its own: the full path's slots go back
            self._files.forget(row.id for _, _, row in built.chunks)

    def _build(self, key: HotKey, wal: bytes | None, snap: SnapRow, plan: RestorePlan,
               into: Mapping[str, Any]) -> HotPlan | None:
        """Open the plan's chunk files, each header checked against its row; None if one fails."""
        assert plan.stamp is not None  # learn() keeps only plans made from the memo
        ids = list(dict.fromkeys(item.chunk.id for item in plan.items))
        if not take_descriptors(len(ids)):
            return None
        fds: dict[bytes, int] = {}
        heads: list[tuple[int, bytes, int]] = []
        try:
            for item in plan.items:
                cid = item.chunk.id
                if cid in fds:
                    continue
                fd, st = open_chunk(self._blob_path(cid))
                fds[cid] = fd
                raw = os.pread(fd, HEADER_SIZE, 0)
                head = parse_header(raw)
                if head.codec != CODEC_RAW or not header_matches(head, item.chunk.raw_len, item.chunk.checksum,
                                                                 st.st_size):
                    raise Unreadable(cid.hex())
                heads.append((fd, raw, st.st_size))
        except Exception:  # gone, damaged, out of descriptors: the full path goes on finding it
            _close(tuple(fds.values()))
            give_descriptors(len(ids) - len(fds))
            return None
        names = list(into)
        chunks = []
        for item in plan.items:
            d, off, n = names.index(item.sink.name), item.offset, item.chunk.raw_len
            pieces = tuple((HEADER_SIZE + k, d, off + k, off + min(n, k + _STEP)) for k in range(0, n, _STEP))
            chunks.append((fds[item.chunk.id], pieces, item.chunk))
        dests = tuple((weakref.ref(a), a.shape, a.dtype) for a in into.values())
        return HotPlan(key, wal, plan.stamp, dests, tuple(chunks), tuple(fds.values()), tuple(heads),
                       snap, plan.n_tokens, dict(plan.rows), frozenset(plan.missing_components), list(plan.chain),
                       plan.nbytes)

    def advance(self, stamp: Stamp) -> None:
        """A plan of this process read a newer catalog stamp: drop the plans made under older ones
        (:meth:`snapstore.catalog.chain_cache.ChainCache.on_move`)."""
        with self._lock:
            stale = [p for p in self._plans.values() if p.stamp != stamp]
        for p in stale:
            self._drop(p)

    def _drop(self, plan: HotPlan) -> None:
        """Forget ``plan``; its files close now, or when its last replay in flight ends."""
        with self._lock:
            if self._plans.get(plan.key) is plan:
                del self._plans[plan.key]
            plan.dead = True
            if plan.busy == 0 and plan.fds:
                _close(plan.fds)
                plan.fds = ()

    def close(self) -> None:
        """Close every kept file (the store closes)."""
        with self._lock:
            plans = list(self._plans.values())
        for p in plans:
            self._drop(p)
        self._wal.close()

    def __len__(self) -> int:
        return len(self._plans)


def _replayable(plan: RestorePlan, into: Mapping[str, Any]) -> bool:
    """Can a replay do ``plan``: raw chunks into whole rows of C-contiguous, writable numpy arrays,
    small enough that fixed costs matter?"""
    if not plan.items or len(plan.items) > _MAX_CHUNKS or plan.nbytes > _MAX_BYTES:
        return False
    for a in into.values():
        if type(a) is not np.ndarray or not (a.flags.c_contiguous and a.flags.writeable):
            return False
    return all(type(item.sink) is Sink and item.sink.mv is not None and item.skip == 0
               and item.chunk.codec == CODEC_RAW and item.sink.name in into for item in plan.items)
