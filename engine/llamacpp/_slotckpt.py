"""llama-server's context checkpoints (the ``SCKP`` block) as slot files at their own positions.

A hybrid model's recurrent state is only valid at the token it was taken, so llama-server keeps
*context checkpoints*: the partial state (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: the recurrent
cell on a hybrid) after the first ``n_tokens`` of the prompt, and builds that persist them write
them after the state. A checkpoint plus the first ``n_tokens`` attention rows of the file is the
slot as it was at ``n_tokens``: :func:`checkpoint_slots` builds those slot files, so each is stored
as a snapshot at its own position (a delta over the shorter ones) and a new chat that shares only
a prefix with a stored conversation restores the deepest checkpoint inside it.

Each checkpoint entry: ``u64 n_tokens, i32 pos_min, i32 pos_max`` and three length-prefixed blobs;
the first is the state: ``u32 0xAF143CD8, u32 0`` and then the recurrent section as in the file
(docs/format.md §11). Only checkpoints of that form (recurrent state of the last checkpoint
token, ``pos_min == pos_max == n_tokens - 1``, the other two blobs empty) on a model without a
sliding window are used; any other is left out (counted as dropped by the import).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ._slotfile import SlotFormatError, _decode_rec, _Reader
from ._slotmodel import CKPT_MAGIC, CKPT_VERSION, KvLayer, ModelShape, SlotFile

__all__ = ["CKPT_STATE_MAGIC", "MAX_WRITTEN", "Checkpoint", "checkpoint_block", "checkpoint_slots", "checkpoints_of"]

MAX_WRITTEN = 8  # checkpoints an export writes back at most (the deepest; llama-server keeps 8 by default)

CKPT_STATE_MAGIC = 0xAF143CD8  # the start of a checkpoint's state blob


@dataclass
class Checkpoint:
    """One entry of the ``SCKP`` block, as written."""

    n_tokens: int
    pos_min: int
    pos_max: int
    state: bytes
    extra: tuple[bytes, bytes]


def checkpoints_of(sf: SlotFile) -> list[Checkpoint]:
    """The entries of ``sf``'s checkpoint block (the codec has checked its framing)."""
    if not sf.checkpoints:
        return []
    r = _Reader(sf.checkpoints, "checkpoint block")
    if r.u32("magic") != CKPT_MAGIC or r.u32("version") != CKPT_VERSION:
        raise SlotFormatError("checkpoint block: not an SCKP block of version 1")
    out = []
    for i in range(r.u32("count")):
        n, lo, hi = r.u64(f"checkpoint {i} n_tokens"), r.i32(f"checkpoint {i} pos_min"), r.i32(f"checkpoint {i} max")
        blobs = [bytes(r.take(r.u64(f"checkpoint {i} blob size"), f"checkpoint {i} blob")) for _ in range(3)]
        out.append(Checkpoint(n, lo, hi, blobs[0], (blobs[1], blobs[2])))
    return out


def checkpoint_slots(sf: SlotFile, shape: ModelShape) -> list[SlotFile]:
    """The slot at each usable checkpoint of ``sf`` (shortest first): its first ``n_tokens`` tokens,
    cells and attention rows with the checkpoint's recurrent state; no checkpoint block of its own."""
    if not shape.recurrent_layers or shape.n_swa or sf.swa is not None:
        return []
    out = []
    for cp in sorted(checkpoints_of(sf), key=lambda c: c.n_tokens):
        n = cp.n_tokens
        if not 0 < n < sf.n_tokens or cp.pos_min != n - 1 or cp.pos_max != n - 1 or any(cp.extra):
            continue
        part = _recurrent_state(cp.state, sf, shape)
        if part is None or part.rec_cell is None or int(part.rec_cell[0]) != n - 1:
            continue
        cut = SlotFile(version=sf.version, tokens=sf.tokens[:n].copy(), token_form=sf.token_form,
                       n_stream=sf.n_stream, stream=sf.stream, cells=sf.cells[:n], cell_ext=sf.cell_ext,
                       v_trans=sf.v_trans, rec_cell=part.rec_cell, rec_n_layer=part.rec_n_layer, rec=part.rec,
                       s_trans=part.s_trans)
        cut.kv = [KvLayer(ly.k_type, ly.k_row, ly.k[: n * ly.k_row], ly.v_type, ly.v_row, ly.v[: n * ly.v_row],
                          ly.v_el, ly.n_embd_v) for ly in sf.kv]
        out.append(cut)
    return out


def _recurrent_state(blob: bytes, sf: SlotFile, shape: ModelShape) -> SlotFile | None:
    """A checkpoint state blob's recurrent section, or None when the blob is not of that form."""
    if len(blob) < 8 or struct.unpack_from("<II", blob) != (CKPT_STATE_MAGIC, 0):
        return None
    r = _Reader(memoryview(blob)[8:], "checkpoint state")
    part = SlotFile(version=sf.version, tokens=sf.tokens[:0])
    try:
        _decode_rec(r, part, shape, r.what)
    except SlotFormatError:
        return None
    if r.left() or [(x.r_type, x.r_row, x.s_type, x.s_row) for x in part.rec] != \
            [(x.r_type, x.r_row, x.s_type, x.s_row) for x in sf.rec]:
        return None
    return part


def checkpoint_block(states: list[SlotFile]) -> bytes:
    """The ``SCKP`` block of the slots ``states`` (stored prefixes of an exported slot, each with its
    recurrent state): one checkpoint each at its own token count, shortest first, as llama-server
    writes them, so a server restoring the export can also resume at those positions."""
    if not states:
        return b""
    out = bytearray(struct.pack("<III", CKPT_MAGIC, CKPT_VERSION, len(states)))
    for st in sorted(states, key=lambda x: x.n_tokens):
        assert st.rec_cell is not None
        pos, nseq, seq = (int(x) for x in st.rec_cell)
        blob = bytearray(struct.pack("<II", CKPT_STATE_MAGIC, 0))
        blob += struct.pack("<IiI", 1, pos, nseq) + (struct.pack("<i", seq) if nseq else b"")
        blob += struct.pack("<II", st.s_trans, st.rec_n_layer)
        for rl in st.rec:
            blob += struct.pack("<iQ", rl.r_type, rl.r_row) + rl.r
        for rl in st.rec:
            blob += struct.pack("<iQ", rl.s_type, rl.s_row) + rl.s
        out += struct.pack("<QiiQ", st.n_tokens, pos, pos, len(blob)) + blob + struct.pack("<QQ", 0, 0)
    return bytes(out)
