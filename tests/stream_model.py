"""A late-execution model of CUDA streams and events, and a real-CUDA harness with the same test API.

Written from CUDA's stream semantics, not from the adapter:

- work queued on a stream (a ``non_blocking`` copy, a "kernel") runs in that stream's order, and
  only when something forces it: ``event.synchronize()`` of an event recorded after it,
  ``stream.synchronize()``, a device ``synchronize()``, or a later-forced stream that waits on it
  (``wait_stream`` is a barrier: work queued after it runs only after everything the other stream
  had queued at that moment). That is as late as a real GPU may run it.
- independent streams have no order between them: a device synchronise interleaves them in a
  seeded random order.
- page-locked host memory handed out by :meth:`LateCuda.empty_host` is filled with a poison byte
  (like a debug allocator), so bytes nobody copied are visible.
- a host memcpy between staging and the core's buffer (``host_copy``) that touches host memory a
  queued, not yet run copy still reads or writes is recorded in :attr:`LateCuda.hazards` — a race
  on real hardware, whatever bytes it happened to produce here. So does staging memory the core
  is lent to read or fill in place (``lend``) while a queued copy still writes (or reads) it.
- host memcpys between staging and the core's own buffers are counted (:attr:`LateCuda.host_copies`),
  and so are the halves lent to the core instead (:attr:`LateCuda.lent_reads` / ``lent_fills``).

"Device" tensors are CPU tensors registered with the model (:meth:`LateCuda.to_device`); the
adapter recognises them through ``is_device``. Fault injection: ``fail_at = n`` makes the n-th
queued copy raise ``torch.OutOfMemoryError`` (a device temporary that could not be allocated);
``on_copy`` is called (outside the model's lock) before every queued copy, to pause a thread there.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CudaHarness", "LateCuda", "LateEvent", "LateStream"]

POISON = 0xA5


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The host address range a tensor view covers (first byte, one past the last)."""
    if t.numel() == 0:
        return (0, 0)
    lo = t.data_ptr()
    hi = lo + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 1) * t.element_size() \
        + t.element_size()
    return (lo, hi)


def _overlaps(a: tuple[int, int] | None, b: tuple[int, int]) -> bool:
    return a is not None and a[0] < b[1] and b[0] < a[1]


@dataclass
class _Op:
    fn: Callable[[], None]
    reads_host: tuple[int, int] | None = None
    writes_host: tuple[int, int] | None = None


class LateStream:
    """A stream whose queued work runs only when forced, in queue order."""

    def __init__(self, model: LateCuda, name: str):
        self.model = model
        self.name = name
        self.device = torch.device("cpu")
        self.ops: deque[_Op] = deque()
        self.queued = 0  # ops ever queued
        self.done = 0  # ops run (or running)

    def __repr__(self) -> str:
        return f"<LateStream {self.name} {self.done}/{self.queued}>"

    def enqueue(self, op: _Op) -> None:
        """Queue work (it runs when forced)."""
        with self.model.lock:
            self.ops.append(op)
            self.queued += 1

    def run_until(self, mark: int) -> None:
        """Run queued work up to the ``mark``-th op (barriers force the streams they wait on)."""
        with self.model.lock:
            while self.done < mark:
                op = self.ops.popleft()
                self.done += 1
                op.fn()

    def wait_stream(self, other: LateStream) -> None:
        """Work queued on this stream from now on runs after everything ``other`` has queued so far."""
        if other is self:
            return
        with self.model.lock:
            m = other.queued
            self.enqueue(_Op(lambda: other.run_until(m)))

    def wait_event(self, ev: LateEvent) -> None:
        """Work queued from now on runs after the work ``ev`` was recorded behind."""
        s, m = ev.stream, ev.mark
        if s is not None and s is not self:
            self.enqueue(_Op(lambda: s.run_until(m)))

    def synchronize(self) -> None:
        """Block until everything queued so far has run."""
        self.run_until(self.queued)

    def query(self) -> bool:
        """True when nothing queued is pending."""
        return self.done >= self.queued


class LateEvent:
    """An event: complete once the work queued on its stream before ``record`` has run."""

    def __init__(self, model: LateCuda):
        self.model = model
        self.stream: LateStream | None = None
        self.mark = 0

    def record(self, stream: LateStream | None = None) -> None:
        """Mark the current end of ``stream``'s queue (default: the current stream)."""
        s = stream if stream is not None else self.model.current
        with self.model.lock:
            self.stream, self.mark = s, s.queued

    def synchronize(self) -> None:
        """Block until the recorded work has run (an unrecorded event is complete)."""
        if self.stream is not None:
            self.stream.run_until(self.mark)

    def query(self) -> bool:
        """True when the recorded work has run."""
        return self.stream is None or self.stream.done >= self.mark


class LateCuda:
    """The backend the adapter's device seam expects, with late execution (see the module doc)."""

    name = "late"

    def __init__(self, seed: int = 0):
        self.lock = threading.RLock()
        self.rng = random.Random(seed)
        self.compute = LateStream(self, "compute")
        self.streams: list[LateStream] = [self.compute]
        self._tls = threading.local()
        self._device_storage: set[int] = set()
        self.hazards: list[str] = []
        self.copies = 0
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.pinned_allocs = 0
        self.host_copies = 0  # host_copy calls: a memcpy between staging and the core's buffer
        self.lent_reads = 0  # halves the core read in place (save)
        self.lent_fills = 0  # halves the core filled in place (restore)
        self.fail_at: int | None = None
        self.on_copy: Callable[[int], None] | None = None

    # -- the backend API (engine/torch/_device.py) -----------------------------------------------
    def is_device(self, t: torch.Tensor) -> bool:
        """True for tensors made by :meth:`to_device` / :meth:`empty` (and views of them)."""
        return t.untyped_storage().data_ptr() in self._device_storage and t.untyped_storage().nbytes() > 0

    def available(self) -> bool:
        """Staging is "page-locked" (handed out by :meth:`empty_host`)."""
        return True

    def new_stream(self, device: torch.device) -> LateStream:
        """A new side stream."""
        with self.lock:
            s = LateStream(self, f"side{len(self.streams)}")
            self.streams.append(s)
            return s

    @property
    def current(self) -> LateStream:
        """The calling thread's current stream (the compute stream unless inside :meth:`use`)."""
        return getattr(self._tls, "stream", None) or self.compute

    def current_stream(self, device: torch.device | None = None) -> LateStream:
        """The calling thread's current stream."""
        return self.current

    @contextmanager
    def use(self, stream: LateStream) -> Iterator[None]:
        """Make ``stream`` current in this thread for the block."""
        prev = getattr(self._tls, "stream", None)
        self._tls.stream = stream
        try:
            yield
        finally:
            self._tls.stream = prev

    def event(self) -> LateEvent:
        """A fresh event."""
        return LateEvent(self)

    def empty_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A poisoned host buffer (counted when "pinned")."""
        if pin:
            self.pinned_allocs += 1
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the current stream; it runs when forced."""
        self.copies += 1
        n = self.copies
        if self.on_copy is not None:
            self.on_copy(n)
        if self.fail_at is not None and n == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the stream model)")
        d_dev, s_dev = self.is_device(dst), self.is_device(src)
        nbytes = dst.numel() * dst.element_size()
        if s_dev and not d_dev:
            self.d2h_bytes += nbytes
        elif d_dev and not s_dev:
            self.h2d_bytes += nbytes
        def run() -> None:
            dst.copy_(src)

        op = _Op(run, reads_host=None if s_dev else _span(src),
                 writes_host=None if d_dev else _span(dst))
        self.current.enqueue(op)

    def _check_host(self, dst: tuple[int, int] | None, src: tuple[int, int] | None) -> None:
        """Record a hazard if queued work still reads ``dst`` or writes ``dst`` / ``src``."""
        for s in self.streams:
            for op in s.ops:
                if dst is not None and _overlaps(op.reads_host, dst):
                    self.hazards.append(f"host overwrote memory a queued copy on {s.name} still reads")
                if (dst is not None and _overlaps(op.writes_host, dst)) or (
                        src is not None and _overlaps(op.writes_host, src)):
                    self.hazards.append(f"host touched memory a queued copy on {s.name} still writes")

    def host_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A host memcpy now; record a hazard if queued work still reads/writes that memory."""
        with self.lock:
            self.host_copies += 1
            self._check_host(_span(dst), _span(src))
            dst.copy_(src)

    def lend(self, half: torch.Tensor, write: bool) -> None:
        """The core reads (or fills) staging memory in place: a hazard if queued work still uses it."""
        with self.lock:
            if write:
                self.lent_fills += 1
                self._check_host(_span(half), None)
            else:
                self.lent_reads += 1
                self._check_host(None, _span(half))

    # -- the test API --------------------------------------------------------------------
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A "device" copy of a CPU tensor (same shape and strides)."""
        d = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        d.copy_(t)
        self._device_storage.add(d.untyped_storage().data_ptr())
        return d

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0x3C) -> torch.Tensor:
        """A "device" tensor of garbage bytes."""
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        d = torch.full((max(n, 1),), fill, dtype=torch.uint8)[:n].view(dtype).view(shape)
        self._device_storage.add(d.untyped_storage().data_ptr())
        return d

    def new_engine_stream(self) -> LateStream:
        """A stream the engine runs its own kernels on."""
        return self.new_stream(torch.device("cpu"))

    def launch(self, fn: Callable[[], None], stream: LateStream | None = None) -> None:
        """Queue a "kernel" (e.g. ``lambda: t.zero_()``) on ``stream`` (default: current)."""
        (stream or self.current).enqueue(_Op(fn))

    def synchronize(self) -> None:
        """Device synchronise: run everything, independent streams interleaved at random."""
        with self.lock:
            while True:
                pending = [s for s in self.streams if s.done < s.queued]
                if not pending:
                    return
                s = self.rng.choice(pending)
                s.run_until(s.done + 1)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor's bytes once all queued work has run (a CPU copy)."""
        self.synchronize()
        return t.detach().clone()

    def pending(self) -> int:
        """Queued work not yet run, over every stream."""
        return sum(s.queued - s.done for s in self.streams)


class CudaHarness:
    """The same test API on a real GPU; "kernels" are delayed with a spin so they really run late."""

    name = "cuda"
    SPIN = 20_000_000  # GPU cycles a launched kernel waits before it runs (~10 ms)

    def __init__(self) -> None:
        from snapstore.engine.torch._device import CUDA

        self.backend = CUDA
        self.hazards: list[str] = []
        self.device = torch.device("cuda")

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A CUDA copy of a CPU tensor (same strides)."""
        d = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
        d.copy_(t)
        torch.cuda.synchronize()
        return d

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0x3C) -> torch.Tensor:
        """A CUDA tensor of garbage bytes."""
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        d = torch.full((max(n, 1),), fill, dtype=torch.uint8, device=self.device)[:n].view(dtype).view(shape)
        torch.cuda.synchronize()
        return d

    def new_engine_stream(self) -> Any:
        """A stream the engine runs its own kernels on."""
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def launch(self, fn: Callable[[], None], stream: Any = None) -> None:
        """Run ``fn``'s kernels on ``stream`` behind a spin, so they are still queued for a while."""
        with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
            torch.cuda._sleep(self.SPIN)  # type: ignore[no-untyped-call]
            fn()

    def use(self, stream: Any) -> Any:
        """Make ``stream`` current."""
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        """Device synchronise."""
        torch.cuda.synchronize()

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor's bytes once all queued work has run (a CPU copy)."""
        torch.cuda.synchronize()
        return t.detach().cpu()

    def pending(self) -> int:
        """Not observable on a GPU."""
        return 0
