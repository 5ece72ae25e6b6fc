"""Restore or recompute: which stored prefix of a prompt to restore, given the engine's prefill rate.

Serving a prompt of N tokens from a prefix of n tokens costs ``restore(n) + (N - n) / R``; reading
it all costs ``N / R``. So a prefix is worth restoring when it *saves* time, ``n / R - restore(n) > 0``,
and the best one saves the most — which may be a shorter snapshot in a faster tier (a root in the
RAM tier rather than its leaf on a cold disk, a local prefix rather than a longer shared-tier one),
or none at all (a prefill faster than the disk: the reports of issue 32). Ties go to the longest.

The prefixes come longest first and their estimates are computed lazily: once even a free restore of
the next prefix (``n / R``) could not beat the best saving found, the search stops. It stops too
once the best found costs at most :data:`GOOD_ENOUGH` of the time it saves: every shorter prefix
saves less than a free restore of the best's tokens would, so none could save more than that
fraction more, and the estimates are no finer than that (within 2x of measured, issue 32). That is
the usual case — a warm system prompt restores in a few per cent of its prefill — and it spares a
scheduler's lookup the search for the next prefix (half its time, issue 31). Where even an upper
bound on the restore of the first prefix that saves time (its bytes at the slowest local tier's
cost) is that cheap, it is taken on the bound and its chunk files are not probed at all: the probes
could only lower the estimate, never change the choice (a weighed lookup's opens and probes, issue
31's eighth pass). At
most :data:`MAX_CONSIDERED` are weighed (each costs a plan and a probe of its chunk files).

:class:`PrefillRate` is what an engine integration keeps of its own prefill timings to pass as ``R``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from snapstore._numbers import integer, real
from snapstore._results import Considered, RecomputeDecision, RestoreEstimate

__all__ = ["GOOD_ENOUGH", "MAX_CONSIDERED", "PrefillRate", "check_rate", "decide"]

MAX_CONSIDERED = 8
GOOD_ENOUGH = 0.1  # a restore costing at most this fraction of what it saves is taken without weighing shorter ones

# (snapshot id, tokens, its estimate given the seconds under which an upper bound may answer; None: skip it)
Option = tuple[int, int, Callable[[float], RestoreEstimate | None]]


def check_rate(rate: object) -> float:
    """``prefill_tokens_per_s`` as a positive finite float, or InvalidInputError."""
    return real(rate, "prefill_tokens_per_s", above=0.0, unit="tokens per second")


def decide(options: Iterable[Option], rate: float, limit: int = MAX_CONSIDERED) -> RecomputeDecision:
    """Weigh ``options`` (longest first) at ``rate`` prefill tokens per second; see the module docstring."""
    considered: list[Considered] = []
    best: Considered | None = None
    for sid, n, estimate in options:
        if len(considered) >= limit or (best is not None and n / rate <= best.saved_s):
            break  # no shorter prefix can save more than the best found, even restored for free
        # a first choice that restores within ``sure`` seconds is taken below whatever its exact cost, so
        # an upper bound under it answers as well as probing its chunks would (restore/rates.py, bound)
        # (a hair under the limit: a bound that passes here passes the test below despite rounding)
        est = estimate(GOOD_ENOUGH * n / rate / (1.0 + GOOD_ENOUGH) * (1.0 - 1e-9) if best is None else 0.0)
        if est is None:
            continue  # gone since it matched (evicted, deleted): not a choice
        c = Considered(sid, n, est, n / rate - est.seconds)
        considered.append(c)
        if c.saved_s > 0 and (best is None or c.saved_s > best.saved_s):
            best = c
            if est.seconds <= GOOD_ENOUGH * c.saved_s:
                break  # a shorter prefix saves less than n / rate = saved + est: at most a tenth more
    return RecomputeDecision(rate, tuple(considered), best.snapshot_id if best is not None else None,
                             _reason(considered, best, rate))


def _reason(considered: list[Considered], best: Considered | None, rate: float) -> str:
    def said(c: Considered) -> str:
        e = c.estimate
        guess = "" if e.measured else ", a guess"
        where = f"in at most ~{e.seconds * 1e3:.1f} ms from any tier" if e.bound else \
            f"in ~{e.seconds * 1e3:.1f} ms from {e.tier}"
        return (f"{c.n_tokens} tokens restore {where}{guess} vs "
                f"~{c.n_tokens / rate * 1e3:.1f} ms to read at {rate:.0f} tokens/s")

    if not considered:
        return "no stored prefix to weigh"
    if best is None:
        return f"recompute: reading is faster than any restore ({said(considered[0])})"
    if best is considered[0]:
        return f"restore the longest prefix: {said(best)}"
    return f"restore a shorter prefix, it saves the most: {said(best)}; the longest: {said(considered[0])}"


class PrefillRate:
    """An engine's measured prefill rate (tokens per second), from its own timings.

    ``observe(tokens, seconds)`` after each prefill pass; ``tokens_per_s`` is the ratio of
    exponentially decayed sums (the last ~``1 / (1 - decay)`` passes count; long prefills weigh the
    most), None until a pass of at least ``min_tokens`` was seen — too short a pass times the
    per-call overhead, not the rate. Thread-safe.
    """

    def __init__(self, *, decay: float = 0.8, min_tokens: int = 16) -> None:
        self._decay = real(decay, "decay", minimum=0.0, maximum=1.0)
        self._min = integer(min_tokens, "min_tokens", minimum=0)
        self._tokens = self._seconds = 0.0
        self._lock = threading.Lock()

    def observe(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` tokens that took ``seconds`` (a pass too short to time is passed over)."""
        tokens = integer(tokens, "tokens", minimum=0)
        seconds = real(seconds, "seconds", minimum=0.0, unit="seconds")
        if tokens < self._min or not seconds > 0:
            return
        with self._lock:
            self._tokens = self._tokens * self._decay + tokens
            self._seconds = self._seconds * self._decay + seconds

    @property
    def tokens_per_s(self) -> float | None:
        """The rate, or None before any pass was measured."""
        with self._lock:
            return self._tokens / self._seconds if self._seconds > 0 else None
