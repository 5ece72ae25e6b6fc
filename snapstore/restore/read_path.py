"""The cold-read path chosen by measurement (issue 48): buffered reads or O_DIRECT, whichever this
store's storage serves faster.

Which way of reading a chunk file that is not in the page cache is fastest depends on the storage:
on one VM's virtio disk O_DIRECT with several reads in flight ran 1.0-1.4x faster than a buffered
read, on another 2.7x slower (docs/benchmarks.md); a local NVMe or a network volume differs again.
No fixed choice is right everywhere, so the store measures the methods (:data:`CANDIDATES`) on its
own storage and reads cold chunks the fastest way. A RAM tier is never a reason to read slower: the
choice is the measured fastest, and O_DIRECT wins only when it is clearly ahead (:data:`DIRECT_EDGE`),
since a buffered read also leaves the pages cached for the next restore; the reason kept with a
direct choice says what that costs (the probe's figure for a read from the page cache).

The probe (:func:`measure`) writes one temp file in the store's ``tmp/`` (a crash leaves it to gc),
fsyncs it, and in each of a few rounds drops its pages (``posix_fadvise(DONTNEED)``: clean pages
leave) and reads it back once per method, in a rotating order; each method's median rate counts.
It reads nothing the store holds and evicts no one else's pages.

When: only a restore that read at least :data:`PROBE_AFTER` cold bytes starts it, on a background
thread, after the restore returned (until then, and on a store that cannot write, cold reads are
buffered, as before). Small restores are unaffected either way (their chunks go buffered). The
choice is kept in the catalog (``read_paths``, migration 0014), keyed by the storage (device and
file system of the store directory, :func:`storage_key`), and measured again when the store is on
another storage (moved or copied), after :data:`REMEASURE_S`, or when the store's measured cold
restore rate (:mod:`snapstore.restore.rates`) drifted more than :data:`DRIFT` times either way from
what it was when the choice was made. ``direct_reads=True/False`` (``SNAPSTORE_DIRECT_READS=1/0``)
forces a method and measures nothing.

The probe's file is one it has just written, and a cache below the page cache (a VM host's, a
disk's) may still hold it when the store's restores, of data saved long before, find nothing there:
on the issue-48 VM buffered reads of a just-written file ran 2.5x faster than of one saved seconds
earlier, O_DIRECT's nearly the same. So the store's own large cold restores time the method in force
too, under the method their cold bytes were read with, the other method is tried on one of them
(:mod:`snapstore.restore.read_timing`), and once both are timed they decide (:func:`rechoose`). Their
figures are kept with the choice (``restored: <method>`` keys); a new probe starts them afresh.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from snapstore._errors import SnapstoreError, StateError
from snapstore._forks import track
from snapstore.catalog.rate_queries import ReadPathRow
from snapstore.chunks.direct_io import ALIGN, O_DIRECT, DirectReads
from snapstore.chunks.repo import Repo
from snapstore.restore.read_choice import (
    BUFFERED,
    CACHED,
    CANDIDATES,
    DIRECT_EDGE,
    RESTORED,
    RESTORED_EDGE,
    Candidate,
    Measured,
    candidate,
    choose,
    rechoose,
)
from snapstore.restore.read_probe import FREE_MARGIN, PROBE_BYTES, PROBE_ROUNDS, measure
from snapstore.restore.read_timing import ALL_COLD, Timings
from snapstore.restore.tier_probe import TierBytes

__all__ = ["BUFFERED", "CACHED", "CANDIDATES", "DIRECT_EDGE", "DRIFT", "PROBE_AFTER", "PROBE_BYTES", "PROBE_ROUNDS",
           "REMEASURE_S", "RESTORED", "RESTORED_EDGE", "Candidate", "Measured", "ReadPaths", "choose", "measure",
           "rechoose", "scaled_cold", "storage_key"]

PROBE_AFTER = 64 << 20  # cold bytes one restore must read before the store measures (smaller: it cannot matter much)
REMEASURE_S = 7 * 86400.0  # a choice older than this is measured again (a host's disk, its cache, change)
DRIFT = 2.0  # cold restores this many times faster or slower than at the choice: measured again
_TRIAL_RESTORES = 64  # restores a trial waits for a large cold one to time it, then ends untimed
_RETRY_S = 600.0  # one process measures at most this often (a failed or stopped probe included)


def storage_key(path: str) -> str:
    """The storage ``path`` is on: its device and file system id, in hex (``st_dev:f_fsid``)."""
    st = os.stat(path)
    try:
        fsid = os.statvfs(path).f_fsid
    except (OSError, AttributeError):
        fsid = 0
    return f"{st.st_dev:x}:{fsid:x}"


def _figures(row: ReadPathRow) -> dict[str, float]:
    """A row's figures (name -> bytes/s); none where its JSON is not such a map."""
    try:
        return {str(k): float(v) for k, v in json.loads(row.figures).items()}
    except (ValueError, AttributeError, TypeError):
        return {}


def scaled_cold(cold: float, rates: dict[str, float], chosen: Candidate, was: Candidate) -> float:
    """The store's cold restore rate ``cold``, measured reading with ``was``, as expected with ``chosen``
    (by ``rates``: the probe's or the restores'); the figure drift is judged against."""
    now, before = rates.get(chosen.name, 0.0), rates.get(was.name, 0.0)
    return float(cold) * (now / before if now > 0.0 and before > 0.0 else 1.0)


def _best_direct(figures: dict[str, float]) -> Candidate | None:
    """The O_DIRECT method the probe found fastest by a row's ``figures`` (None: refused everywhere,
    or not measured)."""
    best = max((c for c in CANDIDATES if c.method == "direct"), key=lambda c: figures.get(c.name, 0.0))
    return best if figures.get(best.name, 0.0) > 0.0 and O_DIRECT != 0 else None


def _dump(probe: dict[str, float], timed: dict[str, float]) -> str:
    """The figures a row keeps: the probe's, and the store's own restores' under :data:`RESTORED` keys."""
    return json.dumps({k: round(v) for k, v in probe.items()} | {RESTORED + k: round(v) for k, v in timed.items()},
                      sort_keys=True)


class ReadPaths(DirectReads):
    """A store's cold-read method: forced (``forced`` True/False), else the one measured on its
    storage (loaded from the catalog at open, measured in the background when none fits)."""

    def __init__(self, forced: bool | None, ram_tier: bool = True, *, reserve: int | None = None,
                 background: bool = True):
        super().__init__(bool(forced))
        self.forced = forced
        # the free space a probe leaves (the store's Budget.reserve_bytes); background False (a store
        # with a write budget: its writes are the operator's to pace): never measured unasked
        self.reserve = FREE_MARGIN if reserve is None else max(0, int(reserve))
        self.background = background
        # without a RAM tier the page cache is the only copy a next restore can read from memory, and an
        # O_DIRECT read leaves none: such a store reads buffered unless forced (measured all the same)
        self.ram_tier = ram_tier
        self.key = ""  # the storage the store directory is on (storage_key)
        self.row: ReadPathRow | None = None  # the measured choice in force (None: buffered, unmeasured)
        self._cold_rate: Callable[[], float] = lambda: 0.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._tried = 0.0  # monotonic time this process last started a probe (0: never)
        # the store's own large cold restores per method (issue 48): the choice follows them once both are timed
        self._timings = Timings()
        self._unkept: ReadPathRow | None = None  # a choice the restores made, not yet written to the catalog
        self._trial: Candidate | None = None  # the method on trial (in force until a large cold restore times it)
        self._trial_left = 0  # restores the trial may still wait for one that times it
        track(self)

    def _after_fork_in_child(self) -> None:
        """A forked child: the parent's probe thread is not here."""
        self._lock = threading.Lock()
        self._thread, self._stop = None, False

    def load(self, root: str, rows: Iterable[ReadPathRow], cold_rate: Callable[[], float] | None = None) -> None:
        """At open: the storage ``root`` is on, and the choice the catalog holds for it (``rows``);
        ``cold_rate``: the store's measured cold restore rate now (bytes/s, 0 unmeasured), for drift."""
        if cold_rate is not None:
            self._cold_rate = cold_rate
        try:
            self.key = storage_key(root)
        except OSError:
            self.key = ""
        for row in rows:
            if row.storage == self.key:
                self.apply(row)

    def apply(self, row: ReadPathRow) -> None:
        """Read cold chunks as ``row`` says (a forced setting wins; a method this version does not know:
        buffered); its figures of the store's own restores (:data:`RESTORED` keys) seed a method not timed here."""
        with self._lock:
            self._apply(row)

    def _apply(self, row: ReadPathRow) -> None:
        """:meth:`apply`, under the lock: ends a trial, and begins one when due (:meth:`_try_other`)."""
        self.row = row
        self._timings.seed(_figures(row))
        self._trial = None
        kept = candidate(row.method, row.threads, row.piece)
        self._use(kept)
        self._try_other(kept, row)

    def _try_other(self, kept: Candidate, row: ReadPathRow) -> None:
        """Begin a trial of the method not in force (under the lock) when the restores have timed the
        one in force and one is due (:mod:`snapstore.restore.read_timing`): the probe's fastest O_DIRECT
        method, unless the probe found it under half the buffered figure (beyond what a cache below
        the page cache makes of buffered reads); buffered again only once the restores timed it (a
        probe that chose O_DIRECT, buffered figure and all, leaves nothing for a trial to find)."""
        timed = self._timings.medians()
        if kept.name not in timed:
            return
        if kept.method == "direct":
            other = BUFFERED if BUFFERED.name in timed else None
        else:
            figures = _figures(row)
            other = _best_direct(figures)
            if other is not None and figures.get(other.name, 0.0) * DIRECT_EDGE < figures.get(BUFFERED.name, 0.0):
                other = None
        if other is not None and self.ram_tier and self.forced is None and not self.refused \
                and self._timings.trial_due(other.name):
            self._trial, self._trial_left = other, _TRIAL_RESTORES
            self._use(other)  # the next large cold restore times the method not in force

    def _use(self, c: Candidate) -> None:
        """Read cold chunks with ``c`` from now on, as far as this store may (under the lock): not when
        forced or refused, and O_DIRECT only with a RAM tier."""
        if self.forced is not None or self.refused:
            return
        direct = c.method == "direct" and O_DIRECT != 0 and c.threads > 0 and c.piece >= ALIGN and self.ram_tier
        self.on = direct
        if direct:
            self.threads, self.piece = c.threads, c.piece

    def stale(self, now: float | None = None) -> str | None:
        """Why the choice should be measured (again), or None: no choice for this storage, an old one,
        or cold restores that drifted :data:`DRIFT` times from the rate they had at the choice."""
        if self.forced is not None or not self.key:
            return None
        row = self.row
        if row is None:
            return "not measured on this storage yet"
        t = time.time() if now is None else now
        if t - row.measured > REMEASURE_S:
            return f"measured {(t - row.measured) / 86400:.0f} days ago"
        # the restores' own figure for the method in force where they timed it (the store-wide fit mixes
        # the methods its restores read with), else the fit
        with self._lock:  # Timings is the lock's (a timed restore on another thread may be adding to it)
            timed = self._timings.medians().get(candidate(row.method, row.threads, row.piece).name)
        cold = timed or self._cold_rate()
        if row.cold_rate > 0.0 and cold > 0.0 and not 1.0 / DRIFT <= cold / row.cold_rate <= DRIFT:
            return (f"cold restores drifted from {row.cold_rate / 1e9:.2f} to {cold / 1e9:.2f} GB/s "
                    "since the choice")
        return None

    def restored(self, repo: Repo, tiers: TierBytes | None, seconds: float = 0.0, direct: int = 0) -> None:
        """After a successful restore that read ``tiers`` in ``seconds`` (``direct`` of its bytes with
        O_DIRECT): if it read at least :data:`PROBE_AFTER` cold bytes, start the background probe when
        the choice is missing or stale (never on a read-only store), else time the method it read
        with (:meth:`_timed_by`)."""
        if self._trial is not None:
            self._count_trial()
        if tiers is None or tiers.get("cold", 0) < PROBE_AFTER or self.forced is not None:
            return
        if not repo.readonly and self.background and self.stale() is not None:
            with self._lock:
                now = time.monotonic()
                if self._thread is None and not self._stop and not (self._tried and now - self._tried < _RETRY_S):
                    self._tried = now
                    self._thread = threading.Thread(target=self._probe, args=(repo,), name="snapstore-read-probe",
                                                    daemon=True)
                    self._thread.start()
                    return
        self._timed_by(repo, tiers, seconds, direct)

    def _count_trial(self) -> None:
        """One more restore under a trial: it ends untimed after :data:`_TRIAL_RESTORES` (a process that
        restores nothing large and cold does not keep the method not chosen)."""
        with self._lock:
            if self._trial is None or self.row is None:
                return
            self._trial_left -= 1
            if self._trial_left <= 0:
                self._trial = None
                self._use(candidate(self.row.method, self.row.threads, self.row.piece))

    def _timed_by(self, repo: Repo, tiers: TierBytes, seconds: float, direct: int) -> None:
        """Time the method a large, nearly all-cold restore read with, choose again by the store's own
        restores (:func:`rechoose`) and begin a trial of the other method when one is due
        (:mod:`snapstore.restore.read_timing`). A change applies at once and is kept in the catalog off
        this thread, as is a method's first figure (not on a read-only store, nor one with a write budget)."""
        cold = tiers.get("cold", 0)
        if seconds <= 0.0 or cold < ALL_COLD * sum(tiers.get(t, 0) for t in ("ram", "warm", "cold")) \
                or not self.ram_tier or self.refused:
            return  # without a RAM tier the store reads buffered whatever is chosen (_use)
        with self._lock:
            row = self.row
            if row is None:
                return
            used = BUFFERED if direct == 0 else Candidate("direct", self.threads, self.piece) \
                if direct >= ALL_COLD * cold else None
            if used is None:
                return  # read both ways: it times neither
            figures = _figures(row)
            new_figure = RESTORED + used.name not in figures
            self._timings.add(used.name, cold / seconds)
            kept = candidate(row.method, row.threads, row.piece)
            timed = self._timings.medians()
            chosen, reason = rechoose(timed, kept) or (kept, row.reason)
            if chosen != kept or new_figure:
                probe = {k: v for k, v in figures.items() if not k.startswith(RESTORED)}
                # cold_rate: the restores' own figure for the method chosen (what drift is judged by)
                row = ReadPathRow(row.storage, chosen.method, chosen.threads, chosen.piece, _dump(probe, timed),
                                  reason, timed[chosen.name] if chosen != kept else row.cold_rate,
                                  row.measured)  # measured: when the probe measured
                self._unkept = row
            if chosen != kept:
                self._apply(row)  # a new choice: a trial in flight is moot
            else:
                self.row = row
                if self._trial is not None and used == self._trial:  # the trial timed: over
                    self._trial = None
                    self._use(kept)
                if self._trial is None:  # a restore begun before a trial does not end it
                    self._try_other(kept, row)
            self._keep_unkept(repo)

    def _keep_unkept(self, repo: Repo) -> None:
        """Write the choice the restores made, off the restore's thread (under the lock); one that
        finds the writer busy stays pending for the next timed restore."""
        row = self._unkept
        if row is None or repo.readonly or not self.background or self._thread is not None or self._stop:
            return
        self._unkept = None
        self._thread = threading.Thread(target=self._keep, args=(repo, row), name="snapstore-read-path", daemon=True)
        self._thread.start()

    def _keep(self, repo: Repo, row: ReadPathRow) -> None:
        """Write ``row`` (best effort: it is used in memory either way; a failed write is pending again)."""
        try:
            repo.write(lambda t: t.set_read_path(row), durable=False)
        except (OSError, SnapstoreError):
            with self._lock:
                self._unkept = self._unkept or row
        finally:
            with self._lock:
                self._thread = None

    def _probe(self, repo: Repo) -> None:
        """The background probe: measure, keep, use; any failure leaves the current choice (retried later).
        One prober per store directory at a time: the processes sharing it take turns on an flock of its
        ``tmp/`` directory (no file of its own), and one that finds it held measures nothing now."""
        try:
            with contextlib.suppress(OSError, SnapstoreError), self._only_prober(repo.tmp) as mine:
                if mine:
                    self.measure_now(repo)
        finally:
            with self._lock:
                self._thread = None

    @staticmethod
    @contextlib.contextmanager
    def _only_prober(tmp_dir: str) -> Iterator[bool]:
        """Whether this process holds the store's probe turn (an flock on ``tmp_dir``, released on exit)."""
        fd = os.open(tmp_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def measure_now(self, repo: Repo, size: int | None = None,
                    rounds: int | None = None) -> tuple[ReadPathRow, Measured]:
        """Measure the methods on ``repo``'s storage now (a ``size``-byte probe, default :data:`PROBE_BYTES`,
        ``rounds`` reads each, default :data:`PROBE_ROUNDS`), use the fastest and keep it in the catalog;
        StateError on a read-only store (the probe writes a temp file). ``snapstore bench`` calls it;
        restores call it in the background (:meth:`restored`)."""
        if repo.readonly:
            raise StateError(f"{repo.root} is open read-only: the read-path probe writes a temp file; "
                             "open it writable to measure")
        got = measure(repo.tmp, PROBE_BYTES if size is None else size, PROBE_ROUNDS if rounds is None else rounds,
                      stop=lambda: self._stop, reserve=self.reserve)
        key = self.key or storage_key(repo.root)
        # the cold rate drift is judged against: the store's, scaled from the method it was measured with
        # to the one chosen (switching methods is no drift)
        was = candidate(self.row.method, self.row.threads, self.row.piece) if self.row is not None else BUFFERED
        row = ReadPathRow(key, got.chosen.method, got.chosen.threads, got.chosen.piece, _dump(got.rates, {}),
                          got.reason, scaled_cold(self._cold_rate(), got.rates, got.chosen, was), time.time())
        repo.write(lambda t: t.set_read_path(row), durable=False)
        self.key = key
        with self._lock:  # a new probe: the store's restores are timed afresh (the storage may have changed)
            self._timings.clear()
            self._unkept = None
            self._apply(row)
        return row, got

    def stop(self) -> None:
        """Abandon a probe in flight and wait for its thread (the store is closing)."""
        with self._lock:
            self._stop = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def describe(self) -> dict[str, object]:
        """What the store reads cold chunks with, and why (``snapstore bench``)."""
        if self.forced is not None:
            how = "direct" if self.on else "buffered"
            return {"method": how, "threads": self.threads, "piece": self.piece, "why": "set by direct_reads= / "
                    f"SNAPSTORE_DIRECT_READS ({'on' if self.forced else 'off'})", "measured": None, "figures": {}}
        row = self.row
        if row is None:
            return {"method": "buffered", "threads": BUFFERED.threads, "piece": BUFFERED.piece,
                    "why": "not measured on this storage yet: buffered until a large cold restore (or "
                    "`snapstore bench`) measures it", "measured": None, "figures": {}}
        figures = _figures(row)
        why = row.reason
        if row.method == "direct" and not self.on and not self.ram_tier:
            why = ("buffered: this store has no RAM tier (ram_bytes=0), so the page cache is the only copy its next "
                   f"restore can read from memory, and O_DIRECT would leave none (measured: {row.reason})")
        trial = self._trial
        if trial is not None:
            why = f"trying {trial.name} on the next large cold restore (the choice: {row.reason})"
        return {"method": "direct" if self.on else "buffered", "threads": self.threads if self.on else BUFFERED.threads,
                "piece": self.piece if self.on else BUFFERED.piece, "why": why, "measured": row.measured,
                "figures": figures, "storage": row.storage}
