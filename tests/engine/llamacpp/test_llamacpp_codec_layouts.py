"""The slot codec on synthetic files of every memory layout (fast tier; the real llama-server's files
are tests/engine/llamacpp/test_llamacpp_layouts.py): attention K/V (rows and transposed V, any stream), cells with
a per-cell extension, recurrent state, hybrids, recurrent only, iSWA (full + sliding-window caches).

Properties: ``encode(decode(f)) == f``, a file is never parsed as another layout (it decodes to
what was encoded or is refused), store parts round-trip, and an iSWA snapshot whose known
sliding-window rows reach below its window exports ``n_swa + 1`` cells.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapstore.engine.llamacpp import _slotfile as S
from snapstore.engine.llamacpp import _slotparts as P
from snapstore.engine.llamacpp._slotmodel import KvLayer, ModelShape, RecLayer, SlotFile, SwaCache
from snapstore.engine.llamacpp._slotwindow import widen

F16, F32 = 1, 0
W = 8  # K/V elements per token per layer


def _kv(rng: np.random.Generator, cc: int, v_trans: int) -> KvLayer:
    k = rng.integers(0, 256, cc * 2 * W, dtype=np.uint8).tobytes()
    v = rng.integers(0, 256, cc * 2 * W, dtype=np.uint8).tobytes()
    return KvLayer(F16, 2 * W, k, F16, 2 * W, v, 2 if v_trans else 0, W if v_trans else 0)


def _cells(rng: np.random.Generator, positions: np.ndarray, ext: int) -> np.ndarray:
    cc = len(positions)
    extw = rng.integers(0, 1 << 16, (cc, ext // 4)).astype(np.int32)
    return np.concatenate([positions[:, None], np.ones((cc, 1), np.int32), extw, np.zeros((cc, 1), np.int32)],
                          axis=1).astype(np.int32)


@st.composite
def slot_files(draw):
    """(shape, file): a model layout and a slot file of it."""
    n_layer = draw(st.integers(1, 6))
    # per layer: attention / recurrent / neither
    kinds = draw(st.lists(st.sampled_from("ar-"), min_size=n_layer, max_size=n_layer))
    attn = tuple(i for i, k in enumerate(kinds) if k == "a")
    rec = tuple(i for i, k in enumerate(kinds) if k == "r")
    if not attn and not rec:
        attn = (0,)
    n_swa = draw(st.sampled_from([0, 0, 4])) if len(attn) >= 2 else 0
    n = draw(st.integers(2, 24))
    ext = draw(st.sampled_from([0, 0, 8, 12]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = ModelShape("synthetic", n_layer, attn, rec, tuple((W, W) for _ in attn), (6, 10) if rec else (0, 0), n_swa)
    sf = SlotFile(version=draw(st.sampled_from([3, 4])), tokens=rng.integers(0, 300, n).astype(np.int32),
                  token_form=draw(st.sampled_from([S.FORM_PLAIN, S.FORM_SERVER])))
    if attn:
        sf.n_stream = draw(st.integers(1, 3))
        sf.stream = draw(st.integers(0, sf.n_stream - 1))
        sf.v_trans = draw(st.integers(0, 1))
        sf.cell_ext = ext
        sf.cells = _cells(rng, np.arange(n, dtype=np.int32), ext)
        n_base = draw(st.integers(1, len(attn) - 1)) if n_swa else len(attn)
        sf.kv = [_kv(rng, n, sf.v_trans) for _ in range(n_base)]
        if n_swa:
            w = min(n, n_swa)
            sf.swa = SwaCache(_cells(rng, np.arange(n - w, n, dtype=np.int32), ext), sf.v_trans,
                              [_kv(rng, w, sf.v_trans) for _ in range(len(attn) - n_base)])
    if rec:
        sf.rec_cell = np.array([n - 1, 0, 0], np.int32)
        sf.rec_n_layer = n_layer
        sf.rec = [RecLayer(F32, 24, rng.bytes(24), F32, 40, rng.bytes(40)) for _ in rec]
    return shape, sf


@settings(max_examples=150, deadline=None)
@given(slot_files())
def test_every_layout_round_trips_or_is_refused(case):
    shape, sf = case
    data = S.encode(sf)
    try:
        back = S.decode(data, shape)
    except S.SlotFormatError as e:  # only an ambiguous cell layout may be refused, never mis-parsed
        assert "several cell layouts" in str(e)
        return
    assert S.encode(back) == data
    assert back.cell_ext == sf.cell_ext and len(back.kv) == len(sf.kv) and len(back.rec) == len(sf.rec)
    assert (back.swa is None) == (sf.swa is None)
    proto = P.SlotProto.of(back, shape)
    assert P.SlotProto.from_extra(proto.to_extra()) == proto
    parts = P.to_parts(back, shape)
    out = P.from_parts({k: np.ascontiguousarray(v) for k, v in parts.items()}, back.n_tokens, proto)
    assert S.encode(out) == data  # the store's parts give the file back


@settings(max_examples=60, deadline=None)
@given(slot_files())
def test_truncation_and_trailing_bytes_refused(case):
    shape, sf = case
    data = S.encode(sf)
    try:
        S.decode(data, shape)
    except S.SlotFormatError:
        return
    for cut in range(0, len(data), max(1, len(data) // 40)):
        with pytest.raises(S.SlotFormatError):
            S.decode(data[:cut], shape)
    with pytest.raises(S.SlotFormatError):
        S.decode(data + b"\1\0\0\0", shape)


def _iswa(n: int, rng: np.random.Generator) -> tuple[ModelShape, SlotFile]:
    shape = ModelShape("synthetic", 3, (0, 1, 2), (), ((W, W),) * 3, (0, 0), 4)
    sf = SlotFile(version=4, tokens=np.arange(10, 10 + n, dtype=np.int32), cells=_cells(rng, np.arange(n), 0),
                  kv=[_kv(rng, n, 0)])
    sf.swa = SwaCache(_cells(rng, np.arange(n - 4, n), 0), 0, [_kv(rng, 4, 0), _kv(rng, 4, 0)])
    return shape, sf


def test_widened_window_exports_window_plus_one():
    """Two captures (n - 1, then n tokens): the export carries n_swa + 1 cells, the first from the shorter one."""
    rng = np.random.default_rng(1)
    shape, sf = _iswa(12, rng)
    _, prev = _iswa(11, rng)
    prev.tokens = sf.tokens[:-1].copy()
    assert widen(sf, prev)
    assert sf.swa is not None and sf.swa.cells[:, 0].tolist() == list(range(7, 12))
    proto = P.SlotProto.of(sf, shape)
    parts = P.to_parts(sf, shape)
    assert int(parts["swa.from"][0]) == 7
    out = P.from_parts(parts, 12, proto)
    assert out.swa is not None and len(out.swa.cells) == shape.n_swa + 1
    assert out.swa.kv[0].k[: 2 * W] == prev.swa.kv[0].k[: 2 * W]  # position 7: the n-1 capture's first cell
    # a file imported alone exports exactly its own window
    _, alone = _iswa(12, np.random.default_rng(2))
    data = S.encode(alone)
    back = P.from_parts(P.to_parts(S.decode(data, shape), shape), 12, P.SlotProto.of(alone, shape))
    assert S.encode(back) == data


def test_widen_refuses_a_capture_of_other_tokens():
    rng = np.random.default_rng(3)
    _, sf = _iswa(12, rng)
    _, prev = _iswa(11, rng)
    prev.tokens = sf.tokens[:-1] + 1
    assert not widen(sf, prev) and sf.swa is not None and len(sf.swa.cells) == 4
