"""Does an engine buffer fit its part spec? dtype, shape, byte order and size checks for save sources
and restore destinations, each refusal a message that says what to pass instead.

Kept apart from :mod:`snapstore.parts.buffers` (which wraps buffers as byte ranges and moves the bytes):
these checks run once per part before a byte moves, so a mismatch never saves or writes anything.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from snapstore._errors import LayoutError
from snapstore._layout import Fixed, PartSpec, Rows
from snapstore.parts.paged import fitting_axes

__all__ = ["as_array", "check_array", "check_rows_of", "needed_bytes", "too_short"]


def _raw_bytes_like(arr: np.ndarray) -> bool:
    return arr.dtype in (np.uint8, np.int8) or arr.dtype.kind == "V"


def _little_endian(dt: np.dtype) -> bool:
    """Are ``dt``'s bytes in the store's canonical (little-endian) order? One-byte types always are."""
    if dt.fields:
        return all(_little_endian(f[0]) for f in dt.fields.values())
    if dt.subdtype is not None:
        return _little_endian(dt.subdtype[0])
    return dt.itemsize <= 1 or dt.byteorder in ("<", "|") or (dt.byteorder == "=" and sys.byteorder == "little")


def _swapped_format(mv: memoryview) -> bool:
    """A typed buffer whose struct format says big-endian ('>' or '!'): checked as an array."""
    return mv.itemsize > 1 and mv.format[:1] in (">", "!")


def as_array(mv: memoryview) -> np.ndarray | None:
    """A buffer to check as a numpy array (a view, no copy): one that is strided, big-endian, or
    says its element type or shape (a typed or multi-dimensional memoryview: its dtype and row shape
    are checked against the layout like an array's). None: flat raw bytes, checked on size alone;
    also a format numpy cannot read, which then passes on size as before."""
    if mv.c_contiguous and not _swapped_format(mv) and mv.ndim <= 1 and mv.format in ("B", "b", "c"):
        return None
    try:
        return np.asarray(mv)
    except (TypeError, ValueError):
        if not mv.c_contiguous:
            raise
        return None


@functools.cache
def _canonical(dtype: str) -> np.dtype | None:
    """The little-endian numpy dtype of a layout's dtype name (None: one numpy does not know)."""
    try:
        dt: np.dtype = np.dtype(dtype).newbyteorder("<")
    except TypeError:
        return None
    return dt


def _big_endian(name: str, what: str, dt: np.dtype, spec: PartSpec) -> str:
    """Why a big-endian buffer is refused: dtype.name is "float16" for '>f2' too, so the name alone
    passes while the bytes would be stored (or land) swapped. One message for arrays and pools."""
    fix = f"pass arr.astype('<{dt.str[1:]}')" if not what else f"the pool must be of dtype '<{dt.str[1:]}'"
    return (f"part {name!r}: {what}dtype {dt.str} is big-endian; the layout's {spec.dtype} is little-endian "
            f"(the store's canonical order): {fix}")


def check_array(name: str, arr: np.ndarray, spec: PartSpec, rows: int, err: type[LayoutError]) -> None:
    """dtype/shape of a numpy array against the part spec (raw byte arrays pass on size alone)."""
    want = _canonical(spec.dtype)
    if want is not None and arr.dtype == want:  # the common case, without numpy's (Python) dtype.name
        if arr.ndim == 1 and _raw_bytes_like(arr):
            return  # a flat view of raw bytes (uint8, int8 or an ml_dtypes type): checked on size alone
    elif _raw_bytes_like(arr) and (arr.dtype.name != spec.dtype or arr.ndim == 1):
        return  # raw bytes (e.g. a torch tensor's flat uint8 view): checked on size alone
    elif arr.dtype.name != spec.dtype:
        raise err(f"part {name!r}: dtype is {arr.dtype.name}, the layout says {spec.dtype}")
    elif not _little_endian(arr.dtype):
        raise err(_big_endian(name, "", arr.dtype, spec))
    if isinstance(spec, Fixed):
        if tuple(arr.shape) != spec.shape:
            raise err(f"part {name!r}: shape is {tuple(arr.shape)}, the layout says {spec.shape}")
    else:
        if arr.ndim < 1 or tuple(arr.shape[1:]) != spec.row_shape:
            axes = [k for k in range(1, arr.ndim) if arr.shape[:k] + arr.shape[k + 1:] == spec.row_shape]
            hint = (f"the token axis looks like axis {axes[0]}: pass np.moveaxis(arr, {axes[0]}, 0) (a view, no copy)"
                    if axes else "the token axis must be the leading one (np.moveaxis(arr, token_axis, 0))")
            raise err(f"part {name!r}: row shape is {tuple(arr.shape[1:])}, the layout says {spec.row_shape}; {hint}")
        if arr.shape[0] < rows:
            raise err(f"part {name!r}: holds {arr.shape[0]} rows, {rows} are needed")


def _dtype_name(dt: object) -> str | None:
    """A reader's or writer's reported ``dtype`` as a layout dtype name (a numpy dtype, or the name
    itself as the torch adapter reports it); None when it reports none this can read."""
    if isinstance(dt, str):
        return dt
    if isinstance(dt, np.dtype):
        return "bytes" if dt.kind == "V" else dt.name
    return None


def check_rows_of(name: str, obj: object, spec: PartSpec, what: str, err: type[LayoutError]) -> None:
    """A reader or writer that reports its rows (``row_shape``, ``dtype``; ``row_bytes``; as
    :class:`snapstore.PagedRows` does) against the layout's stream, before a byte moves: a pool read
    with the wrong axes has the right byte count but scrambled rows, so the bytes alone do not tell.
    A raw-byte view (uint8 / int8) is checked on its row bytes alone, as a raw array is."""
    shape = getattr(obj, "row_shape", None)
    if not isinstance(spec, Rows) or shape is None:
        return
    try:
        got = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise err(f"part {name!r}: the {what}'s row_shape {shape!r} is not a shape") from None
    reported = getattr(obj, "dtype", None)
    if isinstance(reported, np.dtype) and not _little_endian(reported):  # a big-endian pool: bytes swapped
        raise err(_big_endian(name, f"the {what}'s ", reported, spec))
    dt = _dtype_name(reported)
    row_bytes = getattr(obj, "row_bytes", None)
    # a byte view of another dtype passes on row bytes; a pool of the layout's own dtype (uint8 K/V of
    # an fp8 cache) is checked on its row shape like any other: axes that permute it scramble rows
    raw = dt in ("uint8", "int8", "bytes") and dt != spec.dtype
    fits = (row_bytes is None or row_bytes == spec.row_bytes) and (
        raw or (got == spec.row_shape and (dt is None or dt == spec.dtype)))
    if fits:
        return
    axes, pool = getattr(obj, "axes", None), getattr(obj, "pool_shape", None)
    hint = ""
    if pool is not None:
        fit = fitting_axes(pool, spec.row_shape)
        hint = (f"; pass axes={fit[0]}" + (f" (or one of {fit[1:4]})" if len(fit) > 1 else "") +
                f": (block_axis, token_axis) of the pool's shape {tuple(pool)} that leave rows of {spec.row_shape}"
                if fit else f"; no (block_axis, token_axis) of the pool's shape {tuple(pool)} leaves rows of "
                f"{spec.row_shape}: is this the pool of part {name!r}?")
    raise err(f"part {name!r}: the {what}'s rows are {got} {dt or '(dtype not reported)'}"
              f"{f' (axes={tuple(axes)})' if axes is not None else ''}, the layout says {spec.row_shape} "
              f"{spec.dtype}{hint}; nothing was {'saved' if err is LayoutError else 'written'}")


def needed_bytes(spec: PartSpec, rows: int) -> int:
    return spec.nbytes if isinstance(spec, Fixed) else rows * spec.row_bytes


def too_short(name: str, what: str, have: int, need: int, spec: PartSpec) -> str:
    """'too small' in bytes and, for a row stream, in rows."""
    if isinstance(spec, Fixed):
        return f"part {name!r}: {what} has {have} bytes, {need} are needed"
    rb = spec.row_bytes
    return (f"part {name!r}: {what} has {have} bytes ({have // rb} rows of {rb} bytes), "
            f"{need // rb} rows ({need} bytes) are needed")
