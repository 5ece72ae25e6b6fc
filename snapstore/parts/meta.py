"""Engine metadata as a small fixed part: named int64 fields saved and restored with the state.

Engines keep bookkeeping beside their tensors (position, a prefix hash, the draft head's row
count). Stored as one fixed part it is exact, deduplicated like any part, restored in the same
plan, and an older reader that lacks a field simply never asks for it (put new fields at the end
under a new part name, or keep a version field). The transformers integration does the same with
``hf.meta``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from snapstore._errors import InvalidInputError, LayoutError
from snapstore._layout import Fixed
from snapstore._numbers import integer

__all__ = ["EngineMeta"]

_LO, _HI = -(1 << 63), 1 << 63


class EngineMeta:
    """A fixed part ``name`` of ``len(fields)`` int64 values: ``pack`` for save, ``unpack`` after restore."""

    def __init__(self, fields: Sequence[str], name: str = "engine.meta", component: str | None = None):
        if isinstance(fields, (str, bytes)) or not isinstance(fields, Iterable):
            raise InvalidInputError(f"fields must be a non-empty sequence of names, got {fields!r:.80}")
        fields = tuple(fields)
        if not fields:
            raise InvalidInputError("fields must be a non-empty sequence of names, got none")
        if len(set(fields)) != len(fields) or not all(isinstance(f, str) and f for f in fields):
            raise InvalidInputError(f"fields must be distinct non-empty strings, got {list(fields)!r}")
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"name must be a part name, got {name!r}")  # Layout checks the rest
        self.fields = tuple(fields)
        self.name = name
        self.spec = Fixed("int64", (len(self.fields),), component=component)

    def layout(self) -> dict[str, Fixed]:
        """``{name: Fixed("int64", (n,))}``, to merge into a Layout's ``fixed``."""
        return {self.name: self.spec}

    def pack(self, values: Mapping[str, int] | None = None, **kw: int) -> np.ndarray:
        """The part's buffer for ``save``: every field given, each an int in the int64 range."""
        if values is not None and not isinstance(values, Mapping):
            raise InvalidInputError(f"{self.name}: pack() takes a mapping of field -> int (or keywords), got "
                                    f"{type(values).__name__}")
        vals = {**(values or {}), **kw}
        unknown = sorted(set(vals) - set(self.fields))
        missing = [f for f in self.fields if f not in vals]
        if unknown or missing:
            raise InvalidInputError(f"{self.name}: unknown fields {unknown}, missing fields {missing}; "
                                    f"the fields are {list(self.fields)}")
        out = np.empty(len(self.fields), dtype="<i8")
        for i, f in enumerate(self.fields):
            what = f"{self.name}: field {f!r} (an int in the int64 range: fold a wider hash to 63 bits)"
            out[i] = integer(vals[f], what, minimum=_LO, maximum=_HI - 1)
        return out

    def empty(self) -> np.ndarray:
        """A destination buffer for ``restore``."""
        return np.zeros(len(self.fields), dtype="<i8")

    def unpack(self, buf: Any) -> dict[str, int]:
        """The fields of a restored buffer, by name."""
        arr = np.asarray(buf)
        if arr.shape != (len(self.fields),) or arr.dtype != np.dtype("<i8"):
            raise LayoutError(f"{self.name}: expected int64 ({len(self.fields)},), got {arr.dtype} {arr.shape}")
        return {f: int(v) for f, v in zip(self.fields, arr.tolist())}
