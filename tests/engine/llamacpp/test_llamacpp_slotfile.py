"""The llama-server slot-file codec against files the real llama-server (xllamacpp) wrote.

Round trips are byte-identical; a version, layout or length the codec does not know is refused
with an error naming it, never mis-parsed.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("gguf")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp import _slotfile as S  # noqa: E402
from snapstore.engine.llamacpp import _slotparts as P  # noqa: E402
from snapstore.engine.llamacpp._identify import model_info  # noqa: E402

# the repository's root
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _fa_off(p):
    import xllamacpp as x

    p.flash_attn_type = x.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Real slot files: llama (flash attention on: rows; off: transposed V), LFM2 hybrid with checkpoints."""
    d = tmp_path_factory.mktemp("slotfiles")
    llama, lfm2 = h.write_llama(str(d / "llama.gguf")), h.write_lfm2(str(d / "lfm2.gguf"))
    out = {}
    for tag, model, kw in (("llama", llama, {}), ("llama_vt", llama, {"tweak": _fa_off}),
                           ("lfm2", lfm2, {"n_ubatch": 64, "tweak": lambda p: setattr(p, "checkpoint_min_step", 16)})):
        with h.llama_server(model, str(d / "slots"), **kw) as s:
            s.post("/completion", {"prompt": h.text_of(30), "n_predict": 3, "cache_prompt": True, "id_slot": 0})
            s.post("/slots/0?action=save", {"filename": tag})
        with open(d / "slots" / tag, "rb") as f:
            out[tag] = (f.read(), model)
    return out


@pytest.mark.parametrize("tag", ["llama", "llama_vt", "lfm2"])
def test_real_files_round_trip_byte_identical(files, tag):
    data, model = files[tag]
    sf = S.decode(data, model_info(model).shape)
    assert sf.version == 4 and sf.token_form == S.FORM_SERVER and sf.n_tokens > 100
    assert S.encode(sf) == data
    assert sf.v_trans == (1 if tag == "llama_vt" else 0)
    if tag == "lfm2":
        assert sf.rec_cell is not None and sf.n_checkpoints >= 2 and sf.kv and sf.rec


def test_transposed_v_becomes_rows(files):
    data, model = files["llama_vt"]
    shape = model_info(model).shape
    sf = S.decode(data, shape)
    ly = sf.kv[0]
    rows = np.frombuffer(ly.v, np.uint8).reshape(sf.n_tokens, ly.n_embd_v, ly.v_el)
    # the file holds V column-major: element j of every cell, then j+1; find cell 5 dim 3 there
    hdr = data.index(struct.pack("<iII", ly.v_type, ly.v_el, ly.n_embd_v)) + 12
    j, c = 3, 5
    off = hdr + (j * sf.n_tokens + c) * ly.v_el
    assert bytes(rows[c, j]) == data[off:off + ly.v_el]
    parts = P.to_parts(sf, shape)
    assert parts["v.0"].shape == (sf.n_tokens, ly.v_row)


def test_plain_token_list_form_round_trips(files):
    data, model = files["llama"]
    shape = model_info(model).shape
    sf = S.decode(data, shape)
    sf.token_form = S.FORM_PLAIN
    plain = S.encode(sf)
    assert struct.unpack_from("<I", plain, 8)[0] == sf.n_tokens  # a bare token list
    back = S.decode(plain, shape)
    assert back.token_form == S.FORM_PLAIN and np.array_equal(back.tokens, sf.tokens)
    assert S.encode(back) == plain


def test_version_3_layout_round_trips(files):
    """State version 3 has no 8-byte field after the K/V layer count (llama.cpp's state_write_data)."""
    data, model = files["llama"]
    shape = model_info(model).shape
    sf = S.decode(data, shape)
    sf.version = 3
    v3 = S.encode(sf)
    assert len(v3) == len(data) - 8
    assert S.encode(S.decode(v3, shape)) == v3


@pytest.mark.parametrize("version", [0, 1, 2, 5, 99])
def test_unknown_version_refused_by_name(files, version):
    data, model = files["llama"]
    bad = bytearray(data)
    struct.pack_into("<I", bad, 4, version)
    with pytest.raises(S.SlotFormatError, match=f"state version {version} is not one this codec knows"):
        S.decode(bytes(bad), model_info(model).shape)


def test_unknown_layouts_refused(files):
    data, model = files["llama"]
    shape = model_info(model).shape
    sf = S.decode(data, shape)
    toks = 12 + 4 * (sf.n_tokens + 4)

    def bad(offset, value, fmt="<I"):
        b = bytearray(data)
        struct.pack_into(fmt, b, offset, value)
        return bytes(b)

    cases = {
        "server-tokens payload version 7": bad(16, 7),
        "media chunks": bad(toks - 4, 1),
        "n_seq_id != 1": bad(toks + 8 + 4, 2),
        "v_trans 5": bad(toks + 8 + 12 * sf.n_tokens, 5),
        "version-4 kv fields": bad(toks + 8 + 12 * sf.n_tokens + 8, 9),
        "unknown ggml type id 77": bad(toks + 8 + 12 * sf.n_tokens + 16, 77, "<i"),
        "not a llama.cpp sequence state file": bad(0, 0x67677373),
    }
    for needle, blob in cases.items():
        with pytest.raises(S.SlotFormatError, match=needle):
            S.decode(blob, shape)
    with pytest.raises(S.SlotFormatError, match="unexpected bytes"):
        S.decode(data + b"\0" * 12, shape)


def test_every_truncation_refused(files):
    data, model = files["lfm2"]
    shape = model_info(model).shape
    for cut in sorted({*range(0, 64), *range(0, len(data), 997), len(data) - 1}):
        with pytest.raises(S.SlotFormatError):
            S.decode(data[:cut], shape)


def test_file_of_another_shape_refused(files, tmp_path):
    data, _ = files["llama"]
    other = model_info(h.write_llama(str(tmp_path / "three.gguf"), n_layer=3, seed=9)).shape
    with pytest.raises(S.SlotFormatError, match="kv cache of 2 layers, the model has 3"):
        S.decode(data, other)
    hybrid = model_info(files["lfm2"][1]).shape
    with pytest.raises(S.SlotFormatError):
        S.decode(data, hybrid)


def test_parts_round_trip_and_cut(files):
    for tag in ("llama", "llama_vt"):
        data, model = files[tag]
        shape = model_info(model).shape
        sf = S.decode(data, shape)
        proto = P.SlotProto.of(sf, shape)
        assert P.SlotProto.from_extra(proto.to_extra()) == proto
        layout = P.layout_for(proto)
        for n in (sf.n_tokens, 17):
            parts = P.to_parts(sf, shape, n)
            dest = P.empty_parts(layout, n)
            for k, v in parts.items():
                np.frombuffer(dest[k], np.uint8)[:] = np.frombuffer(np.ascontiguousarray(v), np.uint8)
            back = P.from_parts(dest, n, proto)
            if n == sf.n_tokens:
                assert S.encode(back) == data
            else:
                assert back.n_tokens == n and np.array_equal(back.tokens, sf.tokens[:n])


def test_hybrid_state_cannot_be_cut(files):
    data, model = files["lfm2"]
    shape = model_info(model).shape
    sf = S.decode(data, shape)
    with pytest.raises(Exception, match="only valid at its last token"):
        P.to_parts(sf, shape, sf.n_tokens - 1)


def test_identity_module_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, snapstore.cli.main, snapstore.engine.llamacpp._bridge, snapstore.engine.llamacpp._proxy, "
            "snapstore.engine.llamacpp.cli; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_DIR)
