"""Numeric arguments of the public API: the one check every number a caller passes goes through.

A number is what ``numbers.Integral`` (a count, a byte size) or ``numbers.Real`` (seconds, a rate)
accepts — Python and numpy scalars alike (``np.int64(2000)``, ``np.float32(2000)``). Refused, with
an error naming the argument: ``bool`` (an int to Python, never a meaningful count), strings and
other objects, a float where a count is asked, nan and ±inf, and values past the bounds — an
integer past SQLite's INTEGER range and a real too large for a float (``10**400``) included, so no
raw ``OverflowError`` or ``TypeError`` escapes later.
"""

from __future__ import annotations

import math
import numbers
import threading

from snapstore._errors import InvalidInputError, SnapstoreError

__all__ = ["MAX_INT", "integer", "optional_integer", "optional_real", "real", "wait_seconds"]

MAX_INT = 2**63 - 1  # SQLite's INTEGER range: every count or size the store records fits it


def _bounds(low: float | None, above: float | None, high: float | None) -> str:
    parts = []
    if low is not None:
        parts.append(f">= {low:g}" if isinstance(low, float) else f">= {low}")
    if above is not None:
        parts.append(f"> {above:g}" if isinstance(above, float) else f"> {above}")
    if high is not None:
        parts.append(f"<= {high}" if high != MAX_INT else "< 2**63")
    return " and ".join(parts)


def integer(value: object, what: str, *, minimum: int | None = None, maximum: int | None = MAX_INT,
            err: type[SnapstoreError] = InvalidInputError) -> int:
    """``value`` as an int when it is an integer (``numbers.Integral``, not bool) within
    [``minimum``, ``maximum``]; else ``err`` naming ``what`` and what it must be."""
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value  # the common case, on every call's path: no message built
    want = " ".join(filter(None, ["an integer", _bounds(minimum, None, maximum)]))
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise err(f"{what} must be {want}, got {value!r}" + (
            " (a bool is not a count)" if isinstance(value, bool) else ""))
    n = int(value)
    if (minimum is not None and n < minimum) or (maximum is not None and n > maximum):
        raise err(f"{what} must be {want}, got {n if abs(n) < 10**30 else f'an integer of {len(str(abs(n)))} digits'}")
    return n


def real(value: object, what: str, *, minimum: float | None = None, above: float | None = None,
         maximum: float | None = None, unit: str = "", err: type[SnapstoreError] = InvalidInputError) -> float:
    """``value`` as a finite float when it is a real number (``numbers.Real``, not bool) that a float
    holds, >= ``minimum`` / > ``above`` / <= ``maximum``; else ``err`` naming ``what``."""
    want = " ".join(filter(None, [f"a finite number{' of ' + unit if unit else ''}", _bounds(minimum, above, maximum)]))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise err(f"{what} must be {want}, got {value!r}" + (
            " (a bool is not a number here)" if isinstance(value, bool) else ""))
    try:
        x = float(value)
    except (OverflowError, ValueError, TypeError):  # 10**400; a Real whose __float__ fails
        raise err(f"{what} must be {want}, got a value too large for a float") from None
    if not math.isfinite(x) or (minimum is not None and x < minimum) or (above is not None and x <= above) or \
            (maximum is not None and x > maximum):
        raise err(f"{what} must be {want}, got {value!r}")
    return x


def optional_integer(value: object, what: str, *, minimum: int | None = None, maximum: int | None = MAX_INT,
                     err: type[SnapstoreError] = InvalidInputError) -> int | None:
    """:func:`integer`, or None for None (the argument's default)."""
    return None if value is None else integer(value, what, minimum=minimum, maximum=maximum, err=err)


def optional_real(value: object, what: str, *, minimum: float | None = None, above: float | None = None,
                  maximum: float | None = None, unit: str = "",
                  err: type[SnapstoreError] = InvalidInputError) -> float | None:
    """:func:`real`, or None for None (the argument's default)."""
    return None if value is None else real(value, what, minimum=minimum, above=above, maximum=maximum, unit=unit,
                                           err=err)


def wait_seconds(value: object, what: str = "timeout") -> float | None:
    """A wait's timeout: None or ``math.inf`` (no limit) or seconds >= 0 (InvalidInputError otherwise),
    capped at the longest wait the platform takes (``threading.TIMEOUT_MAX``, ~49 days here)."""
    if isinstance(value, float) and value == math.inf:
        return None
    limit = optional_real(value, what, minimum=0.0, unit="seconds")
    return None if limit is None else min(limit, threading.TIMEOUT_MAX)
