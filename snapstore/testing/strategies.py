"""Hypothesis strategies for layouts, token sequences and states (raw bytes per part)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from snapstore._layout import Fixed, Layout, Rows

DTYPES = ("uint8", "int16", "float16", "bfloat16", "float32", "int64", "float8_e4m3fn", "float64")
_names = st.text(alphabet="abcdefghij._", min_size=1, max_size=8)
_small_shape = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
_row_shape = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


@st.composite
def layouts(draw: st.DrawFn, max_fixed: int = 2, max_rows: int = 3) -> Layout:
    """A layout with 0..max_fixed fixed parts and 1..max_rows row streams, maybe a draft component."""
    fixed_names = draw(st.lists(_names, max_size=max_fixed, unique=True))
    row_names = draw(st.lists(_names.filter(lambda n: n not in fixed_names), min_size=1, max_size=max_rows,
                              unique=True))
    fixed = {n: Fixed(draw(st.sampled_from(DTYPES)), draw(_small_shape)) for n in fixed_names}
    rows = {}
    for i, n in enumerate(row_names):
        comp = "draft" if i > 0 and draw(st.booleans()) else None
        rows[n] = Rows(draw(st.sampled_from(DTYPES)), draw(_row_shape), component=comp)
    return Layout(fixed=fixed, rows=rows)


def token_sequences(min_size: int = 1, max_size: int = 700) -> st.SearchStrategy[list[int]]:
    """Token sequences, including ids that need 64 bits (stored as int64 then)."""
    return st.lists(st.integers(0, 2**31 + 5), min_size=min_size, max_size=max_size)


@st.composite
def states(draw: st.DrawFn, layout: Layout, n: int) -> dict[str, np.ndarray]:
    """A state of ``layout`` after ``n`` tokens, as raw bytes: fixed parts whole, streams of n rows."""
    out: dict[str, np.ndarray] = {}
    for name, spec in layout.parts.items():
        size = spec.nbytes if isinstance(spec, Fixed) else n * spec.row_bytes
        out[name] = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8).copy()
    return out
