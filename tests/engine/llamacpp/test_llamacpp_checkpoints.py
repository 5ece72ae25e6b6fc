"""llama-server's context checkpoints (``SCKP``) become snapshots at their own positions (issue 27 item 2).

A hybrid model's recurrent state cannot be cut to a prefix, so a stored conversation used to serve
only its whole prompt. Each checkpoint the file carries is now a snapshot at its own position (a
delta over the shorter ones, the file's state a delta over the deepest), so a *new* chat that
shares only a prefix with a stored conversation restores the deepest checkpoint inside it.

Fast tier: a hybrid slot file built to the layout by hand (the checkpoint state blob:
``0xAF143CD8, 0``, then the recurrent section). Slow tier: the real llama-server's file of a
granitehybrid (Mamba2 + attention) GGUF, restored into a new server at the checkpoint: the
continuation of a new prompt sharing only that prefix is the uninterrupted run's.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

pytest.importorskip("gguf")

import helpers_llamacpp as h  # noqa: E402

from snapstore.engine.llamacpp import _slotfile as S  # noqa: E402
from snapstore.engine.llamacpp._identify import model_info  # noqa: E402
from snapstore.engine.llamacpp._slotckpt import CKPT_STATE_MAGIC, checkpoint_slots  # noqa: E402
from snapstore.engine.llamacpp._slotmodel import KvLayer, RecLayer, SlotFile  # noqa: E402
from snapstore.engine.llamacpp._slotstore import SlotStore, export_snapshot  # noqa: E402

BUILD = "test-build-checkpoints"


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> str:
    return h.write_granitehybrid(str(tmp_path_factory.mktemp("ckpt") / "granite.gguf"))


def _rec_section(rng: np.random.Generator, pos: int, shape, rec_rows: tuple[int, int]) -> tuple[bytes, list[RecLayer]]:
    layers = [RecLayer(0, rec_rows[0], rng.bytes(rec_rows[0]), 0, rec_rows[1], rng.bytes(rec_rows[1]))
              for _ in shape.recurrent_layers]
    out = struct.pack("<IiIII", 1, pos, 0, 0, shape.n_layer)  # one cell at pos, no seq id, s_trans, n_layer
    for rl in layers:
        out += struct.pack("<iQ", 0, rl.r_row) + rl.r
    for rl in layers:
        out += struct.pack("<iQ", 0, rl.s_row) + rl.s
    return out, layers


def hybrid_file(shape, n: int, checkpoints: list[int], seed: int = 0, extra: bytes = b"") -> tuple[bytes, dict]:
    """A granitehybrid slot file of ``n`` tokens whose SCKP block holds the recurrent state at each of
    ``checkpoints`` (token counts); also returns each checkpoint's recurrent layers."""
    rng = np.random.default_rng(seed)
    rows = (4 * shape.rec_widths[0], 4 * shape.rec_widths[1])
    sf = SlotFile(version=4, tokens=rng.integers(10, 250, n).astype(np.int32))
    sf.cells = np.stack([np.arange(n), np.ones(n), np.zeros(n)], axis=1).astype(np.int32)
    for kw, vw in shape.kv_widths:
        sf.kv.append(KvLayer(1, 2 * kw, rng.bytes(2 * kw * n), 1, 2 * vw, rng.bytes(2 * vw * n)))
    sf.rec_cell = np.array([n - 1, 0, 0], np.int32)
    sf.rec_n_layer = shape.n_layer
    _, sf.rec = _rec_section(rng, n - 1, shape, rows)
    block = b"SCKP" + struct.pack("<II", 1, len(checkpoints))
    states = {}
    for c in checkpoints:
        sec, states[c] = _rec_section(rng, c - 1, shape, rows)
        blob = struct.pack("<II", CKPT_STATE_MAGIC, 0) + sec
        block += struct.pack("<QiiQ", c, c - 1, c - 1, len(blob)) + blob
        block += struct.pack("<Q", len(extra)) + extra + struct.pack("<Q", 0)
    sf.checkpoints, sf.n_checkpoints = block, len(checkpoints)
    return S.encode(sf), states


def test_each_checkpoint_is_a_snapshot_at_its_position(granite, tmp_path):
    shape = model_info(granite).shape
    data, states = hybrid_file(shape, 60, [20, 45])
    sf = S.decode(data, shape)
    cuts = checkpoint_slots(sf, shape)
    assert [c.n_tokens for c in cuts] == [20, 45]
    for c in cuts:
        assert c.rec_cell is not None and int(c.rec_cell[0]) == c.n_tokens - 1
        assert [rl.s for rl in c.rec] == [rl.s for rl in states[c.n_tokens]]
        assert all(ly.k == full.k[: c.n_tokens * ly.k_row] for ly, full in zip(c.kv, sf.kv))
    store = SlotStore(str(tmp_path / "store"), granite, BUILD)
    try:
        imp = store.import_bytes(data)
        ids = [r.snapshot_id for r in imp.checkpoints]
        assert len(ids) == 2 and imp.checkpoints_dropped == 0
        assert imp.checkpoints[1].parent_id == ids[0] and imp.save.parent_id == ids[1]  # a delta chain
        # a new prompt sharing only 50 tokens: the deepest checkpoint inside it, 45
        other = sf.tokens[:50].tolist() + [3, 4, 5]
        m = store.match(other)
        assert m is not None and m.n_tokens == 45
        back = S.decode(store.export_bytes(m), shape)
        assert back.n_tokens == 45 and [rl.r for rl in back.rec] == [rl.r for rl in states[45]]
        assert all(b.v == a.v[: 45 * a.v_row] for a, b in zip(sf.kv, back.kv))
        assert store.match(sf.tokens[:19].tolist()) is None  # nothing below the first checkpoint
        assert store.export_bytes(imp.save.snapshot_id) == data[: len(data) - len(sf.checkpoints)]  # proxy path
    finally:
        store.close()
    # export-slot writes the stored prefixes back as the checkpoints: here the original file, byte for byte
    assert export_snapshot(str(tmp_path / "store"), imp.save.snapshot_id) == data


def test_checkpoints_of_another_form_are_left_out(granite, tmp_path):
    """A checkpoint with a non-empty extra blob (a form not known here) is not used; the rest is stored."""
    shape = model_info(granite).shape
    data, _ = hybrid_file(shape, 60, [20, 45], extra=b"\1\2\3\4")
    assert checkpoint_slots(S.decode(data, shape), shape) == []
    store = SlotStore(str(tmp_path / "store"), granite, BUILD)
    try:
        imp = store.import_bytes(data)
        assert imp.checkpoints == [] and imp.checkpoints_dropped == 2 and imp.save.parent_id is None
    finally:
        store.close()


@pytest.mark.slow
def test_new_chat_sharing_a_prefix_restores_the_deepest_checkpoint(granite, tmp_path):
    """The real llama-server (granitehybrid) writes a slot with its checkpoints; after a restart a new
    prompt that shares only a prefix with it restores the deepest checkpoint inside that prefix
    into a new server, which reads only the rest and answers as the uninterrupted run."""
    pytest.importorskip("xllamacpp")
    slots = str(tmp_path / "slots")
    shape = model_info(granite).shape
    with h.server_process(granite, slots) as a:
        prompt = a.post("/tokenize", {"content": h.text_of(60, seed=5), "add_special": True})["tokens"]
        tail = a.post("/tokenize", {"content": " " + h.text_of(8, seed=6), "add_special": False})["tokens"]
        a.post("/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": True, "id_slot": 0})
        a.post("/slots/0?action=save", {"filename": "orig.bin"})
    with open(os.path.join(slots, "orig.bin"), "rb") as f:
        data = f.read()
    sf = S.decode(data, shape)
    cps = sorted(c.n_tokens for c in checkpoint_slots(sf, shape))
    assert sf.n_checkpoints >= 1 and cps, sf.n_checkpoints
    deepest = cps[-1]
    assert deepest + 2 < len(prompt)
    new = prompt[: deepest + 2] + tail  # shares deepest + 2 tokens with the stored conversation, not all
    with h.server_process(granite, slots) as ref:  # the uninterrupted run: everything read from nothing
        want = ref.post("/completion", {"prompt": new, "n_predict": 10, "cache_prompt": True, "id_slot": 0,
                                        "temperature": 0})
    with h.server_process(granite, slots) as own:  # llama-server's own restore of the file, for comparison
        own.post("/slots/0?action=restore", {"filename": "orig.bin"})
        theirs = own.post("/completion", {"prompt": new, "n_predict": 10, "cache_prompt": True, "id_slot": 0,
                                          "temperature": 0})
    store = SlotStore(str(tmp_path / "store"), granite, BUILD)
    try:
        imp = store.import_bytes(data)
        assert [r.snapshot_id is not None for r in imp.checkpoints] == [True] * len(cps)
        m = store.match(new)
        assert m is not None and m.n_tokens == deepest
        back = store.export_bytes(m)
    finally:
        store.close()
    # export-slot of the whole conversation writes its stored prefixes back as context checkpoints
    full = export_snapshot(str(tmp_path / "store"), imp.save.snapshot_id)
    assert sorted(c.n_tokens for c in checkpoint_slots(S.decode(full, shape), shape)) == cps
    with open(os.path.join(slots, "ckpt.bin"), "wb") as f:
        f.write(back)
    with open(os.path.join(slots, "full.bin"), "wb") as f:
        f.write(full)
    with h.server_process(granite, slots) as c:  # llama-server resumes at the checkpoint it was given back
        assert c.post("/slots/0?action=restore", {"filename": "full.bin"})["n_restored"] == len(prompt)
        via_ckpt = c.post("/completion", {"prompt": new, "n_predict": 10, "cache_prompt": True, "id_slot": 0,
                                          "temperature": 0})
    assert via_ckpt["content"] == want["content"] and via_ckpt["timings"]["cache_n"] == deepest
    with h.server_process(granite, slots) as b:
        assert b.post("/slots/0?action=restore", {"filename": "ckpt.bin"})["n_restored"] == deepest
        got = b.post("/completion", {"prompt": new, "n_predict": 10, "cache_prompt": True, "id_slot": 0,
                                     "temperature": 0})
    assert got["content"] == want["content"]  # greedy continuation byte-identical
    assert got["timings"]["cache_n"] == deepest  # only the rest was read
    print(f"checkpoints at {cps} of {len(prompt)} tokens; new prompt of {len(new)} sharing {deepest + 2}: "
          f"restored {got['timings']['cache_n']} (llama-server's own restore of the file: "
          f"{theirs['timings']['cache_n']})")
