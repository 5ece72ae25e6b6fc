"""The bridge's background saver: one thread that stores copied slot files, so no request waits for a save.

A save copies the slot out at once (the server writes the slot file) and queues the bytes here;
the slot is then free for the conversation's next request. The queue is bounded
(``Storer.DEPTH``): when saving falls that far behind, a new save is dropped (the caller counts
it) rather than holding memory or a request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Storer"]

log = logging.getLogger("snapstore.engine.llamacpp")


class Storer:
    """Runs ``work(job)`` for each queued job on one thread, in order; ``on_drop(job)`` when full."""

    DEPTH = 16

    def __init__(self, work: Callable[[Any], None], on_drop: Callable[[Any], None]) -> None:
        self._work = work
        self._on_drop = on_drop
        self._q: queue.Queue[Any] = queue.Queue(self.DEPTH)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="snapstore-llama-storer", daemon=True)
            self._thread.start()

    def put(self, job: Any) -> None:
        """Queue ``job``; run it here when the thread is not started (a bridge used without start())."""
        if self._thread is None:
            self._work(job)
            return
        try:
            self._q.put_nowait(job)
        except queue.Full:
            self._on_drop(job)

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every queued job is done (tests, shutdown)."""
        done = threading.Event()
        if self._thread is None:
            return
        self._q.put(done, timeout=timeout)
        done.wait(timeout)

    def stop(self) -> None:
        """Finish the queued jobs and end the thread."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                self._work(job)
            except Exception:  # a bug in one save must not end the saver (the work logs its own failures)
                log.exception("background save failed")
