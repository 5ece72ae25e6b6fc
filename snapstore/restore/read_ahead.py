"""Reader threads that run a restore's read jobs ahead of the thread that checks them, in order.

Job ``j`` starts only once the checker is through with job ``j - depth`` (at most ``depth`` jobs
read or being read but not yet checked, which bounds the buffers a job may use), and ``stop()``
returns only once every thread is idle: after a restore raises, nothing writes into the
destination any more. preadv and numpy copies release the GIL, so the threads overlap the checker.

Which thread runs a job is its *lane* (``lanes[j]``; by default ``j % threads``). Each thread runs
its lane's jobs in order, so the job the checker waits for never waits behind another: no lane
assignment can deadlock. Buffered restores give every job of one file the same lane, so each file
is read sequentially (its page-cache readahead intact) while the next file is already being read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

__all__ = ["ReadAhead"]


class ReadAhead:
    """Runs ``work(j)`` for j in ``range(jobs)`` on ``threads`` threads, at most ``depth`` ahead of the checker."""

    def __init__(self, jobs: int, work: Callable[[int], None], depth: int, threads: int,
                 lanes: Sequence[int] | None = None):
        self._jobs = jobs
        self._lanes = [j % threads for j in range(jobs)] if lanes is None else [lane % threads for lane in lanes]
        assert len(self._lanes) == jobs
        self._work = work
        self._depth = depth
        self._ready = [False] * jobs
        self._errors: dict[int, BaseException] = {}
        self._cv = threading.Condition()
        self._checked = 0
        self._stop = False
        self.started = False  # some destination bytes may have been written
        self._threads = [threading.Thread(target=self._run, args=(t,), name="snapstore-restore",
                                          daemon=True) for t in range(threads)]
        for th in self._threads:
            th.start()

    def _run(self, lane: int) -> None:
        for j in (j for j, own in enumerate(self._lanes) if own == lane):
            with self._cv:
                while j >= self._checked + self._depth and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                self.started = True
            try:
                self._work(j)
            except BaseException as e:  # handed to the checker, which raises it in order
                self._errors[j] = e
            with self._cv:
                self._ready[j] = True
                self._cv.notify_all()

    def wait(self, j: int) -> None:
        """Block until job ``j`` is done; raise what doing it raised."""
        with self._cv:
            while not self._ready[j]:
                self._cv.wait()
        err = self._errors.pop(j, None)
        if err is not None:
            raise err

    def done(self) -> None:
        """The checker is through with one more job: another may start."""
        with self._cv:
            self._checked += 1
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for th in self._threads:
            th.join()
