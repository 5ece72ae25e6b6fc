"""The device seam: every stream, event, pinned allocation and queued copy the adapter makes.

The adapter never calls ``torch.cuda`` directly; it asks a backend. :data:`CUDA` is the real one.
Tests pass a stand-in with the same duck-typed stream/event API (``tests/stream_model.py``: every
queued copy runs only when an event, ``wait_stream`` or a synchronise forces it), so the code that
runs on a GPU is the code the CPU tests exercise.

Streams returned by a backend have ``wait_stream(other)`` and ``synchronize()``; events have
``record(stream)`` and ``synchronize()`` — the ``torch.cuda`` API. :class:`DeviceBackend`,
:class:`DeviceStream` and :class:`DeviceEvent` name that contract (structural: nothing to subclass).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, cast

import torch

__all__ = ["CUDA", "CudaBackend", "DeviceBackend", "DeviceEvent", "DeviceStream"]


class DeviceStream(Protocol):
    """A queue of device work (``torch.cuda.Stream``): later work waits for ``other``'s queued work."""

    def wait_stream(self, other: Any) -> None: ...

    def synchronize(self) -> None: ...


class DeviceEvent(Protocol):
    """A marker in a stream (``torch.cuda.Event``): ``synchronize`` waits until the work before it ran."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...


class DeviceBackend(Protocol):
    """What the adapter asks of a device: the methods of :class:`CudaBackend` (or a stand-in's)."""

    def is_device(self, t: torch.Tensor) -> bool: ...

    def available(self) -> bool: ...

    def new_stream(self, device: torch.device) -> DeviceStream: ...

    def current_stream(self, device: torch.device) -> DeviceStream: ...

    def use(self, stream: DeviceStream) -> AbstractContextManager[None]: ...

    def event(self) -> DeviceEvent: ...

    def empty_host(self, nbytes: int, pin: bool) -> torch.Tensor: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def host_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def lend(self, half: torch.Tensor, write: bool) -> None: ...


class CudaBackend:
    """The real thing: CUDA tensors, ``torch.cuda`` streams and events, page-locked host memory."""

    name = "cuda"

    def is_device(self, t: torch.Tensor) -> bool:
        """True for tensors whose bytes must move through staging (here: CUDA tensors)."""
        return t.device.type == "cuda"

    def available(self) -> bool:
        """Whether staging should be page-locked (a working CUDA runtime)."""
        try:
            return bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001 - a broken driver means "no CUDA"
            return False

    def new_stream(self, device: torch.device) -> DeviceStream:
        """A side stream on ``device`` for staging transfers."""
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: torch.device) -> DeviceStream:
        """The calling thread's current stream on ``device`` (the engine's compute stream)."""
        return torch.cuda.current_stream(device)

    @contextmanager
    def use(self, stream: DeviceStream) -> Iterator[None]:
        """Make ``stream`` current for the copies queued inside the block."""
        with torch.cuda.stream(cast(torch.cuda.Stream, stream)):  # the streams new_stream made
            yield

    def event(self) -> DeviceEvent:
        """A fresh event (record it on a stream, synchronise on it later)."""
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def empty_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A host uint8 buffer, page-locked when ``pin`` (so copies from/to it can be asynchronous)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the current stream (host side is page-locked staging)."""
        dst.copy_(src, non_blocking=True)

    def host_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A host memcpy between staging and the core's buffer (runs now, on the calling thread)."""
        dst.copy_(src)

    def lend(self, half: torch.Tensor, write: bool) -> None:
        """Staging memory ``half`` is about to be read (or, ``write``, filled) by the core in place,
        instead of through :meth:`host_copy`; nothing to do on a GPU (its copies are done by now)."""


CUDA: DeviceBackend = CudaBackend()
