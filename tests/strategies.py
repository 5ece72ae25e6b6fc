"""Shared Hypothesis strategies: layouts, dtypes, shapes and token sequences."""

from __future__ import annotations

from hypothesis import strategies as st

import snapstore as ss

DTYPES = ["uint8", "int16", "float16", "bfloat16", "float32", "int64", "float8_e4m3fn", "float64"]
names = st.text(alphabet="abcdefghij._", min_size=1, max_size=8)
small_shape = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
row_shape = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


@st.composite
def layouts(draw: st.DrawFn) -> ss.Layout:
    """A layout with 0-2 fixed parts and 1-3 row streams, an optional draft component."""
    fixed_names = draw(st.lists(names, max_size=2, unique=True))
    row_names = draw(st.lists(names.filter(lambda n: n not in fixed_names), min_size=1, max_size=3, unique=True))
    fixed = {n: ss.Fixed(draw(st.sampled_from(DTYPES)), draw(small_shape)) for n in fixed_names}
    rows = {}
    for i, n in enumerate(row_names):
        comp = "draft" if i > 0 and draw(st.booleans()) else None
        rows[n] = ss.Rows(draw(st.sampled_from(DTYPES)), draw(row_shape), component=comp)
    return ss.Layout(fixed=fixed, rows=rows)


tokens = st.lists(st.integers(0, 2**31 + 5), min_size=1, max_size=700)
