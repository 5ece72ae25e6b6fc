"""``ProbeTrace``: what the identity's K/V probe left in llama-server's ``/metrics`` and ``/slots``, taken out
of what the proxy serves.

The probe (``_served.identify``) must run a task: only the server's own computation shows the
runtime settings it does not report (RoPE base and scaling, YaRN, control vectors, K/V numerics).
Its slot's cache is put back after it, so no client's ``cache_n`` changes; but a task leaves two
traces the server cannot undo — its counters (``llamacpp:prompt_tokens_total``, ``n_decode_total``,
...) and its slot's last task in ``/slots``. The proxy takes both out of what it serves, so a
client of the proxy sees the server as if the probe never ran:

* counters: the server's ``/metrics`` is read just before and just after the probe; the
  difference of every ``llamacpp:*_total`` counter is subtracted from what the server reports
  later (all probes summed). ``n_busy_slots_per_decode`` (busy slots over decode calls) is
  recomputed without the probe's decodes. ``n_tokens_max`` is shown as it was before the probe
  while the server reports the probe's value (from then on a client request made it larger).
  The read just after the probe also resets the server's throughput window, so the throughput
  gauges never include the probe.
* ``/slots``: the probe slot's entry as it was before the probe, while the server still shows the
  probe's task there (and while the probe runs).

A client that asks llama-server directly still sees the probe (docs/cli.md).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

from ._upstream import LlamaServer, UpstreamError

__all__ = ["ProbeTrace"]

_BUSY = "llamacpp:n_busy_slots_per_decode"
_DECODES = "llamacpp:n_decode_total"
_MAX = "llamacpp:n_tokens_max"


def _series(text: str) -> dict[str, float]:
    """``llamacpp:*`` sample values of a Prometheus text page (no labels in llama-server's)."""
    out = {}
    for ln in text.splitlines():
        if ln.startswith("llamacpp:"):
            parts = ln.split()
            if len(parts) == 2:
                try:
                    out[parts[0]] = float(parts[1])
                except ValueError:
                    pass
    return out


def _like(value: float) -> str:
    """``value`` as llama-server writes its samples (a C++ stream's default: 6 significant digits, ``%g``)."""
    return f"{value:g}"


class ProbeTrace:
    """The probes' traces in one llama-server process, and the views of ``/metrics`` and ``/slots`` without them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delta: dict[str, float] = {}  # counter -> what the probes added
        self._busy = 0.0  # busy-slot decodes the probes added (n_busy_slots_per_decode's numerator)
        self._max: tuple[float, float] | None = None  # n_tokens_max before the first probe, and after the last
        self._slots: dict[int, tuple[Any, Any]] = {}  # slot -> (entry before its probe, probe task id or None)
        self._running: dict[int, Any] = {}  # slot -> entry before the probe now running in it
        self._process = ""  # the server process the traces are of (/props media_marker: random per process)
        self._seen: dict[str, float] = {}  # the counters just after the last probe: lower later = another process

    def _reset(self) -> None:
        """Another server process: its counters and slots carry no probe of ours yet."""
        self._delta.clear()
        self._busy, self._max = 0.0, None
        self._slots.clear()
        self._seen = {}

    @contextlib.contextmanager
    def around(self, server: LlamaServer, slot: int, process: str) -> Iterator[None]:
        """Record what the block (the probe in ``slot``, and putting the slot back) adds to the counters
        of the server process ``process`` and to its ``/slots`` entry for ``slot``."""
        with self._lock:
            if process != self._process:
                self._reset()
                self._process = process
        metrics = self._metrics(server)
        entry = self._entry(server, slot)
        with self._lock:
            self._running[slot] = entry
        try:
            yield
        finally:
            after, now = self._metrics(server), self._entry(server, slot)
            with self._lock:
                self._running.pop(slot, None)
                if metrics is not None and after is not None:
                    self._add(metrics, after)
                    self._seen = after
                if entry is not None and now is not None:
                    earlier = self._slots.get(slot)
                    shown = earlier[0] if earlier is not None and earlier[1] == entry.get("id_task") else entry
                    self._slots[slot] = (shown, now.get("id_task"))

    @staticmethod
    def _metrics(server: LlamaServer) -> dict[str, float] | None:
        try:
            return _series(server.get_text("/metrics"))
        except UpstreamError:  # started without --metrics: nothing to take out
            return None

    @staticmethod
    def _entry(server: LlamaServer, slot: int) -> Any:
        try:
            slots = server.get_any("/slots", "the probe slot's entry")
        except UpstreamError:  # started without --slots
            return None
        return next((s for s in slots if isinstance(s, dict) and s.get("id") == slot), None)

    def _add(self, before: dict[str, float], after: dict[str, float]) -> None:
        for k, v in after.items():
            if k.endswith("_total") and k in before:
                self._delta[k] = self._delta.get(k, 0.0) + v - before[k]
        if _BUSY in before and _BUSY in after and _DECODES in before and _DECODES in after:
            self._busy += after[_BUSY] * after[_DECODES] - before[_BUSY] * before[_DECODES]
        if _MAX in before and _MAX in after:
            first = self._max[0] if self._max is not None else before[_MAX]
            self._max = (first, after[_MAX])

    def metrics(self, text: str) -> str:
        """llama-server's ``/metrics`` page without the probes' counts."""
        with self._lock:
            if not self._delta and self._max is None:
                return text
            live = _series(text)
            if any(live.get(k, v) < v for k, v in self._seen.items() if k.endswith("_total")):
                return text  # counters went back: another server process, whose counts carry no probe yet
            out = []
            for ln in text.splitlines(keepends=True):
                parts = ln.split()
                if len(parts) == 2 and parts[0] in live:
                    fixed = self._fixed(parts[0], live)
                    if fixed is not None:
                        ln = f"{parts[0]} {_like(fixed)}" + ("\n" if ln.endswith("\n") else "")
                out.append(ln)
            return "".join(out)

    def _fixed(self, name: str, live: dict[str, float]) -> float | None:
        if name in self._delta:
            return max(0.0, live[name] - self._delta[name])
        if name == _MAX and self._max is not None and live[name] == self._max[1]:
            return self._max[0]
        if name == _BUSY and _DECODES in live and _DECODES in self._delta:
            decodes = live[_DECODES] - self._delta[_DECODES]
            return (live[name] * live[_DECODES] - self._busy) / decodes if decodes > 0 else 0.0
        return None

    def slots(self, body: bytes) -> bytes:
        """llama-server's ``/slots`` body with each probe slot's entry as it was before its probe, while
        the server still shows the probe's task there; the body unchanged when nothing is to be hidden."""
        with self._lock:
            if not self._slots and not self._running:
                return body
            try:
                slots = json.loads(body)
            except ValueError:
                return body
            if not isinstance(slots, list):
                return body
            changed = False
            for i, s in enumerate(slots):
                if not isinstance(s, dict):
                    continue
                sid = s.get("id")
                if sid in self._running and self._running[sid] is not None:
                    slots[i], changed = self._running[sid], True
                elif sid in self._slots and s.get("id_task") == self._slots[sid][1]:
                    slots[i], changed = self._slots[sid][0], True
            return json.dumps(slots, separators=(",", ":"), ensure_ascii=False).encode() if changed else body
