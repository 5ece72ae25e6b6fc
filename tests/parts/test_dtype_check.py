"""The destination/source dtype check's fast path (issue 31: numpy's ``dtype.name`` is Python code,
read twice per part on every restore) decides exactly as the full check does: every layout dtype
name against arrays of every numpy and ml_dtypes type, both byte orders, flat and shaped, with the
reference below (the check as it was before the fast path) as the oracle."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

import snapstore as ss
from snapstore._layout import DTYPE_NAMES
from snapstore.parts.buffers import _check_array

ml_dtypes = pytest.importorskip("ml_dtypes")  # registers bfloat16 and the float8 names with numpy


def _reference(name: str, arr: np.ndarray, spec: Any, rows: int, err: type[Exception]) -> None:
    """The check before the fast path (dtype.name compared, byte order, then shapes)."""
    dt = arr.dtype
    if (dt in (np.uint8, np.int8) or dt.kind == "V") and (dt.name != spec.dtype or arr.ndim == 1):
        return
    if dt.name != spec.dtype:
        raise err(f"dtype {dt.name}")
    little = dt.itemsize <= 1 or dt.byteorder in ("<", "|") or (dt.byteorder == "=" and sys.byteorder == "little")
    if not little:
        raise err("big-endian")
    if isinstance(spec, ss.Fixed):
        if tuple(arr.shape) != spec.shape:
            raise err("shape")
    else:
        if arr.ndim < 1 or tuple(arr.shape[1:]) != spec.row_shape:
            raise err("row shape")
        if arr.shape[0] < rows:
            raise err("rows")


_TYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
          "float32", "float64", "complex64", "complex128", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
          "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "V2"]


def _arrays() -> list[np.ndarray]:
    out = []
    for t in _TYPES:
        try:
            dt = np.dtype(t)
        except TypeError:
            continue
        for order in ("<", ">", "="):
            d = dt.newbyteorder(order) if dt.itemsize > 1 and dt.kind != "V" else dt
            for shape in ((8,), (4, 2), (4, 3), (2, 2)):
                out.append(np.zeros(shape, d))
    return out


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_the_fast_path_decides_as_the_full_check(name: str) -> None:
    specs = [ss.Rows(name, (2,)), ss.Fixed(name, (4, 2)), ss.Rows(name, (3,))]
    checked = 0
    for spec in specs:
        for arr in _arrays():
            for rows in (2, 4):
                want = got = "ok"
                try:
                    _reference("p", arr, spec, rows, ss.DestinationError)
                except ss.DestinationError:
                    want = "refused"
                try:
                    _check_array("p", arr, spec, rows, ss.DestinationError)
                except ss.DestinationError:
                    got = "refused"
                assert got == want, (spec, arr.dtype, arr.shape, rows)
                checked += 1
    assert checked > 500
