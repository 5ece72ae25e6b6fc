"""Shared by the shared-tier tests and their node processes: identity, layout, deterministic state."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

import snapstore

LAYOUT = snapstore.Layout(fixed={"st": snapstore.Fixed("float32", (8, 8))},
                          rows={"kv": snapstore.Rows("float16", (2, 64))})  # 256 bytes a row


def identity(build: str = "eng-remote-1") -> snapstore.Identity:
    """The identity every test node runs as."""
    return snapstore.Identity(build=build, pack="sha256:remote-tests", kv="f16")


def state(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, kv rows, fixed state) of a prompt of ``n`` tokens, the same in every process."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, n, dtype=np.int64)
    kv = rng.standard_normal((n, 2, 64)).astype(np.float16)
    st = rng.standard_normal((8, 8)).astype(np.float32)
    return tokens, kv, st


def expected(seed: int, n: int, n_max: int) -> tuple[str, str]:
    """sha256 of the kv rows [0, n) and of the fixed part a save of length ``n`` stored."""
    _t, kv, st = state(seed, n_max)
    return hashlib.sha256(kv[:n].tobytes()).hexdigest(), hashlib.sha256((st + n).tobytes()).hexdigest()


def restore_in_background(store: snapstore.Store, m: snapstore.Match,
                          dest: Mapping[str, Any]) -> tuple[threading.Thread, list[object]]:
    """Start ``store.restore(m, dest)`` on a thread (for faults injected while it runs); the list
    receives its RestoreResult or the SnapstoreError it raised."""
    outcome: list[object] = []

    def restore() -> None:
        try:
            outcome.append(store.restore(m, dest))
        except snapstore.SnapstoreError as e:
            outcome.append(e)

    t = threading.Thread(target=restore)
    t.start()
    return t, outcome
