"""Engine buffers as byte ranges: part sources for save, part destinations for restore.

A part is a buffer-protocol object (numpy array, memoryview, bytearray) or an object with
``read_into(offset, out)`` (source) / ``write_from(offset, data)`` (destination) — the hook the
torch adapter uses to stream device tensors through its staging buffer. Contiguous buffers are
read and written in place (no copy); strided numpy arrays go element-wise through ``.flat``.

A reader/writer may also lend its own host memory (the adapter's page-locked staging halves), so
a chunk is not copied once more between that memory and the core's staging slot:

- a reader with ``view(offset, nbytes)`` returns a read-only view of those bytes (or None: "copy
  them instead"), valid until the core calls ``release(offset, nbytes)``; the chunker hashes,
  compresses and writes the chunk from it;
- a writer with ``buffer_for(offset, nbytes)`` returns a writable host buffer (or None) the core
  reads or decompresses the chunk into; once its checksum matched, ``commit(offset, nbytes)``
  writes it to the destination, else ``discard(offset, nbytes)`` drops it. Exactly one of the two
  follows every buffer handed out.

Any non-snapstore exception a reader raises is a :class:`SourceError` (nothing was saved); a
writer's is a ``RestoreError(touched=True)``. Memory a writer hands out (``views``, ``buffer_for``)
may be any writable C-contiguous buffer (memoryview, numpy array, bytearray); anything else is a
:class:`DestinationError`, touched only if the restore had written before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from snapstore._errors import DestinationError, LayoutError, RestoreError, SnapstoreError, SourceError
from snapstore._layout import PartSpec, Rows, dtype_size
from snapstore._numbers import integer
from snapstore.parts.shape_checks import as_array, check_array, check_rows_of, needed_bytes, too_short

__all__ = ["FILLS_OUT", "Destination", "PartReader", "PartSource", "PartWriter", "Source", "Sink", "as_sink",
           "as_source"]

# What save() takes per part and restore() writes into: any object exposing the buffer protocol
# (numpy array, memoryview, bytearray, a C-contiguous torch CPU tensor's numpy view) or a
# PartReader / PartWriter. Named so public signatures say what they take instead of Any.
PartSource = Any
Destination = Any

T = TypeVar("T")
_check_array = check_array  # its old name here: tests/parts/test_dtype_check.py imports it from this module


@runtime_checkable
class PartReader(Protocol):
    """A save source that is not a host buffer: fills ``out`` with bytes from ``offset``."""

    nbytes: int

    def read_into(self, offset: int, out: memoryview) -> None: ...


@runtime_checkable
class PartWriter(Protocol):
    """A restore destination that is not a host buffer: receives bytes at ``offset``."""

    nbytes: int

    def write_from(self, offset: int, data: memoryview) -> None: ...


class Source:
    """Bytes of one part for the chunker: ``view`` (zero copy) or ``copy_into`` (staged)."""

    def __init__(self, name: str, nbytes: int, mv: memoryview | None = None,
                 arr: np.ndarray | None = None, reader: PartReader | None = None):
        self.name, self.nbytes, self.mv, self.arr, self.reader = name, nbytes, mv, arr, reader

    @property
    def zero_copy(self) -> bool:
        """True when byte ranges can be handed out as views of the engine's own buffer."""
        return self.mv is not None

    def view(self, start: int, end: int) -> memoryview:
        """A view of bytes [start, end) (only for zero-copy sources)."""
        assert self.mv is not None
        return self.mv[start:end]

    def _reader_call(self, what: str, fn: Callable[[], T]) -> T:
        """Run a call into the engine's reader; its own (device) errors become a SourceError."""
        try:
            return fn()
        except SnapstoreError:
            raise
        except Exception as e:
            raise SourceError(f"part {self.name!r}: the source's {what} raised {type(e).__name__}: {e}; "
                              "the engine's state could not be read and nothing was saved") from e

    def borrow(self, start: int, n: int) -> memoryview | None:
        """A view of bytes [start, start + n) lent by the reader (see the module doc), or None:
        copy them with :meth:`copy_into` instead. Give it back with :meth:`give_back`."""
        view = getattr(self.reader, "view", None)
        if view is None or not callable(getattr(self.reader, "release", None)):
            return None
        out: memoryview | None = self._reader_call(f"view({start}, {n})", lambda: view(start, n))
        if out is not None and len(out) != n:
            self.give_back(start, n)
            raise SourceError(f"part {self.name!r}: the source's view({start}, {n}) returned {len(out)} bytes")
        return out

    def give_back(self, start: int, n: int) -> None:
        """The core is through with a view :meth:`borrow` returned."""
        assert self.reader is not None
        reader: Any = self.reader
        self._reader_call(f"release({start}, {n})", lambda: reader.release(start, n))

    def copy_into(self, start: int, out: memoryview) -> None:
        """Copy bytes [start, start + len(out)) into ``out``."""
        if self.mv is not None:
            out[:] = self.mv[start:start + len(out)]
        elif self.reader is not None:
            reader = self.reader
            # ``out`` is a staging slot another save used: a reader that leaves bytes unwritten must store
            # zeros there, never what an earlier save (another namespace's, maybe) left in the slot. The
            # readers of this package and its adapters write every byte or raise (FILLS_OUT): not zeroed
            if not getattr(reader, FILLS_OUT, False):
                np.frombuffer(out, dtype=np.uint8).fill(0)
            self._reader_call(f"read_into({start}, <{len(out)} bytes>)", lambda: reader.read_into(start, out))
        else:
            assert self.arr is not None
            item = self.arr.dtype.itemsize
            i0, i1 = start // item, (start + len(out)) // item
            np.frombuffer(out, dtype=self.arr.dtype)[:] = self.arr.flat[i0:i1]


class Sink:
    """A destination for restore: ``write`` copies bytes in; ``view`` is a writable slice if any."""

    def __init__(self, name: str, nbytes: int, mv: memoryview | None = None,
                 arr: np.ndarray | None = None, writer: PartWriter | None = None):
        self.name, self.nbytes, self.mv, self.arr, self.writer = name, nbytes, mv, arr, writer

    def view(self, start: int, end: int) -> memoryview | None:
        """A writable view of bytes [start, end), or None when the destination is not contiguous."""
        return self.mv[start:end] if self.mv is not None else None

    def segments(self, start: int, end: int) -> list[memoryview] | None:
        """Writable host views covering [start, end) in order, from a writer that has ``views`` (paged
        pools): the restore reads chunks straight into them. None: use ``write``."""
        views = getattr(self.writer, "views", None) if self.writer is not None else None
        if views is None:
            return None
        n = end - start
        what = f"views({start}, {n})"
        got: Any = self._writer_call(what, lambda: views(start, n))
        if got is None:
            return None
        if isinstance(got, (str, bytes)) or not hasattr(got, "__iter__"):
            raise DestinationError(f"part {self.name!r}: the destination's {what} returned a {type(got).__name__}, "
                                   "not a list of writable host buffers; return None to be written through "
                                   "write_from; nothing was written by this call")
        out = [self._host_bytes(what, v) for v in got]
        # the chunk is read and checked in these views: any other extent would leave bytes unwritten
        # (or blame a good chunk), so the destination's mistake is its own error, before a byte is read
        if sum(len(v) for v in out) != n:
            raise DestinationError(f"part {self.name!r}: the destination's {what} returned "
                                   f"{sum(len(v) for v in out)} bytes, not {n}; return None to be written "
                                   "through write_from; nothing was written by this call")
        return out

    def _host_bytes(self, what: str, obj: object) -> memoryview:
        """A buffer the writer returned (memoryview, numpy array, bytearray: any writable C-contiguous
        buffer) as flat writable bytes; DestinationError (touched=False: the caller adds what it wrote
        before) when it is not one, so a wrong type is the destination's error, never a bare one.
        A numpy array is taken as its bytes (any dtype: one numpy exports no buffer format for, such
        as a bfloat16 extension type, too); memory of Python objects (object dtype) is refused."""
        if type(obj) is memoryview and obj.format == "B" and obj.ndim == 1 and not obj.readonly \
                and obj.c_contiguous and not (isinstance(obj.obj, np.ndarray) and obj.obj.dtype.hasobject):
            return obj  # already flat writable bytes (a paged writer's views: hundreds a restore)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:  # pointers to Python objects: writing bytes there corrupts the process
                raise DestinationError(f"part {self.name!r}: the destination's {what} returned a numpy array of "
                                       f"Python objects (dtype {obj.dtype}), not raw memory; return writable host "
                                       "memory or None; nothing was written by this call")
            if obj.flags.c_contiguous:
                obj = obj.reshape(-1).view(np.uint8)
        try:
            mv = memoryview(obj)  # type: ignore[arg-type]
        except (TypeError, ValueError):  # ValueError: numpy refusing to export a dtype
            raise DestinationError(f"part {self.name!r}: the destination's {what} returned a {type(obj).__name__}, "
                                   "not a buffer; return writable host memory (memoryview, numpy array, bytearray) "
                                   "or None; nothing was written by this call") from None
        if mv.format == "O" or isinstance(mv.obj, np.ndarray) and mv.obj.dtype.hasobject:
            raise DestinationError(f"part {self.name!r}: the destination's {what} returned memory of Python "
                                   "objects, not raw memory; return writable host memory or None; nothing was "
                                   "written by this call")
        if mv.readonly or not mv.c_contiguous:
            raise DestinationError(f"part {self.name!r}: the destination's {what} returned "
                                   f"{'read-only' if mv.readonly else 'non-contiguous'} memory "
                                   f"({type(obj).__name__}); return writable C-contiguous host memory or None; "
                                   "nothing was written by this call")
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")

    def _writer_call(self, what: str, fn: Callable[[], T]) -> T:
        """Run a call into the engine's writer; any failure is a RestoreError(touched=True)."""
        try:
            return fn()
        except RestoreError as e:
            e.touched = True  # whatever it says, the destination may hold part of this write
            raise
        except Exception as e:
            # the engine's own destination failed part-way: the caller must know it was touched
            raise RestoreError(
                f"part {self.name!r}: the destination's {what} raised {type(e).__name__}: {e}; "
                "the destination was partly written: re-read the prompt", touched=True) from e

    def buffer(self, start: int, n: int) -> memoryview | None:
        """A host buffer the writer lends for bytes [start, start + n) (see the module doc), or
        None: use :meth:`write`. Follow it with :meth:`commit` or :meth:`discard`."""
        lend = getattr(self.writer, "buffer_for", None)
        if lend is None or not callable(getattr(self.writer, "commit", None)):
            return None
        what = f"buffer_for({start}, {n})"
        got: Any = self._writer_call(what, lambda: lend(start, n))
        if got is None:
            return None
        try:  # lent: discard() follows every refusal
            out = self._host_bytes(what, got)
            if len(out) != n:
                raise DestinationError(f"part {self.name!r}: the destination's {what} returned {len(out)} bytes, "
                                       f"not {n}; nothing was written by this call")
        except DestinationError:
            self.discard(start, n)
            raise
        return out

    def commit(self, start: int, n: int) -> None:
        """Write the bytes now in the buffer :meth:`buffer` lent (their checksum matched)."""
        writer: Any = self.writer
        self._writer_call(f"commit({start}, {n})", lambda: writer.commit(start, n))

    def discard(self, start: int, n: int) -> None:
        """Drop a lent buffer unwritten (its chunk failed to read or its checksum)."""
        drop = getattr(self.writer, "discard", None)
        if drop is not None:
            self._writer_call(f"discard({start}, {n})", lambda: drop(start, n))

    def write(self, start: int, data: memoryview) -> None:
        """Write ``data`` at byte ``start``."""
        if self.mv is not None:
            self.mv[start:start + len(data)] = data
        elif self.writer is not None:
            writer = self.writer
            self._writer_call(f"write_from({start}, <{len(data)} bytes>)", lambda: writer.write_from(start, data))
        else:
            assert self.arr is not None
            item = self.arr.dtype.itemsize
            i0 = start // item
            self.arr.flat[i0:i0 + len(data) // item] = np.frombuffer(data, dtype=self.arr.dtype)


_READER_HELP = ("a numpy array, memoryview or bytes, or a snapstore.PartReader: an object with an `nbytes` "
                "attribute and read_into(offset, out); torch tensors go through snapstore.engine")
_WRITER_HELP = ("a writable numpy array, memoryview or bytearray, or a snapstore.PartWriter: an object with an "
                "`nbytes` attribute and write_from(offset, data); torch tensors go through snapstore.engine")


def as_source(name: str, obj: Any, spec: PartSpec, rows: int) -> Source:
    """Check a save buffer against its spec and wrap it; LayoutError explains any mismatch."""
    need = needed_bytes(spec, rows)
    if isinstance(obj, PartReader) and not isinstance(obj, (np.ndarray, memoryview, bytes, bytearray)):
        check_rows_of(name, obj, spec, "source", LayoutError)
        if integer(obj.nbytes, f"part {name!r}: the source's nbytes", minimum=0, err=LayoutError) < need:
            raise LayoutError(too_short(name, "source", obj.nbytes, need, spec))
        return Source(name, need, reader=obj)
    if isinstance(obj, np.ndarray):
        obj = _plain(name, obj, "source", LayoutError)
        check_array(name, obj, spec, rows, LayoutError)
        if obj.nbytes < need:
            raise LayoutError(too_short(name, "buffer", obj.nbytes, need, spec))
        if obj.flags.c_contiguous:
            return Source(name, need, mv=obj.reshape(-1).view(np.uint8).data)
        return Source(name, need, arr=obj)
    try:
        mv = memoryview(obj)
    except TypeError:
        if hasattr(obj, "read_into"):
            raise LayoutError(f"part {name!r}: {type(obj).__name__} has read_into() but no `nbytes` attribute; "
                              f"a PartReader needs both (pass {_READER_HELP})") from None
        raise LayoutError(f"part {name!r}: {type(obj).__name__} is not a buffer (pass {_READER_HELP})") from None
    arr = as_array(mv)
    if arr is not None:
        return as_source(name, arr, spec, rows)
    if mv.nbytes < need:
        raise LayoutError(too_short(name, "buffer", mv.nbytes, need, spec))
    return Source(name, need, mv=mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)


# A class attribute of a PartReader of this package or its adapters: its read_into writes every byte of
# ``out`` or raises, so ``out`` is not zeroed first (a memset of each chunk, on the engine's path)
FILLS_OUT = "_snapstore_fills_out"


def _plain(name: str, obj: np.ndarray, what: str, err: type[LayoutError]) -> np.ndarray:
    """``obj`` as a plain ndarray: a subclass (``np.matrix``) viewed as one, the same memory (its own
    ``reshape`` keeps two dimensions); a masked array refused, its mask being neither saved nor restored."""
    if type(obj) is np.ndarray:
        return obj
    if isinstance(obj, np.ma.MaskedArray):
        raise err(f"part {name!r}: a masked array as {what}: pass its .data (a mask is neither saved nor "
                  "restored)")
    return obj.view(np.ndarray)


def _is_writer(obj: object) -> bool:
    """``isinstance(obj, PartWriter)`` without the protocol machinery (about 10 µs a call on 3.11:
    a sixtieth of a small restore): the same attribute check."""
    return callable(getattr(obj, "write_from", None)) and hasattr(obj, "nbytes")


def as_sink(name: str, obj: Any, spec: PartSpec, rows: int) -> Sink:
    """Check a restore destination (writable, large enough, dtype/shape) before anything is written."""
    need = needed_bytes(spec, rows)
    if not isinstance(obj, (np.ndarray, memoryview, bytearray)) and _is_writer(obj):
        check_rows_of(name, obj, spec, "destination", DestinationError)
        if integer(obj.nbytes, f"part {name!r}: the destination's nbytes", minimum=0, err=DestinationError) < need:
            raise DestinationError(too_short(name, "destination", obj.nbytes, need, spec))
        return Sink(name, need, writer=obj)
    if isinstance(obj, np.ndarray):
        obj = _plain(name, obj, "destination", DestinationError)
        check_array(name, obj, spec, rows, DestinationError)
        if not obj.flags.writeable:
            raise DestinationError(f"part {name!r}: destination array is read-only")
        if obj.nbytes < need:
            raise DestinationError(too_short(name, "destination", obj.nbytes, need, spec))
        if obj.flags.c_contiguous:
            return Sink(name, need, mv=obj.reshape(-1).view(np.uint8).data)
        if isinstance(spec, Rows) and obj.dtype.itemsize != dtype_size(spec.dtype):
            raise DestinationError(f"part {name!r}: a strided destination must have the part's dtype")
        return Sink(name, need, arr=obj)
    try:
        mv = memoryview(obj)
    except TypeError:
        if hasattr(obj, "write_from"):
            raise DestinationError(f"part {name!r}: {type(obj).__name__} has write_from() but no `nbytes` "
                                   f"attribute; a PartWriter needs both (pass {_WRITER_HELP})") from None
        raise DestinationError(f"part {name!r}: {type(obj).__name__} is not a writable buffer "
                               f"(pass {_WRITER_HELP})") from None
    if mv.readonly:
        raise DestinationError(f"part {name!r}: destination buffer is read-only")
    arr = as_array(mv)
    if arr is not None:
        return as_sink(name, arr, spec, rows)
    if mv.nbytes < need:
        raise DestinationError(too_short(name, "destination", mv.nbytes, need, spec))
    return Sink(name, need, mv=mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
