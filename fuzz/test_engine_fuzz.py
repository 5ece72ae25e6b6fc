"""Fuzz the torch adapter through a real Store: layouts, strides, chunk edges, staging sizes, dtypes.

Each example builds a row stream and a fixed part as views of larger tensors (token axis anywhere,
permuted, sliced with steps, one-element odd-stride views), on the CPU or on the late-execution
stream model (tests/stream_model.py: every queued copy runs only when forced), saves a root and a
delta over it with odd chunk and staging sizes, and restores into destinations of another layout.
Every restored byte must equal the source and the model must have seen no host/device race.
The Hypothesis profile sizes the run (tests/README.md): 4/3 of its examples (ci: 40).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import snapstore as ss  # noqa: E402
from snapstore.engine import Staging, TorchAdapter, canonical, layout_of  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from stream_model import LateCuda  # noqa: E402

EXAMPLES = settings.default.max_examples * 4 // 3  # dev 13, ci 40 (as before profiles), long 1333
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
IDENT = ss.Identity(build="engine-fuzz", pack="sha256:00")

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool, torch.complex64,
          torch.float8_e4m3fn]


@st.composite
def views(draw: Any, min_tokens: int) -> tuple[tuple[int, ...], list[int], list[tuple[int, int, int]], int]:
    """A view recipe: base shape, a permutation, per-dim (start, length, step), and the token axis."""
    ndim = draw(st.integers(1, 4))
    td = draw(st.integers(0, ndim - 1))
    perm = draw(st.permutations(list(range(ndim))))
    slices = []
    base = []
    for d in range(ndim):
        n = draw(st.integers(min_tokens, 40)) if d == td else draw(st.integers(1, 5))
        step = draw(st.sampled_from([1, 1, 2, 3]))
        start = draw(st.integers(0, 2))
        base.append(start + (n - 1) * step + 1 + draw(st.integers(0, 2)))
        slices.append((start, n, step))
    return tuple(base), list(perm), slices, td


def _make(recipe: Any, dtype: Any, seed: int, h: LateCuda | None) -> tuple[Any, int]:
    """The view a recipe describes, over random bytes, and its token axis after the permutation."""
    base_shape, perm, slices, td = recipe
    g = torch.Generator().manual_seed(seed)
    nbytes = int(torch.Size(base_shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    base = raw.view(dtype).view(base_shape)
    if h is not None:
        base = h.to_device(base)
    v = base
    for d, (start, n, step) in enumerate(slices):
        v = v.narrow(d, start, (n - 1) * step + 1)[(slice(None),) * d + (slice(None, None, step),)]
    return v.permute(*perm), perm.index(td)


def _bytes(t: Any, td: int | None, rows: int | None = None) -> bytes:
    c = canonical(t.detach().cpu(), td)
    c = torch.empty(c.shape, dtype=c.dtype).copy_(c)
    if rows is not None:
        c = c[:rows]
    return bytes(c.reshape(-1).view(torch.uint8).numpy())


@FUZZ
@given(kv=views(2), fix=views(1), kv_dtype=st.sampled_from(DTYPES), fix_dtype=st.sampled_from(DTYPES),
       dst_kv=views(2), where=st.sampled_from(["cpu", "late", "late"]), seed=st.integers(0, 2**16),
       chunk_pages=st.integers(1, 3), staging=st.integers(2 * 4096, 40_000), cut=st.floats(0.0, 1.0),
       one=st.booleans())
def test_adapter_roundtrip_any_layout(kv: Any, fix: Any, kv_dtype: Any, fix_dtype: Any, dst_kv: Any, where: str,
                                      seed: int, chunk_pages: int, staging: int, cut: float, one: bool) -> None:
    """Root + delta saved and restored through a real Store: every byte exact, no race recorded."""
    h = LateCuda(seed=seed) if where == "late" else None
    k, ktd = _make(kv, kv_dtype, seed, h)
    f, _ = _make(fix, fix_dtype, seed + 1, h)
    if one:  # a one-element view whose last stride is not 1
        f = _make(((4, 5), [1, 0], [(0, 4, 1), (0, 5, 1)], 0), fix_dtype, seed + 2, h)[0][3:4, 1:2]
    T = k.shape[ktd]
    r2 = T
    r1 = max(1, min(T - 1, int(cut * T)))
    layout = layout_of({"f": f}, {"k": k}, token_dims={"k": ktd})
    chunk = 4096 * chunk_pages
    d = tempfile.mkdtemp(prefix="engine-fuzz-")
    try:
        store = ss.Store.open(d, identity=IDENT, layout=layout, budget=ss.Budget(reserve_bytes=0, ram_bytes=0),
                              chunk_bytes=chunk, staging_bytes=2 * chunk, check_rows=True)
        ad = TorchAdapter(store, token_dims={"k": ktd}, staging=Staging(staging, backend=h))
        toks = list(range(1000, 1000 + T))
        a = ad.save(toks[:r1], {"k": k, "f": f}, rows=r1)
        b = ad.save(toks[:r2], {"k": k, "f": f}, rows=r2)
        assert a.ok and b.ok and b.parent_id == a.snapshot_id
        # destinations: the row stream in another layout (same canonical shape), the fixed part as is
        dk = torch.zeros_like(canonical(k, ktd)).movedim(0, dst_kv[3] % k.dim()) if k.dim() > 1 else \
            torch.zeros_like(k)
        dtd = dst_kv[3] % k.dim() if k.dim() > 1 else 0
        if dst_kv[0][0] % 2 and k.dim() > 1:  # a permuted, non-contiguous destination
            dk = dk.transpose(0, -1).contiguous().transpose(0, -1)
        df = torch.zeros_like(f)
        if h is not None:
            dk, df = h.to_device(dk), h.to_device(df)
        res = ad.restore(store.match(toks), {"k": dk, "f": df}, token_dims={"k": dtd})
        assert res.n_tokens == r2
        got_k = h.host(dk) if h is not None else dk
        got_f = h.host(df) if h is not None else df
        assert _bytes(got_k, dtd, r2) == _bytes(k, ktd, r2)
        assert _bytes(got_f, None) == _bytes(f, None)
        # the root alone restores its rows exactly
        dk2 = torch.zeros_like(k) if h is None else h.to_device(torch.zeros_like(k))
        ad.restore(store.match(toks[:r1]), {"k": dk2, "f": df})
        got2 = h.host(dk2) if h is not None else dk2
        assert _bytes(got2, ktd, r1) == _bytes(k, ktd, r1)
        if h is not None:
            assert not h.hazards, h.hazards
        store.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
