"""The draft-context appendix of a slot file (``SDFT``, seed 004; issue 27 item 3).

After the state and the ``SCKP`` checkpoints a slot file may carry ``u32 'SDFT', u32 version,
u64 size, blob``: the draft context's sequence state. No llama-server build writes it yet, so the
files here are built to that layout by hand (``struct``), on the slot layout of a tiny llama
GGUF. What must hold: the codec round-trips it byte for byte and refuses a version it does not
know; the store keeps it as the snapshot's optional ``draft`` component (rows, so a longer
conversation stores only its new draft rows); a file without it imports with an empty draft and
exports without it; an export leaves it out where the target runs no draft; a reader that does
not know it (a restore without the component, and the real llama-server, slow tier) restores
the rest.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

pytest.importorskip("gguf")

import helpers_llamacpp as h  # noqa: E402

from snapstore.cli.main import main  # noqa: E402
from snapstore.engine.llamacpp import _slotfile as S  # noqa: E402
from snapstore.engine.llamacpp._identify import model_info  # noqa: E402
from snapstore.engine.llamacpp._slotstore import SlotStore  # noqa: E402

BUILD = "test-build-draft"
F16 = 1
SDFT, SCKP = b"SDFT", b"SCKP"
W = 32  # K/V elements per token of the tiny llama (2 KV heads x 16)
DW = 16  # the draft model's K/V elements per token (another, smaller model)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return h.write_llama(str(tmp_path_factory.mktemp("draft") / "llama.gguf"))


def _kv_section(rng: np.random.Generator, n: int, n_layer: int, width: int) -> bytes:
    """One K/V cache section as llama.cpp writes it (state version 4, V as rows), by hand."""
    out = struct.pack("<II", 1, n)  # one stream, n cells
    for p in range(n):
        out += struct.pack("<iIi", p, 1, 0)  # pos, n_seq_id, seq_id
    out += struct.pack("<II", 0, n_layer) + struct.pack("<II", 0, 0)  # v_trans, n_layer, v4 words
    rows = [[rng.bytes(2 * width * n) for _ in range(n_layer)] for _kv in "kv"]
    for part in rows:
        for layer in part:
            out += struct.pack("<iQ", F16, 2 * width) + layer
    return out


def slot_file(tokens: list[int], *, draft: bytes | None = None, draft_version: int = 1, checkpoints: bool = False,
              seed: int = 0) -> bytes:
    """A slot file of the tiny llama: tokens, its K/V cache, then optionally an (empty) SCKP block and
    an SDFT block holding ``draft``."""
    rng = np.random.default_rng(seed)
    n = len(tokens)
    out = struct.pack("<II", 0x67677371, 4)
    words = [-1, 1, n, *tokens, 0]
    out += struct.pack("<I", len(words)) + struct.pack(f"<{len(words)}i", *words)
    out += _kv_section(rng, n, 2, W)
    if checkpoints:
        out += SCKP + struct.pack("<II", 1, 0)
    if draft is not None:
        out += SDFT + struct.pack("<IQ", draft_version, len(draft)) + draft
    return out


def draft_state(n: int, seed: int = 1) -> bytes:
    """The draft context's sequence state: a one-layer draft model's K/V of the same n positions."""
    return _kv_section(np.random.default_rng(seed), n, 1, DW)


TOKENS = list(range(10, 70))


def test_codec_round_trips_the_appendix_and_refuses_what_it_does_not_know(model):
    shape = model_info(model).shape
    for ckpt in (False, True):
        data = slot_file(TOKENS, draft=draft_state(60), checkpoints=ckpt)
        sf = S.decode(data, shape)
        assert sf.draft == draft_state(60) and sf.draft_kv is not None and len(sf.draft_kv.kv) == 1
        assert S.encode(sf) == data
        sf.draft = None  # rebuilt from the decoded rows, as an export does
        assert S.encode(sf) == data
    plain = slot_file(TOKENS)
    assert S.decode(plain, shape).draft is None  # no appendix: an empty draft
    with pytest.raises(S.SlotFormatError, match="draft-context block version 2 is unknown"):
        S.decode(slot_file(TOKENS, draft=draft_state(60), draft_version=2), shape)
    full = slot_file(TOKENS, draft=draft_state(60))
    for cut in range(len(plain) + 1, len(full)):
        with pytest.raises(S.SlotFormatError):
            S.decode(full[:cut], shape)
    with pytest.raises(S.SlotFormatError, match="unexpected bytes"):
        S.decode(full + b"\0" * 4, shape)
    odd = S.decode(slot_file(TOKENS, draft=b"\x07" * 33), shape)  # not a K/V cache: kept as bytes only
    assert odd.draft == b"\x07" * 33 and odd.draft_kv is None


def test_draft_is_the_snapshots_optional_component(model, tmp_path):
    store = SlotStore(str(tmp_path / "store"), model, BUILD)
    try:
        short = slot_file(TOKENS[:40], draft=draft_state(40), seed=3)
        a = store.import_bytes(short)
        assert a.draft == "stored" and store.store is not None and store.store.identity.mtp
        assert store.store.describe(a.save.snapshot_id).components == {"draft"}
        assert store.export_bytes(a.save.snapshot_id) == short  # with its SDFT block, byte-identical
        # a longer conversation: its first 40 rows (target and draft) are the stored ones
        sf = S.decode(short, store.model.shape)
        longer = S.decode(slot_file(TOKENS, draft=draft_state(60), seed=4), store.model.shape)
        for mine, old in zip(longer.kv + longer.draft_kv.kv, sf.kv + sf.draft_kv.kv):  # type: ignore[union-attr]
            mine.k = old.k + mine.k[len(old.k):]
            mine.v = old.v + mine.v[len(old.v):]
        longer.draft = None
        b = store.import_bytes(S.encode(longer))
        assert b.save.parent_id == a.save.snapshot_id and b.draft == "stored"
        assert store.export_bytes(b.save.snapshot_id) == S.encode(longer)
        # without the draft: a target that runs no draft model, or a reader that does not know it
        assert store.export_bytes(b.save.snapshot_id, draft=False) == \
            S.encode(_without_draft(longer))
        res = store.store.restore(b.save.snapshot_id, into={k: v for k, v in _dest(store, 60).items()
                                                              if not k.startswith("draft.")}, components=[])
        assert res.n_tokens == 60 and res.missing_components == frozenset()
        # a file without the appendix: stored without the component, exported without the block
        plain = slot_file([5, 6, *TOKENS], seed=5)  # another conversation (no shared prefix)
        c = store.import_bytes(plain)
        assert c.draft == "none" and store.store.describe(c.save.snapshot_id).missing_components == {"draft"}
        assert store.export_bytes(c.save.snapshot_id) == plain
        # a draft blob that is not the slot's positions as one K/V cache: the rest is stored
        odd = slot_file([7, *TOKENS], draft=b"\x07" * 33, seed=6)
        d = store.import_bytes(odd)
        assert d.draft == "dropped" and d.save.snapshot_id is not None
        assert store.export_bytes(d.save.snapshot_id) == slot_file([7, *TOKENS], seed=6)
    finally:
        store.close()


def _without_draft(sf: S.SlotFile) -> S.SlotFile:
    sf2 = S.SlotFile(**{**sf.__dict__, "draft": None, "draft_kv": None})
    return sf2


def _dest(store: SlotStore, n: int) -> dict[str, np.ndarray]:
    from snapstore.engine.llamacpp._slotparts import empty_parts

    assert store.store is not None
    return empty_parts(store.store.layout, n)


def test_a_store_opened_without_a_draft_stores_the_rest(model, tmp_path, capsys):
    """The first file a SlotStore opens fixes its identity (no draft: mtp false, no draft keys); a later
    file's draft is then not stored, the rest is. The CLI says what it did with the draft, and
    export-slot --no-draft leaves a stored draft out."""
    store = SlotStore(str(tmp_path / "store"), model, BUILD)
    try:
        a = store.import_bytes(slot_file(TOKENS[:30], seed=7))
        b = store.import_bytes(slot_file([9, *TOKENS], draft=draft_state(61), seed=8))
        assert (a.draft, b.draft) == ("none", "dropped") and store.store is not None
        assert not store.store.identity.mtp and "draft_layout" not in store.store.identity.extra
        assert store.export_bytes(b.save.snapshot_id) == slot_file([9, *TOKENS], seed=8)
    finally:
        store.close()
    d = str(tmp_path / "store2")
    src = tmp_path / "b.bin"
    src.write_bytes(slot_file(TOKENS, draft=draft_state(60), seed=8))
    assert main(["--dir", d, "--json", "import-slot", str(src), "--model", model, "--build", BUILD]) == 0
    doc = json.loads(capsys.readouterr()[0])
    assert doc["draft"] == "stored"
    for flag, want in (([], src.read_bytes()), (["--no-draft"], slot_file(TOKENS, seed=8))):
        out = str(tmp_path / f"out{len(flag)}.bin")
        assert main(["--dir", d, "export-slot", str(doc["snapshot_id"]), out, *flag]) == 0
        capsys.readouterr()
        with open(out, "rb") as f:
            assert f.read() == want


@pytest.mark.slow
def test_llama_server_that_does_not_know_the_appendix_restores_the_rest(model, tmp_path):
    """The bundled llama-server writes no SDFT block and does not read one: a real slot file with the
    appendix (imported, stored with its draft, exported) is restored by it and its prefix reused."""
    pytest.importorskip("xllamacpp")
    slots = str(tmp_path / "slots")
    with h.server_process(model, slots) as a:
        prompt = a.post("/tokenize", {"content": h.text_of(50, seed=2), "add_special": True})["tokens"]
        tail = a.post("/tokenize", {"content": " " + h.text_of(5, seed=3), "add_special": False})["tokens"]
        a.post("/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
        a.post("/slots/0?action=save", {"filename": "orig.bin"})
        want = a.post("/completion", {"prompt": prompt + tail, "n_predict": 8, "cache_prompt": True, "id_slot": 0,
                                      "temperature": 0})["content"]
    with open(os.path.join(slots, "orig.bin"), "rb") as f:
        orig = f.read()
    with_draft = orig + SDFT + struct.pack("<IQ", 1, len(draft_state(len(prompt)))) + draft_state(len(prompt))
    store = SlotStore(str(tmp_path / "store"), model, BUILD)
    try:
        imp = store.import_bytes(with_draft)
        assert imp.draft == "stored"
        back = store.export_bytes(imp.save.snapshot_id)
    finally:
        store.close()
    assert back == with_draft
    with open(os.path.join(slots, "back.bin"), "wb") as f:
        f.write(back)
    with h.server_process(model, slots) as b:
        assert b.post("/slots/0?action=restore", {"filename": "back.bin"})["n_restored"] == len(prompt)
        r = b.post("/completion", {"prompt": prompt + tail, "n_predict": 8, "cache_prompt": True, "id_slot": 0,
                                   "temperature": 0})
    assert r["timings"]["cache_n"] == len(prompt) and r["content"] == want
