"""The vLLM engine's prefill rate as its scheduler sees it, for ``match(prefill_tokens_per_s=)``.

The scheduler-side connector is called once per engine step (``build_connector_meta``) with the
tokens the step computes; the time until the next call is that step's forward. Steps of at least
``min_tokens`` tokens are prefill-dominated and are timed (decode-only steps would measure
batch latency, not a rate); a gap longer than ``max_gap_s`` is the engine idling between
requests, not computing, and is dropped. Works without vLLM (plain numbers in, a rate out).
"""

from __future__ import annotations

import time

from snapstore import PrefillRate

__all__ = ["StepRate"]


class StepRate:
    """Tokens scheduled per step over the time until the next step (decayed, :class:`snapstore.PrefillRate`)."""

    def __init__(self, *, min_tokens: int = 64, max_gap_s: float = 5.0) -> None:
        self._rate = PrefillRate(min_tokens=min_tokens)
        self._max_gap = max_gap_s
        self._last: tuple[float, int] | None = None

    def step(self, scheduled_tokens: int, now: float | None = None) -> None:
        """A step begins that computes ``scheduled_tokens``: the previous one ended now."""
        t = time.perf_counter() if now is None else now
        if self._last is not None and t - self._last[0] <= self._max_gap:
            self._rate.observe(self._last[1], t - self._last[0])
        self._last = (t, int(scheduled_tokens))

    @property
    def tokens_per_s(self) -> float | None:
        """The measured rate, or None before a prefill step was timed."""
        return self._rate.tokens_per_s
