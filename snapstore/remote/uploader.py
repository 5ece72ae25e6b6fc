"""The background upload queue of the shared tier: bounded, off the engine's critical path.

``save()`` enqueues the snapshot id once its local copy is durable and returns; one worker thread
publishes queued snapshots to the bucket in order. A full queue drops the new id (counted as
``remote_dropped``) rather than block the engine: the snapshot stays in the local tier and the
next save of a descendant uploads its chain. :meth:`Uploader.flush` waits until everything
enqueued so far is published (or failed).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from snapstore._errors import RemoteError, SnapstoreError

__all__ = ["FlushResult", "Uploader", "flush_all"]


@dataclass(frozen=True)
class FlushResult:
    """What the uploads since the previous flush did: snapshots published, failed, dropped."""

    uploaded: int = 0
    failed: int = 0
    dropped: int = 0
    errors: list[str] = field(default_factory=list)
    timed_out: bool = False  # the timeout ran out first: what is in flight goes on in the background

    @property
    def ok(self) -> bool:
        """True when everything finished and nothing failed or was dropped."""
        return not self.failed and not self.dropped and not self.timed_out

    def __bool__(self) -> bool:
        """False only when the timeout ran out before everything in flight finished."""
        return not self.timed_out


class Uploader:
    """A bounded FIFO of snapshot ids and the one thread that publishes them."""

    def __init__(self, publish: Callable[[int], None], count: Callable[[str, int], None], maxsize: int = 256):
        self._publish = publish
        self._count = count
        self._maxsize = maxsize
        self._q: deque[int] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._uploaded = self._failed = self._dropped = 0
        self._errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="snapstore-upload", daemon=True)
        self._thread.start()

    def enqueue(self, sid: int) -> bool:
        """Queue a snapshot for upload; False (and counted) when the queue is full or closed."""
        with self._cv:
            if self._stop or len(self._q) >= self._maxsize:
                self._dropped += 1
                self._count("remote_dropped", 1)
                return False
            if sid not in self._q:
                self._q.append(sid)
            self._cv.notify_all()
            return True

    def pending(self) -> tuple[int, int]:
        """(snapshots queued, uploads in flight) right now."""
        with self._cv:
            return len(self._q), int(self._busy)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stop:
                    self._cv.wait()
                if not self._q:
                    return
                sid = self._q.popleft()
                self._busy = True
            err: str | None = None
            try:
                self._publish(sid)
            except SnapstoreError as e:
                err = f"snapshot {sid}: {e}"
            except Exception as e:  # the worker must survive anything one upload raises
                err = f"snapshot {sid}: {type(e).__name__}: {e}"
            with self._cv:
                self._busy = False
                if err is None:
                    self._uploaded += 1
                else:
                    self._failed += 1
                    self._errors = (self._errors + [err])[-16:]
                    self._count("remote_upload_errors", 1)
                self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Wait until the queue is empty and no upload is in flight; what happened since the last flush."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RemoteError(110, f"flush: {len(self._q) + self._busy} uploads still pending after "
                                           f"{timeout} s; they continue in the background")
                self._cv.wait(left)
            res = FlushResult(self._uploaded, self._failed, self._dropped, list(self._errors))
            self._uploaded = self._failed = self._dropped = 0
            self._errors = []
            return res

    def close(self, timeout: float | None = None) -> FlushResult:
        """Finish what is queued (up to ``timeout``), then stop the worker."""
        try:
            return self.flush(timeout)
        finally:
            with self._cv:
                self._stop = True
                self._q.clear()
                self._cv.notify_all()
            self._thread.join(timeout=5)


def flush_all(saves: Callable[[float | None], bool], uploads: Callable[[float | None], FlushResult],
              timeout: float | None) -> FlushResult:
    """``Store.flush``: wait for the saves made with ``wait=False`` (``saves(timeout)``), then for the
    shared tier's uploads (``uploads``: its flush) within what is left of ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not saves(timeout):
        return FlushResult(timed_out=True)
    try:
        return uploads(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except RemoteError as e:
        if e.errno != 110:  # ETIMEDOUT: the uploads go on in the background
            raise
        return FlushResult(timed_out=True, errors=[str(e)])

