"""One MLX PrefixCache call's pending captures: chains of snapshots saved on a worker thread.

A capture's parts are host copies made on the caller's thread (MLX arrays are read there, never on
the worker), so the model reads on while the worker writes them. At most one save is in flight:
memory stays bounded by one capture's copies, and each capture's parent is the one saved before it
in the same store. A call whose captures span two layouts (a KV cache quantized from
``quantized_kv_start`` on) keeps one chain per store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from snapstore import NotFoundError, SaveResult, Store, StoreIOError

__all__ = ["Captures"]

log = logging.getLogger("snapstore.engine.prefix_cache")


class Captures:
    """One call's pending captures; ``results`` holds (store, SaveResult) in save order."""

    def __init__(self, parents: dict[int, int | None], namespace: str | None, count: Callable[..., None]):
        self.parents = parents  # id(store) -> the snapshot the next capture in that store is a delta over
        self.namespace = namespace
        self.count = count
        self.results: list[tuple[Store, SaveResult]] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def add(self, store: Store, tokens: list[int], parts: dict[str, np.ndarray], session: str | None) -> None:
        """Save ``parts`` (the state after ``tokens``) as a pending capture, on the worker thread."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(store, list(tokens), parts, session),
                                        name="snapstore-mlx-capture", daemon=True)
        self._thread.start()

    def _run(self, store: Store, tokens: list[int], parts: dict[str, Any], session: str | None) -> None:
        try:
            res = self._save(store, tokens, parts, session)
        except BaseException as e:  # handed to the caller's thread by wait()
            self._error = e
            return
        if res is not None and res.ok:
            self.results.append((store, res))
            self.parents[id(store)] = res.snapshot_id
            self.count(captures=1)

    def _save(self, store: Store, tokens: list[int], parts: dict[str, Any], session: str | None) -> SaveResult | None:
        """One pending capture; a failing disk skips it (counted), it does not fail the call."""
        kw: dict[str, Any] = {"commit": False, "session": session, "namespace": self.namespace}
        try:
            try:
                res = store.save(tokens, parts, parent=self.parents.get(id(store)), **kw)
            except NotFoundError:  # the parent was evicted meanwhile: store this capture whole
                res = store.save(tokens, parts, parent=None, **kw)
        except StoreIOError as e:
            log.warning("prefix cache: capture at %d tokens failed (%s); continuing without it", len(tokens), e)
            self.count(skipped=1)
            return None
        if not res.ok:
            self.count(skipped=1)
        return res  # type: ignore[no-any-return]  # Store.save(wait=True) is a SaveResult

    def wait(self) -> None:
        """Wait for the save in flight; re-raise its error here, in the caller's thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def drain(self) -> None:
        """Wait for the save in flight, dropping its error (the call is failing already)."""
        try:
            self.wait()
        except BaseException as e:
            log.warning("prefix cache: a capture failed while the call was failing: %s", e)

    def chains(self) -> list[tuple[Store, list[SaveResult]]]:
        """The captures grouped by store, each chain in save order."""
        by: dict[int, tuple[Store, list[SaveResult]]] = {}
        for store, res in self.results:
            by.setdefault(id(store), (store, []))[1].append(res)
        return list(by.values())
