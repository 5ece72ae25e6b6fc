"""One PrefixCache call's pending captures: a chain of snapshots saved on a worker thread while the model reads on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from snapstore import Layout, LayoutError, SaveResult

from ._cache import CacheSnapshot, snapshot

if TYPE_CHECKING:
    from transformers import DynamicCache


__all__ = ["Captures", "SaveCapture"]

#: saves one pending capture: (tokens, parts, snapshot, parent, session, namespace) -> its result, or
#: None when the capture was skipped (``PrefixCache._save``)
SaveCapture = Callable[[list[int], dict[str, Any], CacheSnapshot, "int | None", "str | None", "str | None"],
                       "SaveResult | None"]

log = logging.getLogger("snapstore.engine.prefix_cache")


class Captures:
    """One call's pending captures, a chain saved on a worker thread while the model reads on.

    A capture references the cache's K/V row tensors (transformers appends by concatenation, so
    rows already there never change) and clones its fixed parts (linear-attention state is updated
    in place by the next forward). At most one save is in flight: memory stays bounded by one
    clone of the fixed parts, and each capture's parent is the one saved before it.
    """

    def __init__(self, layout: Layout, save: SaveCapture, saved: Callable[[], None], parent: int | None,
                 namespace: str | None):
        self.layout, self._save, self._saved = layout, save, saved  # the store's layout; PrefixCache._save, its count
        self.parent, self.namespace = parent, namespace
        self.results: list[SaveResult] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def add(self, cache: DynamicCache, tokens: list[int], session: str | None) -> None:
        """Capture the cache after ``tokens`` (a pending delta over the previous capture, or the restore)."""
        self.wait()
        snap = snapshot(cache)
        if snap.layout != self.layout:
            raise LayoutError("the cache's layout differs from the store's (batch size or model changed?)")
        if snap.n_tokens != len(tokens):
            raise LayoutError(f"the cache holds {snap.n_tokens} tokens, the capture names {len(tokens)}")
        fixed = snap.layout.fixed
        parts = {k: v.clone() if k in fixed and isinstance(v, torch.Tensor) else v for k, v in snap.parts.items()}
        self._thread = threading.Thread(target=self._run, args=(list(tokens), parts, snap, session),
                                        name="snapstore-prefix-capture", daemon=True)
        self._thread.start()

    def _run(self, tokens: list[int], parts: dict[str, Any], snap: CacheSnapshot, session: str | None) -> None:
        try:
            res = self._save(tokens, parts, snap, self.parent, session, self.namespace)
        except BaseException as e:  # handed to the caller's thread by wait()
            self._error = e
            return
        if res is not None and res.ok:
            self.results.append(res)
            self.parent = res.snapshot_id
            self._saved()

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
