"""The reference model's records: saved snapshots, names, export files, the moved clock."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st


@dataclass
class _Saved:
    conv: int
    n: int
    fixed_seed: int
    session: str | None
    pending: bool
    components: frozenset[str | None]
    order: int = 0  # when it was committed: supersede looks at what was committed before
    shared: bool = False  # restored from outside its session: supersede must never take it away
    namespace: str | None = None
    foreign: bool = False  # state another identity computed (imported under an override, or saved over one)


@dataclass
class _Name:
    sid: int
    expires: float | None  # on the machine's clock; None: never


@dataclass
class _File:
    """An export file the machine wrote: what its chain must restore to, and where it came from."""

    path: str
    chain: tuple[_Saved, ...]  # root first: the leaf is the exported snapshot
    foreign_identity: bool  # exported by the foreign store (another identity): importing it needs the override
    name: str | None

    @property
    def saved(self) -> _Saved:
        return self.chain[-1]


def _digest(parts: Mapping[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in parts.items()}


class _Clock:
    """The process's ``time.time`` moved forward in steps (the store reads no other wall clock):
    TTLs, name ``ttl_s`` and the write-rate refill age as if that much time had passed."""

    def __init__(self) -> None:
        self.offset = 0.0
        self._real: Any = None

    def install(self) -> None:
        if self._real is None:
            self._real = time.time
            real = self._real
            time.time = lambda: real() + self.offset

    def uninstall(self) -> None:
        if self._real is not None:
            time.time = self._real
            self._real = None

    def now(self) -> float:
        return time.time()


NAMESPACES = (None, "tenant-b")
NAMES = ("plan", "doc", "tool")
#: fixed-part seeds: few, so the same state is saved again (dedup), and by both identities (the pairs
#: of 46A item 5: a native save beside an override import of the same state)
SEEDS = st.integers(0, 3) | st.integers(0, 2**16)
_MARGIN = 120.0  # seconds of real time a run may take between a step and the check of a deadline


class _Abandon(Exception):
    """Raised inside a turn to leave it by an exception (the turn abandons its captures)."""
