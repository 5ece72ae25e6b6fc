"""The prefix-cache policy shared by the transformers and MLX PrefixCaches, without torch.

Where a call cuts its prompt (``positions`` of ``cache_prefix`` and every multiple of the
boundary), the default boundary for a layout, and the per-call counters ``stats()`` returns.
Kept free of torch so that ``snapstore.engine.mlx`` can use it on a machine without torch.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, SupportsIndex, TypeGuard, Union

from snapstore import InvalidInputError, Layout, Stats

__all__ = ["COUNTERS", "CachePrefix", "PrefixCacheStats", "check_boundary", "cuts", "default_boundary",
           "positions"]

DEFAULT_BOUNDARY = 8192  # the boundary hybrid engines in the field snapshot at
SEGMENT_BYTES = 2 << 30  # a default boundary segment holds at most this many bytes of rows
MIN_BOUNDARY = 512

CachePrefix = Union[int, Iterable[int], None]
"""Positions a call snapshots exactly at: one, several, or none."""

COUNTERS = ("calls", "hits", "misses", "prompt_tokens", "restored_tokens", "prefilled_tokens", "captures",
            "committed", "abandoned", "skipped", "restore_fallbacks", "restore_seconds", "bypassed",
            "identity_changes")


@dataclass(frozen=True)
class PrefixCacheStats:
    """What a PrefixCache did since it was opened (per call, not per store lookup), plus the store's Stats."""

    calls: int
    hits: int
    misses: int
    prompt_tokens: int
    restored_tokens: int
    prefilled_tokens: int
    captures: int
    committed: int
    abandoned: int
    skipped: int
    restore_fallbacks: int
    restore_seconds: float
    bypassed: int
    identity_changes: int
    store: Stats

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


def default_boundary(layout: Layout) -> int:
    """8192 tokens, halved (down to 512) while one boundary segment's rows would exceed 2 GiB.

    A boundary snapshot stores the segment's K/V rows plus the fixed state; bigger per-token
    state means a shorter segment, so a resume never re-reads more than ~2 GiB worth of rows.
    """
    b = DEFAULT_BOUNDARY
    bpt = int(layout.bytes_per_token)
    while b > MIN_BOUNDARY and b * bpt > SEGMENT_BYTES:
        b //= 2
    return b


def check_boundary(boundary: object) -> None:
    """Refuse a boundary that is not None, 0 (off) or a positive int (ConfigError)."""
    from snapstore import ConfigError

    if boundary is not None and (isinstance(boundary, bool) or not isinstance(boundary, int) or boundary < 0):
        raise ConfigError(f"boundary must be None, 0 (off) or a positive number of tokens, got {boundary!r}")


def positions(cache_prefix: CachePrefix) -> list[int]:
    """cache_prefix as a list of positive ints (None, an int, or an iterable of ints)."""
    if cache_prefix is None:
        return []
    vals: object = [cache_prefix] if _is_int(cache_prefix) else cache_prefix
    if isinstance(vals, (str, bytes)) or not isinstance(vals, Iterable):
        raise InvalidInputError(f"cache_prefix must be an int or a list of ints, got {cache_prefix!r}")
    out = []
    for v in vals:
        if not _is_int(v) or operator.index(v) < 1:
            raise InvalidInputError(f"cache_prefix positions must be ints >= 1, got {v!r}")
        out.append(operator.index(v))
    return out


def cuts(n_tokens: int, boundary: int, cache_prefix: CachePrefix = None) -> list[int]:
    """Every multiple of ``boundary`` (0: none) and every ``cache_prefix`` position below ``n_tokens``, sorted."""
    out = {p for p in positions(cache_prefix) if p < n_tokens}
    if boundary:
        out.update(range(boundary, n_tokens, boundary))
    return sorted(out)


def _is_int(v: object) -> TypeGuard[SupportsIndex]:
    """An integer (numpy and 0-d integer tensors too), not a bool."""
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)  # type: ignore[arg-type]  # the probe: anything without __index__ raises
    except TypeError:
        return False
    return True
