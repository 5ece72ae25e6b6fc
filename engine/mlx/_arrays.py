"""MLX arrays <-> NumPy, byte for byte: the dtype names the store knows, bfloat16 through a uint16 view.

NumPy has no bfloat16, so a bfloat16 array travels as its uint16 bit pattern, handed to the store
as 2-byte void elements (for dtypes NumPy lacks the store checks only the element size) and viewed
back as bfloat16 after the restore: no value is ever converted, so a restored array holds exactly
the bits that were saved.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from snapstore import LayoutError

__all__ = ["dtype_name", "from_numpy", "numpy_dtype", "to_numpy"]

_NAMES: dict[mx.Dtype, str] = {
    mx.bool_: "bool", mx.int8: "int8", mx.uint8: "uint8", mx.int16: "int16", mx.uint16: "uint16",
    mx.int32: "int32", mx.uint32: "uint32", mx.int64: "int64", mx.uint64: "uint64", mx.float16: "float16",
    mx.float32: "float32", mx.float64: "float64", mx.bfloat16: "bfloat16", mx.complex64: "complex64",
}
_BY_NAME = {v: k for k, v in _NAMES.items()}
# dtypes NumPy lacks: the same-size MLX integer carrying their bits, and the NumPy void type the store takes
_CARRIER = {"bfloat16": (mx.uint16, "V2")}


def dtype_name(dtype: mx.Dtype) -> str:
    """The store's name for an MLX dtype (LayoutError for one it cannot hold)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise LayoutError(f"MLX dtype {dtype} has no snapstore dtype name") from None


def numpy_dtype(name: str) -> np.dtype[np.generic]:
    """The NumPy dtype a part of dtype ``name`` is held in on the host (bfloat16: uint16)."""
    if name in _CARRIER:
        return np.dtype(_CARRIER[name][1])
    return np.dtype(name)


def to_numpy(a: mx.array) -> np.ndarray:
    """A C-contiguous NumPy copy of ``a``'s bytes (bfloat16 as 2-byte void elements holding its bits)."""
    name = dtype_name(a.dtype)
    if name in _CARRIER:
        carrier, void = _CARRIER[name]
        return np.array(a.view(carrier), copy=True, order="C").view(void)
    return np.array(a, copy=True, order="C")


def from_numpy(x: np.ndarray, name: str) -> mx.array:
    """The MLX array of dtype ``name`` whose bytes are ``x``'s (inverse of :func:`to_numpy`)."""
    if name in _CARRIER:
        carrier = _CARRIER[name][0]
        return mx.array(np.ascontiguousarray(x).view(np.uint16), dtype=carrier).view(_BY_NAME[name])
    return mx.array(np.ascontiguousarray(x), dtype=_BY_NAME[name])
