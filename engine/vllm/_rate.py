"""The vLLM engine's prefill rate, from the forwards themselves, for ``match(prefill_tokens_per_s=)``.

A step's time is measured on the worker, around the model's forward (:class:`ForwardClock`: from
the moment the step's connector metadata is bound to the moment its saves begin, less the time the
connector's own loads took inside that window; on a CUDA device with events, which time the kernels
and not their launch). The scheduler says in each step's metadata how many of its tokens are prompt
tokens (:func:`prefill_tokens`: decode and speculative tokens are not); the worker sends back
(prefill tokens, seconds) of each step that prefilled with its worker metadata, and the scheduler
feeds them to a decayed :class:`snapstore.PrefillRate` (:class:`StepRate`). Idle time between
requests and decode-only steps never enter the rate: they are not inside a timed forward, or not
a prefill. Works without vLLM (plain numbers in, a rate out)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from snapstore import PrefillRate

__all__ = ["ForwardClock", "StepRate", "prefill_tokens"]


def prefill_tokens(scheduled: Mapping[str, int], computed: Mapping[str, int], prompt_len: Mapping[str, int]) -> int:
    """Prompt tokens a step computes: per request, its scheduled tokens that lie below its prompt's
    end (``computed``: tokens it had before the step). A request in decode (or one whose prompt
    length is unknown) adds none."""
    total = 0
    for rid, n in scheduled.items():
        left = prompt_len.get(rid, 0) - computed.get(rid, 0)
        if left > 0:
            total += min(int(n), left)
    return total


class StepRate:
    """The scheduler's rate: (prefill tokens, forward seconds) of steps that prefilled, as the
    workers measured them (decayed sums, :class:`snapstore.PrefillRate`; a step of fewer than
    ``min_tokens`` prompt tokens times the step's overhead, not a rate, and is left out)."""

    def __init__(self, *, min_tokens: int = 64) -> None:
        self._rate = PrefillRate(min_tokens=min_tokens)

    def observe(self, tokens: int, seconds: float) -> None:
        """One step's forward: ``tokens`` prompt tokens computed in ``seconds``."""
        self._rate.observe(int(tokens), float(seconds))

    @property
    def tokens_per_s(self) -> float | None:
        """The measured rate, or None before a prefill step was timed."""
        return self._rate.tokens_per_s


class ForwardClock:
    """The worker's timer of each step's forward: :meth:`begin` when the step's metadata is bound
    (just before the forward, or before the loads that precede it), :meth:`loaded` with the seconds
    the connector's loads took inside the window, :meth:`end` when the saves begin (after the
    forward). :meth:`take` returns the finished steps' (prefill tokens, seconds). ``device``: a
    CUDA device times the window with events (its kernels run after the host returns); any other
    device with ``clock``."""

    def __init__(self, device: Any = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._cuda = getattr(device, "type", None) == "cuda"
        self._open: tuple[int, Any, float] | None = None  # (prefill tokens, start, load seconds)
        self._pending: list[tuple[int, Any, Any, float]] = []  # CUDA: (tokens, start event, end event, load s)
        self._done: list[tuple[int, float]] = []

    def _mark(self) -> Any:
        if not self._cuda:
            return self._clock()
        import torch

        ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ev.record()
        return ev

    def begin(self, tokens: int) -> None:
        """A step that prefills ``tokens`` prompt tokens is about to run (0: a step that prefills none,
        not timed)."""
        self._open = (int(tokens), self._mark(), 0.0) if tokens > 0 else None

    def loaded(self, seconds: float) -> None:
        """The connector's loads took ``seconds`` inside the open window: not forward time."""
        if self._open is not None:
            self._open = (self._open[0], self._open[1], self._open[2] + seconds)

    def end(self) -> None:
        """The forward of the open step is over (its saves begin)."""
        if self._open is None:
            return
        tokens, start, load_s = self._open
        self._open = None
        if self._cuda:
            self._pending.append((tokens, start, self._mark(), load_s))
        else:
            self._done.append((tokens, max(0.0, self._clock() - start - load_s)))

    def take(self) -> list[tuple[int, float]]:
        """The (prefill tokens, forward seconds) of the steps finished since the last call (a CUDA
        step once its kernels have run: no call waits for the device)."""
        still = []
        for tokens, a, b, load_s in self._pending:
            if b.query():
                self._done.append((tokens, max(0.0, a.elapsed_time(b) / 1000.0 - load_s)))
            else:
                still.append((tokens, a, b, load_s))
        self._pending = still
        out, self._done = self._done, []
        return out
