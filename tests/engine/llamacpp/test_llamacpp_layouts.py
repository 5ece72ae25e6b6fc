"""Every memory layout llama-server writes, through the store and back into a new server (issue 27).

For each tiny GGUF written here — attention only (llama), short-conv + attention (LFM2), Mamba2 +
attention (granitehybrid; nemotron_h with MLP-only layers too), Mamba2 alone, gated delta net +
attention (qwen35 with M-RoPE cells, qwen3next with MoE), full + sliding-window caches (gemma3,
gpt-oss: iSWA) — the real
llama-server (xllamacpp) writes a slot file; it is imported into a store, exported, restored into
a new server process, and the greedy continuation of a longer prompt must be byte-identical to a
run that read the whole prompt from nothing, while reusing the restored prefix.

The layer shapes are read from each GGUF's own metadata (``_modelshape``), never from a list of
architectures: the fast tests here check that on the written GGUFs and on a renamed architecture.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("gguf")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp import _slotfile as S  # noqa: E402
from snapstore.engine.llamacpp._identify import model_info  # noqa: E402
from snapstore.engine.llamacpp._slotstore import SlotStore  # noqa: E402

BUILD = "test-build-layouts"
ARCHS = ["llama", "lfm2", "granitehybrid", "nemotron_h", "mamba2", "qwen35", "qwen3next", "gemma3", "gpt-oss"]

# what the GGUF metadata says each layer keeps: (attention layers, recurrent layers, window)
SHAPES = {
    "llama": ((0, 1), (), 0),
    "lfm2": ((1, 3), (0, 2), 0),
    "granitehybrid": ((1, 3), (0, 2), 0),
    "nemotron_h": ((2,), (0, 4), 0),  # layers 1, 3, 5 are MLP only: neither
    "mamba2": ((), (0, 1), 0),
    "qwen35": ((3,), (0, 1, 2), 0),
    "qwen3next": ((3,), (0, 1, 2), 0),
    "gemma3": (tuple(range(8)), (), 32),
    "gpt-oss": (tuple(range(4)), (), 32),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("layout_models")
    return {a: h.WRITERS[a](str(d / f"{a}.gguf")) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_shape_from_gguf_metadata(models, arch):
    shape = model_info(models[arch]).shape
    assert (shape.attn_layers, shape.recurrent_layers, shape.n_swa) == SHAPES[arch]
    assert shape.hybrid == (arch != "llama")  # state valid only at the slot's end (recurrent or window)


def test_no_architecture_list(tmp_path):
    """A Mamba2 hybrid under an architecture name no code knows: the same shape, from its tensors and keys."""
    import gguf

    src = h.write_granitehybrid(str(tmp_path / "g.gguf"), layers="maam")
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(tmp_path / "renamed.gguf"), "someday-hybrid")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        name = f.name.replace("granitehybrid.", "someday-hybrid.")
        val = f.contents()
        if isinstance(val, list):
            w.add_array(name, val)
        elif isinstance(val, str):
            w.add_string(name, val)
        elif isinstance(val, float):
            w.add_float32(name, val)
        else:
            w.add_uint32(name, int(val))
    for t in r.tensors:
        w.add_tensor(t.name, t.data.copy())
    h._finish(w)
    shape = model_info(str(tmp_path / "renamed.gguf")).shape
    assert shape.arch == "someday-hybrid"
    assert (shape.attn_layers, shape.recurrent_layers) == ((1, 2), (0, 3))
    assert shape.rec_widths == ((4 - 1) * (128 + 2 * 16), 16 * 128)  # Mamba2 conv and SSM elements


def _tokens(srv, text, special=True):
    return srv.post("/tokenize", {"content": text, "add_special": special})["tokens"]


def _complete(srv, tokens, n=12):
    r = srv.post("/completion", {"prompt": tokens, "n_predict": n, "cache_prompt": True, "id_slot": 0,
                                 "temperature": 0})
    return r["content"], r["timings"]["cache_n"], r["tokens"] if "tokens" in r else None


def _decode_file(slots, name, shape):
    with open(os.path.join(slots, name), "rb") as f:
        data = f.read()
    return data, S.decode(data, shape)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_import_export_restore_continues_byte_identical(models, tmp_path, arch):
    """Two slot files (the prompt but its last token, then the whole prompt, as the proxy captures
    them) → the store → export → a new server: the continuation is the uninterrupted run's."""
    pytest.importorskip("xllamacpp")
    model, slots = models[arch], str(tmp_path / "slots")
    shape = model_info(model).shape
    with h.server_process(model, slots) as a:
        prompt = _tokens(a, h.text_of(90, seed=21))
        more = _tokens(a, " " + h.text_of(12, seed=22), special=False)
        for name, toks in (("short.bin", prompt[:-1]), ("orig.bin", prompt)):
            a.post("/completion", {"prompt": toks, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
            a.post("/slots/0?action=save", {"filename": name})
    short, _ = _decode_file(slots, "short.bin", shape)
    orig, sf = _decode_file(slots, "orig.bin", shape)
    assert sf.tokens.tolist() == prompt
    # the layout the file has is the one the GGUF metadata predicts
    assert len(sf.kv) + (len(sf.swa.kv) if sf.swa else 0) == len(shape.attn_layers)
    assert len(sf.rec) == len(shape.recurrent_layers)
    assert (sf.swa is not None) == (arch in ("gemma3", "gpt-oss"))
    if sf.swa is not None:  # llama-server writes the window's cells only
        assert len(sf.swa.cells) == shape.n_swa and sf.swa.cells[-1, 0] == len(prompt) - 1
    if arch == "qwen35":
        assert sf.cell_ext > 0  # M-RoPE cells carry an extension
    with h.server_process(model, slots) as ref:  # the uninterrupted run: the whole prompt from nothing
        want = _complete(ref, prompt + more)
    assert want[1] == 0

    alone = SlotStore(str(tmp_path / "alone"), model, BUILD)  # one file alone: byte-identical round trip
    try:
        imp = alone.import_bytes(orig)
        assert alone.export_bytes(imp.save.snapshot_id) == orig[: len(orig) - len(sf.checkpoints)]
    finally:
        alone.close()
    store = SlotStore(str(tmp_path / "store"), model, BUILD)
    try:
        first = store.import_bytes(short)
        imp = store.import_bytes(orig)
        assert imp.save.parent_id == first.save.snapshot_id and imp.n_tokens == len(prompt)
        back = store.export_bytes(imp.save.snapshot_id)
    finally:
        store.close()
    out = S.decode(back, shape)
    if sf.swa is None:
        assert back == orig[: len(orig) - len(sf.checkpoints)]  # byte-identical (the SCKP block is not stored)
    else:  # one more cell than the file, from the shorter snapshot: what llama-server needs to continue
        assert len(out.swa.cells) == shape.n_swa + 1
        assert (out.swa.cells[1:] == sf.swa.cells).all()
        assert all(b.k[b.k_row:] == a.k and b.v[b.v_row:] == a.v for a, b in zip(sf.swa.kv, out.swa.kv))
        out.swa = sf.swa
        assert S.encode(out) == orig[: len(orig) - len(sf.checkpoints)]  # everything else byte-identical
    with open(os.path.join(slots, "back.bin"), "wb") as f:
        f.write(back)
    with h.server_process(model, slots) as b:  # a new server: everything comes from the exported file
        r = b.post("/slots/0?action=restore", {"filename": "back.bin"})
        assert r["n_restored"] == len(prompt)
        got = _complete(b, prompt + more)
    assert got[0] == want[0], (arch, got[0], want[0])  # greedy continuation byte-identical
    assert got[1] == len(prompt), (arch, got[1], len(prompt))  # the whole restored prefix was reused
    print(f"{arch}: file {len(orig)} bytes ({sf.n_checkpoints} checkpoints), stored {imp.save.stored_bytes} "
          f"as a delta; reused {got[1]} of {len(prompt) + len(more)} prompt tokens")


SYS = h.text_of(60, seed=5)


def _chat(url, user, prev=()):
    msgs = [{"role": "system", "content": SYS}, *prev, {"role": "user", "content": user}]
    r = h.post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
    return r["choices"][0]["message"]["content"], r["timings"]["cache_n"], r["usage"]["prompt_tokens"]


def _prompt_tokens_read(url):
    """Prompt tokens the server evaluated since it started (its /metrics)."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("llamacpp:prompt_tokens_total"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["granitehybrid", "qwen35", "gemma3"])
def test_proxy_restart_restores_system_prompt(models, tmp_path, arch):
    """Through ``snapstore llama-proxy``: a chat, a restart of everything, a new chat sharing only the
    system prompt: the stored boundary is restored and the answer is the uninterrupted run's."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("xllamacpp")
    from snapstore.engine.llamacpp._bridge import LlamaBridge

    model = models[arch]
    slots, store = str(tmp_path / "slots"), str(tmp_path / "store")
    with h.server_process(model, slots) as s1:
        bridge = LlamaBridge(s1.url, slots, model, store_dir=store, build=BUILD)
        bridge.start()
        with h.proxy(bridge) as (url, _):
            _chat(url, "hello world")
        bridge.close()
    with h.server_process(model, slots) as ref:  # the uninterrupted run of the new chat: no store at all
        want = _chat(ref.url, "the cache question")
    with h.server_process(model, slots) as s2:  # a new process: the prefix comes from the store
        bridge = LlamaBridge(s2.url, slots, model, store_dir=store, build=BUILD)
        bridge.start()
        with h.proxy(bridge) as (url, _):
            got = _chat(url, "the cache question")
        bridge.close()
        read = _prompt_tokens_read(s2.url)
    assert got[0] == want[0]  # greedy answer byte-identical
    assert want[1] == 0 and got[1] >= 440, got  # the system prompt (about 446 tokens) was not read again
    assert read < got[2] // 2, read  # the new server did not read the restored system prompt again
    print(f"{arch}: proxy reuse {got[1]} of {got[2]} prompt tokens after a restart; the server read {read:.0f}")


@pytest.fixture(scope="module")
def layout_files(models, tmp_path_factory):
    """One real slot file per new layout (with llama-server's checkpoint block)."""
    pytest.importorskip("xllamacpp")
    d = str(tmp_path_factory.mktemp("layout_files"))
    out = {}
    for arch in ("granitehybrid", "nemotron_h", "mamba2", "qwen35", "gemma3"):
        with h.server_process(models[arch], d) as s:
            s.post("/completion", {"prompt": h.text_of(40, seed=3), "n_predict": 2, "cache_prompt": True, "id_slot": 0})
            s.post("/slots/0?action=save", {"filename": arch})
        with open(os.path.join(d, arch), "rb") as f:
            out[arch] = f.read()
    return out


@pytest.mark.slow
def test_new_layouts_parse_to_the_last_byte(models, layout_files):
    """Round trip byte-identical; every truncation, trailing bytes and another model's shape refused."""
    for arch, data in layout_files.items():
        shape = model_info(models[arch]).shape
        sf = S.decode(data, shape)
        assert S.encode(sf) == data and sf.n_checkpoints >= 1, arch
        for cut in sorted({*range(0, 64), *range(0, len(data), 331), len(data) - 1}):
            with pytest.raises(S.SlotFormatError):
                S.decode(data[:cut], shape)
        with pytest.raises(S.SlotFormatError, match="unexpected bytes"):
            S.decode(data + b"\0" * 8, shape)
    for arch, other in (("granitehybrid", "qwen35"), ("qwen35", "nemotron_h"), ("gemma3", "llama"),
                        ("mamba2", "granitehybrid"), ("nemotron_h", "lfm2")):
        with pytest.raises(S.SlotFormatError):
            S.decode(layout_files[arch], model_info(models[other]).shape)
