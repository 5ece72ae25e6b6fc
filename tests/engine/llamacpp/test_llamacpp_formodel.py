"""``snapstore export-slot ID OUT --for-model OTHER.gguf``: a slot moved to another quant (issue 27 item 5).

The file is written only when the snapshot's cache layout agrees exactly with what OTHER's GGUF
metadata says its caches hold (architecture, layer count, attention / recurrent layers, K/V row
widths, the target's K/V cache types, recurrent state sizes, the window); otherwise exit 2 naming
the first difference, nothing written. Such an export is an approximation: nothing is stored
for OTHER, and the snapshot is never matched under OTHER's identity.

Fast tier: synthetic slot files of the tiny GGUFs' shapes, through the real store and ``main()``.
Slow tier: the real llama-server writes the slot, and a server running the q8_0 quant of the
same weights restores the exported file and reuses it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

pytest.importorskip("gguf")

import helpers_llamacpp as h  # noqa: E402

from snapstore.cli.main import main  # noqa: E402
from snapstore.engine.llamacpp import _slotfile as S  # noqa: E402
from snapstore.engine.llamacpp._formodel import CacheLayoutMismatchError, check_for_model  # noqa: E402
from snapstore.engine.llamacpp._identify import model_info, model_shape  # noqa: E402
from snapstore.engine.llamacpp._slotmodel import KvLayer, ModelShape, RecLayer, SlotFile  # noqa: E402
from snapstore.engine.llamacpp._slotparts import SlotProto  # noqa: E402
from snapstore.engine.llamacpp._slotstore import SlotStore  # noqa: E402

BUILD = "test-build-formodel"
F16, F32, Q8_0 = 1, 0, 8


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("formodel")
    return {
        "f32": h.write_llama(str(d / "f32.gguf")),
        "f16": h.write_llama(str(d / "f16.gguf"), wtype="f16"),  # the same weights, another quant
        "q8_0": h.write_llama(str(d / "q8.gguf"), wtype="q8_0"),
        "3layers": h.write_llama(str(d / "l3.gguf"), n_layer=3),
        "1kvhead": h.write_llama(str(d / "kv1.gguf"), n_head_kv=1),
        "lfm2": h.write_lfm2(str(d / "lfm2.gguf")),
        "granite": h.write_granitehybrid(str(d / "g.gguf")),
        "granite_wide": h.write_granitehybrid(str(d / "g5.gguf"), layers="mamam"),
        "gemma3": h.write_gemma3(str(d / "gemma.gguf")),
        "gemma3_w16": h.write_gemma3(str(d / "gemma16.gguf"), window=16),
    }


def _file(shape: ModelShape, n: int = 20, kv_type: int = F16, seed: int = 0) -> bytes:
    """A synthetic slot file of ``shape`` (one cache, or recurrent state too), as llama-server lays it out."""
    rng = np.random.default_rng(seed)
    sf = SlotFile(version=4, tokens=rng.integers(0, 250, n).astype(np.int32))
    cells = np.stack([np.arange(n), np.ones(n), np.zeros(n)], axis=1).astype(np.int32)
    sf.cells = cells
    for kw, vw in shape.kv_widths:
        kb, vb = S.GGML_TYPES[kv_type][2] * kw // S.GGML_TYPES[kv_type][1], \
            S.GGML_TYPES[kv_type][2] * vw // S.GGML_TYPES[kv_type][1]
        sf.kv.append(KvLayer(kv_type, kb, rng.bytes(kb * n), kv_type, vb, rng.bytes(vb * n)))
    if shape.recurrent_layers:
        sf.rec_cell = np.array([n - 1, 1, 0], np.int32)
        sf.rec_n_layer = shape.n_layer
        r, s = shape.rec_widths
        sf.rec = [RecLayer(F32, 4 * r, rng.bytes(4 * r), F32, 4 * s, rng.bytes(4 * s)) for _ in shape.recurrent_layers]
    return S.encode(sf)


def _import(store: str, model: str, data: bytes) -> int:
    ss = SlotStore(store, model, BUILD)
    try:
        sid = ss.import_bytes(data).save.snapshot_id
        assert sid is not None
        return sid
    finally:
        ss.close()


def _export(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any] | None, str]:
    code = main(["--json", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@pytest.mark.parametrize("other, first_difference", [
    ("3layers", "attention layers is 0,1,2 there, 0,1 in the snapshot"),
    ("1kvhead", "attention layer 0's K row is 32 bytes there, 64 bytes in the snapshot"),
    ("lfm2", "architecture is 'lfm2' there, 'llama' in the snapshot"),
])
def test_another_cache_layout_is_refused_naming_the_first_difference(ggufs, tmp_path, capsys, other,
                                                                     first_difference):
    store = str(tmp_path / "store")
    sid = _import(store, ggufs["f32"], _file(model_info(ggufs["f32"]).shape))
    out = tmp_path / "moved.bin"
    code, doc, err = _export(capsys, "--dir", store, "export-slot", str(sid), str(out), "--for-model", ggufs[other])
    assert code == 2 and doc is None and not out.exists() and not (tmp_path / "moved.bin.tmp").exists()
    assert first_difference in json.loads(err)["error"], err


def test_another_quant_of_the_same_model_is_written_as_an_approximation(ggufs, tmp_path, capsys):
    store = str(tmp_path / "store")
    data = _file(model_info(ggufs["f32"]).shape)
    sid = _import(store, ggufs["f32"], data)
    for quant in ("f16", "q8_0"):
        out = tmp_path / f"{quant}.bin"
        code, doc, err = _export(capsys, "--dir", store, "export-slot", str(sid), str(out), "--for-model", ggufs[quant])
        assert code == 0 and doc is not None, err
        assert doc["exact"] is False and doc["for_model"] == ggufs[quant]
        assert out.read_bytes() == data  # the snapshot's own slot file: only the check differs
        assert "approximation" in err
    code, doc, _ = _export(capsys, "--dir", store, "export-slot", str(sid), str(tmp_path / "own.bin"))
    assert code == 0 and doc is not None and doc["exact"] is True and doc["for_model"] is None
    # nothing was stored for the other quant: its store sees no snapshot, so nothing ever matches there
    other = SlotStore(store, ggufs["q8_0"], BUILD)
    try:
        other.import_bytes(_file(model_info(ggufs["q8_0"]).shape, n=4, seed=9))  # opens its identity
        assert other.match(S.decode(data, other.model.shape).tokens.tolist()) is None
    finally:
        other.close()


def test_target_cache_types_are_checked(ggufs, tmp_path, capsys):
    store = str(tmp_path / "store")
    sid = _import(store, ggufs["f32"], _file(model_info(ggufs["f32"]).shape))
    argv = ["--dir", store, "export-slot", str(sid), str(tmp_path / "o.bin"), "--for-model", ggufs["f16"]]
    code, _, err = _export(capsys, *argv, "--cache-type-k", "q8_0")
    assert code == 2 and "attention layer 0's K cache type is q8_0 (the target's) there, f16 in the snapshot" in err
    code, _, err = _export(capsys, *argv, "--cache-type-v", "q8_0")
    assert code == 2 and "V cache type" in err
    code, _, err = _export(capsys, *argv, "--cache-type-k", "f17")
    assert code == 2 and "unknown cache type 'f17'" in err
    # a q8_0 cache exports only to a target that runs q8_0 (and its rows are q8_0 blocks of OTHER's width)
    sid8 = _import(str(tmp_path / "s8"), ggufs["f32"], _file(model_info(ggufs["f32"]).shape, kv_type=Q8_0))
    argv8 = ["--dir", str(tmp_path / "s8"), "export-slot", str(sid8), str(tmp_path / "o8.bin"), "--for-model",
             ggufs["q8_0"]]
    assert _export(capsys, *argv8)[0] == 2
    assert _export(capsys, *argv8, "--cache-type-k", "q8_0", "--cache-type-v", "q8_0")[0] == 0
    code, _, err = _export(capsys, "--dir", store, "export-slot", str(sid), str(tmp_path / "p.bin"),
                           "--cache-type-k", "f16")
    assert code == 2 and "only go with --for-model" in err


def test_recurrent_and_window_shapes(ggufs, tmp_path):
    """Hybrid: the layer count and recurrent layers; iSWA: the window (identity keys, against OTHER's metadata)."""
    g = model_info(ggufs["granite"]).shape
    extra = _proto_extra(_file(g), g)
    assert check_for_model(extra, g, "same").recurrent_layers == (0, 2)
    with pytest.raises(CacheLayoutMismatchError, match="the layer count is 5 there, 4 in the snapshot"):
        check_for_model(extra, model_shape(ggufs["granite_wide"]), "wide")
    wider = ModelShape(g.arch, g.n_layer, g.attn_layers, g.recurrent_layers, g.kv_widths,
                       (g.rec_widths[0], g.rec_widths[1] * 2))
    with pytest.raises(CacheLayoutMismatchError, match="layer 0's recurrent state"):
        check_for_model(extra, wider, "wider state")
    gm = model_shape(ggufs["gemma3"])
    swa = {**_proto_extra(_file(ModelShape("gemma3", 8, gm.attn_layers, (), gm.kv_widths)),
                          ModelShape("gemma3", 8, gm.attn_layers, (), gm.kv_widths)),
           "arch": "gemma3", "swa_layout": "1,64,1,64,0,0", "swa_window": "32"}
    check_for_model(swa, gm, "same window")
    with pytest.raises(CacheLayoutMismatchError, match="the sliding window is 16 there, 32 in the snapshot"):
        check_for_model(swa, model_shape(ggufs["gemma3_w16"]), "w16")


def _proto_extra(data: bytes, shape: ModelShape) -> dict[str, str]:
    sf = S.decode(data, shape)
    return {"arch": shape.arch, **SlotProto.of(sf, shape).to_extra()}


def _complete(srv: Any, tokens: list[int], n: int = 8) -> tuple[str, int]:
    r = srv.post("/completion", {"prompt": tokens, "n_predict": n, "cache_prompt": True, "id_slot": 0,
                                 "temperature": 0})
    return r["content"], r["timings"]["cache_n"]


@pytest.mark.slow
def test_exported_slot_restores_in_a_server_running_the_other_quant(ggufs, tmp_path, capsys):
    """The real llama-server: a slot of the f32 model, exported --for-model the q8_0 quant, is restored
    by a server running the q8_0 GGUF and its whole prefix reused there."""
    pytest.importorskip("xllamacpp")
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(ggufs["f32"], slots) as a:
        prompt = a.post("/tokenize", {"content": h.text_of(80, seed=4), "add_special": True})["tokens"]
        tail = a.post("/tokenize", {"content": " " + h.text_of(6, seed=5), "add_special": False})["tokens"]
        a.post("/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
        a.post("/slots/0?action=save", {"filename": "orig.bin"})
    with open(os.path.join(slots, "orig.bin"), "rb") as f:
        sid = _import(store, ggufs["f32"], f.read())
    code, doc, err = _export(capsys, "--dir", store, "export-slot", str(sid), os.path.join(slots, "moved.bin"),
                             "--for-model", ggufs["q8_0"])
    assert code == 0 and doc is not None and doc["exact"] is False, err
    code, _, err = _export(capsys, "--dir", store, "export-slot", str(sid), os.path.join(slots, "no.bin"),
                           "--for-model", ggufs["3layers"])
    assert code == 2 and not os.path.exists(os.path.join(slots, "no.bin"))
    more = prompt + tail
    with h.server_process(ggufs["q8_0"], slots) as b:
        r = b.post("/slots/0?action=restore", {"filename": "moved.bin"})
        assert r["n_restored"] == len(prompt)
        _, reused = _complete(b, more)
    assert reused == len(prompt)  # llama-server continued from the moved state (an approximation, not checked)
