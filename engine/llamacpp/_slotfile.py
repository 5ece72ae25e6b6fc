"""llama-server slot files (``/slots/N?action=save``) <-> :class:`SlotFile`, byte for byte.

A slot file is ``llama_state_seq_save_file`` output: magic ``ggsq``, the state version, the token
payload (a plain token list, or llama-server's serialized server-tokens form that starts with
-1), then the sequence's memory in the order llama.cpp writes it: the attention K/V cache (on an
iSWA model the full-attention cache, then the sliding-window cache), then the recurrent cache
(Mamba/Mamba2 conv + SSM state, gated-delta-net state, LFM2 short-conv state); llama-server
builds that persist context checkpoints append an ``SCKP`` block. Which sections a file has and
how many layers each holds come from the model's GGUF (``ModelShape``) and the counts each
section writes, never from a list of architectures. The layout is documented in docs/format.md
("llama.cpp slot files"). Everything is parsed to the last byte: a version, section or field
this module does not know is refused with an error naming it, so a file is never mis-parsed.

A transposed V is converted to rows on decode and back on encode, so every per-token thing is a
row per token; how those rows become store parts is ``_slotparts``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ._slotmodel import (
    CKPT_MAGIC,
    CKPT_VERSION,
    DRAFT_MAGIC,
    DRAFT_VERSION,
    FORM_PLAIN,
    FORM_SERVER,
    GGML_TYPES,
    KNOWN_VERSIONS,
    MAGIC,
    SERVER_TOKENS_VERSION,
    TOKEN_NULL,
    DraftKv,
    KvLayer,
    ModelShape,
    RecLayer,
    SlotFile,
    SlotFormatError,
    SwaCache,
)

# Names that lived here before slot files <-> parts moved to ``_slotparts``: re-exported for
# code that imported them from here (``_slotparts`` builds on ``_slotmodel``, not on this module).
from ._slotparts import SlotProto, empty_parts, from_parts, layout_for, to_parts

__all__ = [
    "FORM_PLAIN",
    "FORM_SERVER",
    "GGML_TYPES",
    "KNOWN_VERSIONS",
    "KvLayer",
    "ModelShape",
    "RecLayer",
    "SlotFile",
    "SlotFormatError",
    "SlotProto",
    "SwaCache",
    "decode",
    "decode_draft_kv",
    "empty_parts",
    "encode",
    "from_parts",
    "layout_for",
    "to_parts",
]

MAX_CELL_EXT = 32  # bytes of per-cell extension a cache may write (M-RoPE writes 8 or 12)


class _Reader:
    def __init__(self, data: bytes | memoryview, what: str) -> None:
        self.b = memoryview(data)
        self.o = 0
        self.what = what

    def take(self, n: int, field_name: str) -> memoryview:
        if n < 0 or self.o + n > len(self.b):
            raise SlotFormatError(f"{self.what}: truncated in {field_name} at byte {self.o} "
                                  f"(needs {n} bytes, {len(self.b) - self.o} left); not a whole slot file")
        v = self.b[self.o:self.o + n]
        self.o += n
        return v

    def u32(self, f: str) -> int:
        return int(struct.unpack("<I", self.take(4, f))[0])

    def i32(self, f: str) -> int:
        return int(struct.unpack("<i", self.take(4, f))[0])

    def u64(self, f: str) -> int:
        return int(struct.unpack("<Q", self.take(8, f))[0])

    def left(self) -> int:
        return len(self.b) - self.o

    def peek_u32(self, at: int) -> int | None:
        return None if at + 4 > len(self.b) else int(struct.unpack_from("<I", self.b, at)[0])


def _type_name(t: int, what: str) -> str:
    if t not in GGML_TYPES:
        raise SlotFormatError(f"{what}: unknown ggml type id {t}; this codec knows "
                              f"{sorted(GGML_TYPES)} ({', '.join(v[0] for v in GGML_TYPES.values())})")
    return GGML_TYPES[t][0]


def _check_row(t: int, row: int, what: str, widths: tuple[int, ...] = ()) -> None:
    """``row`` bytes must be whole blocks of type ``t`` and, where the model says, one of ``widths`` elements."""
    name, blk, size = GGML_TYPES[t]
    if row <= 0 or row % size or row > (1 << 31):
        raise SlotFormatError(f"{what}: row size {row} is not a whole number of {name} blocks")
    want = [w // blk * size for w in widths if w]
    if want and row not in want:
        raise SlotFormatError(f"{what}: row size {row} bytes, the model's {' or '.join(map(str, sorted(set(want))))} "
                              f"bytes of {name} (a file of another model?)")


def decode(data: bytes | memoryview, shape: ModelShape, *, what: str = "slot file") -> SlotFile:
    """Parse a whole slot file (every byte accounted for) for a model of ``shape``."""
    r = _Reader(data, what)
    magic = r.u32("magic")
    if magic != MAGIC:
        raise SlotFormatError(f"{what}: not a llama.cpp sequence state file (magic {magic:#010x}, "
                              f"expected 'ggsq' {MAGIC:#010x})")
    version = r.u32("version")
    if version not in KNOWN_VERSIONS:
        raise SlotFormatError(f"{what}: state version {version} is not one this codec knows "
                              f"({', '.join(map(str, KNOWN_VERSIONS))}); refusing rather than guessing its layout")
    n_words = r.u32("token count")
    words = np.frombuffer(r.take(4 * n_words, "token payload"), dtype="<i4").astype(np.int32)
    sf = SlotFile(version=version, tokens=words)
    _decode_tokens(sf, words, what)
    if shape.attn_layers:
        _decode_attention(r, sf, shape, what)
    if shape.recurrent_layers:
        _decode_rec(r, sf, shape, what)
    if r.left() and r.peek_u32(r.o) != DRAFT_MAGIC:
        _decode_ckpt(r, sf, what)
    if r.left() and r.peek_u32(r.o) == DRAFT_MAGIC:
        _decode_draft(r, sf, what)
    if r.left():
        raise SlotFormatError(f"{what}: {r.left()} unexpected bytes after the state at byte {r.o}")
    if sf.n_tokens == 0:
        raise SlotFormatError(f"{what}: the slot holds no tokens")
    return sf


def _decode_tokens(sf: SlotFile, words: np.ndarray, what: str) -> None:
    if len(words) and int(words[0]) == TOKEN_NULL:
        if len(words) < 3:
            raise SlotFormatError(f"{what}: server-tokens payload truncated before its token count")
        if int(words[1]) != SERVER_TOKENS_VERSION:
            raise SlotFormatError(f"{what}: server-tokens payload version {int(words[1])} is unknown "
                                  f"(this codec knows {SERVER_TOKENS_VERSION})")
        n = int(words[2])
        if n < 0 or 3 + n + 1 != len(words):
            raise SlotFormatError(f"{what}: server-tokens payload declares {n} tokens in {len(words)} words "
                                  "(a text-only payload is marker, version, count, tokens, 0 media)")
        if int(words[3 + n]) != 0:
            raise SlotFormatError(f"{what}: the slot holds {int(words[3 + n])} media chunks; only text slots "
                                  "can be stored")
        sf.tokens = words[3:3 + n].copy()
        sf.token_form = FORM_SERVER
    else:
        sf.tokens = words.copy()
        sf.token_form = FORM_PLAIN
    if (sf.tokens < 0).any():
        raise SlotFormatError(f"{what}: negative token id in the token payload")


def _decode_attention(r: _Reader, sf: SlotFile, shape: ModelShape, what: str) -> None:
    """The K/V cache; on a model with a sliding window whose first cache holds only some of its
    attention layers, the sliding-window cache of the rest follows (llama.cpp's iSWA order)."""
    n_attn = len(shape.attn_layers)
    base = _decode_kv(r, sf, shape, what, "kv", shape.kv_widths if not shape.n_swa else None, n_attn)
    sf.n_stream, sf.stream, sf.cells, sf.cell_ext, sf.v_trans, sf.kv = base
    if len(sf.kv) == n_attn:
        return
    if not shape.n_swa:
        raise SlotFormatError(f"{what}: kv cache of {len(sf.kv)} layers, the model has {n_attn} attention layers "
                              "(a file of another model?)")
    swa = _decode_kv(r, sf, shape, what, "sliding-window kv", None, n_attn - len(sf.kv))
    if len(swa[5]) != n_attn - len(sf.kv):
        raise SlotFormatError(f"{what}: full-attention and sliding-window caches hold {len(sf.kv)} + "
                              f"{len(swa[5])} layers, the model has {n_attn} attention layers")
    if (swa[0], swa[1], swa[3]) != (sf.n_stream, sf.stream, sf.cell_ext):
        raise SlotFormatError(f"{what}: the sliding-window cache's streams or cell layout differ from the "
                              "full-attention cache's; a layout this codec does not know")
    sf.swa = SwaCache(swa[2], swa[4], swa[5])


_Kv = tuple[int, int, np.ndarray, int, int, list[KvLayer]]  # n_stream, stream, cells, cell_ext, v_trans, layers


def _cell_ext(r: _Reader, cc: int, max_layers: int, version: int) -> int:
    """Bytes of per-cell extension in the ``cc`` cells at the read position: the size (0, 4, ...) at
    which every cell says n_seq_id = 1 at distinct positions; where several sizes do, the one at
    which the words after the cells (v_trans, n_layer, the first K type) fit. M-RoPE models write
    such an extension; its size depends on the build, so it is read from the file and pinned in
    the identity."""
    cells_fit, all_fit = [], []
    for ext in range(0, MAX_CELL_EXT + 1, 4):
        stride = 12 + ext
        end = r.o + stride * cc
        if end > len(r.b):
            break
        cells = np.frombuffer(r.b[r.o:end], "<i4").reshape(cc, stride // 4)
        if not (cells[:, 1] == 1).all() or len(np.unique(cells[:, 0])) != cc:
            continue
        cells_fit.append(ext)
        vt, nl = r.peek_u32(end), r.peek_u32(end + 4)
        k_type = r.peek_u32(end + (16 if version >= 4 else 8))
        if vt in (0, 1) and nl is not None and nl <= max_layers and (nl == 0 or k_type in GGML_TYPES):
            all_fit.append(ext)
    if len(cells_fit) == 1:
        return cells_fit[0]
    if len(all_fit) == 1:
        return all_fit[0]
    if not cells_fit:
        raise SlotFormatError(f"{r.what}: kv cells at byte {r.o} are no cell layout this codec knows "
                              "(cells with n_seq_id != 1, or repeated positions)")
    raise SlotFormatError(f"{r.what}: kv cells at byte {r.o} fit several cell layouts ({all_fit or cells_fit} "
                          "extension bytes); refusing rather than guessing")


def _decode_kv(r: _Reader, sf: SlotFile, shape: ModelShape, what: str, name: str,
               widths: tuple[tuple[int, int], ...] | None, max_layers: int) -> _Kv:
    """One K/V cache section. ``widths``: per layer K/V elements (None: each layer must have one of the
    model's widths, for a cache whose layers are not known in advance)."""
    n_stream = r.u32(f"{name} n_stream")
    if not 1 <= n_stream <= 4096:
        raise SlotFormatError(f"{what}: {name} n_stream {n_stream} out of range")
    out: _Kv | None = None
    any_k = tuple(w[0] for w in shape.kv_widths)
    any_v = tuple(w[1] for w in shape.kv_widths)
    for s in range(n_stream):
        cc = r.u32(f"{name} stream {s} cell count")
        if cc == 0:
            continue
        if out is not None:
            raise SlotFormatError(f"{what}: more than one {name} stream holds cells; a slot file is one sequence")
        ext = _cell_ext(r, cc, max_layers, sf.version)
        cells = np.frombuffer(r.take((12 + ext) * cc, f"{name} cells"), dtype="<i4")
        cells = cells.reshape(cc, 3 + ext // 4).astype(np.int32)
        v_trans = r.u32(f"{name} v_trans")
        if v_trans not in (0, 1):
            raise SlotFormatError(f"{what}: {name} v_trans {v_trans} is neither 0 nor 1")
        n_layer = r.u32(f"{name} n_layer")
        if n_layer > max_layers or widths is not None and n_layer != len(widths):
            raise SlotFormatError(f"{what}: {name} cache of {n_layer} layers, the model has "
                                  f"{max_layers} attention layers (a file of another model?)")
        if sf.version >= 4:
            # state version 4 writes 8 more bytes here; the builds that write it leave them zero
            a, b = r.u32(f"{name} v4 field a"), r.u32(f"{name} v4 field b")
            if a or b:
                raise SlotFormatError(f"{what}: version-4 {name} fields ({a}, {b}) are not zero: a layout "
                                      "this codec does not know")
        ks: list[tuple[int, int, bytes]] = []
        for il in range(n_layer):
            t = r.i32(f"k type ({name} layer {il})")
            _type_name(t, f"{what}: {name} k layer {il}")
            row = r.u64(f"k row size ({name} layer {il})")
            _check_row(t, row, f"{what}: {name} k layer {il}", (widths[il][0],) if widths else any_k)
            ks.append((t, row, bytes(r.take(row * cc, f"k rows ({name} layer {il})"))))
        layers: list[KvLayer] = []
        for il in range(n_layer):
            t = r.i32(f"v type ({name} layer {il})")
            _type_name(t, f"{what}: {name} v layer {il}")
            if not v_trans:
                row = r.u64(f"v row size ({name} layer {il})")
                _check_row(t, row, f"{what}: {name} v layer {il}", (widths[il][1],) if widths else any_v)
                layers.append(KvLayer(*ks[il], t, row, bytes(r.take(row * cc, f"v rows ({name} layer {il})"))))
            else:
                el, ne = r.u32(f"v element size ({name} layer {il})"), r.u32(f"v width ({name} layer {il})")
                want = [w for w in ((widths[il][1],) if widths else any_v) if w]
                bad_width = not 0 < ne <= (1 << 20) or bool(want) and ne not in want
                if GGML_TYPES[t][1] != 1 or el != GGML_TYPES[t][2] or bad_width:
                    raise SlotFormatError(f"{what}: transposed {name} v layer {il}: element size {el} / width {ne} "
                                          f"do not fit type {GGML_TYPES[t][0]}")
                cols = np.frombuffer(r.take(el * ne * cc, f"v columns ({name} layer {il})"), np.uint8)
                rows = cols.reshape(ne, cc, el).transpose(1, 0, 2).copy()  # [token][dim][byte]
                layers.append(KvLayer(*ks[il], t, el * ne, rows.tobytes(), el, ne))
        out = (n_stream, s, cells, ext, v_trans, layers)
    if out is None:
        raise SlotFormatError(f"{what}: the {name} cache holds no cells")
    return out


def _decode_rec(r: _Reader, sf: SlotFile, shape: ModelShape, what: str) -> None:
    cc = r.u32("recurrent cell count")
    if cc != 1:
        raise SlotFormatError(f"{what}: recurrent cache of {cc} cells; a slot file holds one sequence's cell")
    pos, nseq = r.i32("recurrent cell pos"), r.u32("recurrent cell n_seq_id")
    if nseq > 1:
        raise SlotFormatError(f"{what}: recurrent cell with {nseq} sequence ids is a layout this codec does not know")
    seq = r.i32("recurrent cell seq_id") if nseq else 0
    sf.rec_cell = np.array([pos, nseq, seq], np.int32)
    sf.s_trans = r.u32("recurrent s_trans")
    if sf.s_trans != 0:
        raise SlotFormatError(f"{what}: transposed recurrent state (s_trans={sf.s_trans}) is not supported")
    sf.rec_n_layer = r.u32("recurrent n_layer")
    if sf.rec_n_layer != shape.n_layer:
        raise SlotFormatError(f"{what}: recurrent cache of {sf.rec_n_layer} layers, the model has {shape.n_layer}")
    heads: list[tuple[int, int, bytes]] = []
    for part in ("r", "s"):
        width = shape.rec_widths[0 if part == "r" else 1]
        for il in shape.recurrent_layers:
            t = r.i32(f"{part} type (layer {il})")
            _type_name(t, f"{what}: {part} layer {il}")
            row = r.u64(f"{part} row size (layer {il})")
            if row:
                _check_row(t, row, f"{what}: {part} layer {il}", (width,))
            elif width:
                raise SlotFormatError(f"{what}: {part} layer {il} is empty, the model keeps state there")
            heads.append((t, row, bytes(r.take(row, f"{part} state (layer {il})"))))
    n = len(shape.recurrent_layers)
    sf.rec = [RecLayer(*heads[i], *heads[n + i]) for i in range(n)]


def _decode_ckpt(r: _Reader, sf: SlotFile, what: str) -> None:
    start = r.o
    magic = r.u32("checkpoint magic")
    if magic != CKPT_MAGIC:
        raise SlotFormatError(f"{what}: {r.left() + 4} unexpected bytes after the state at byte {start} "
                              f"(starting {magic:#010x}, not a checkpoint block)")
    ver = r.u32("checkpoint version")
    if ver != CKPT_VERSION:
        raise SlotFormatError(f"{what}: checkpoint block version {ver} is unknown (this codec knows {CKPT_VERSION})")
    n = r.u32("checkpoint count")
    for i in range(n):
        r.u64(f"checkpoint {i} n_tokens")
        r.i32(f"checkpoint {i} pos_min")
        r.i32(f"checkpoint {i} pos_max")
        for blob in ("state", "extra a", "extra b"):  # three length-prefixed byte blobs per checkpoint
            size = r.u64(f"checkpoint {i} {blob} size")
            r.take(size, f"checkpoint {i} {blob}")
    sf.n_checkpoints = n
    sf.checkpoints = bytes(r.b[start:r.o])


def _decode_draft(r: _Reader, sf: SlotFile, what: str) -> None:
    """The ``SDFT`` appendix: magic, version, one length-prefixed blob (the draft context's sequence
    state, ``llama_state_seq_get_data`` of the draft context). The blob is kept verbatim; where it
    reads as one K/V cache to its last byte it is also decoded (``draft_kv``) so it can be stored
    as rows. A file without the appendix has ``draft`` None: an empty draft."""
    r.u32("draft magic")
    ver = r.u32("draft version")
    if ver != DRAFT_VERSION:
        raise SlotFormatError(f"{what}: draft-context block version {ver} is unknown (this codec knows "
                              f"{DRAFT_VERSION})")
    size = r.u64("draft state size")
    sf.draft = bytes(r.take(size, "draft state"))
    sf.draft_version = ver
    sf.draft_kv = decode_draft_kv(sf.draft, sf.version, what)


def decode_draft_kv(blob: bytes, version: int, what: str = "draft state") -> DraftKv | None:
    """``blob`` as one K/V cache section (a draft model's memory), or None when it is not exactly one:
    empty, recurrent, or anything this codec does not know (the blob is then kept as bytes only).
    The draft model's GGUF is not known here, so row widths are taken as the blob writes them."""
    if not blob:
        return None
    r = _Reader(blob, f"{what}: draft state")
    probe = SlotFile(version=version, tokens=np.zeros(0, np.int32))
    try:
        n_stream, stream, cells, ext, v_trans, layers = _decode_kv(
            r, probe, ModelShape("draft", 0, ()), r.what, "draft kv", None, 4096)
    except SlotFormatError:
        return None
    return None if r.left() or not layers else DraftKv(n_stream, stream, cells, ext, v_trans, layers)


@dataclass
class _KvOut:
    n_stream: int
    stream: int
    cells: np.ndarray
    v_trans: int
    layers: list[KvLayer]


def _encode_kv(p: bytearray, version: int, kv: _KvOut) -> None:
    cc = len(kv.cells)
    p += struct.pack("<I", kv.n_stream)
    for s in range(kv.n_stream):
        if s != kv.stream:
            p += struct.pack("<I", 0)
            continue
        p += struct.pack("<I", cc)
        p += np.ascontiguousarray(kv.cells, "<i4").tobytes()
        p += struct.pack("<II", kv.v_trans, len(kv.layers))
        if version >= 4:
            p += struct.pack("<II", 0, 0)
        for ly in kv.layers:
            p += struct.pack("<iQ", ly.k_type, ly.k_row)
            p += ly.k
        for ly in kv.layers:
            if not kv.v_trans:
                p += struct.pack("<iQ", ly.v_type, ly.v_row)
                p += ly.v
            else:
                p += struct.pack("<iII", ly.v_type, ly.v_el, ly.n_embd_v)
                rows = np.frombuffer(ly.v, np.uint8).reshape(cc, ly.n_embd_v, ly.v_el)
                p += rows.transpose(1, 0, 2).tobytes()


def encode(sf: SlotFile) -> bytes:
    """The slot file bytes of ``sf`` (exactly what llama-server wrote, for a decoded file)."""
    out = bytearray()
    out += struct.pack("<II", MAGIC, sf.version)
    toks = np.ascontiguousarray(sf.tokens, dtype="<i4")
    if sf.token_form == FORM_SERVER:
        words = np.concatenate([np.array([TOKEN_NULL, SERVER_TOKENS_VERSION, len(toks)], "<i4"), toks,
                                np.zeros(1, "<i4")])
    else:
        words = toks
    out += struct.pack("<I", len(words))
    out += words.tobytes()
    if sf.kv or sf.swa is not None:
        _encode_kv(out, sf.version, _KvOut(sf.n_stream, sf.stream, sf.cells, sf.v_trans, sf.kv))
    if sf.swa is not None:
        _encode_kv(out, sf.version, _KvOut(sf.n_stream, sf.stream, sf.swa.cells, sf.swa.v_trans, sf.swa.kv))
    if sf.rec_cell is not None:
        pos, nseq, seq = (int(x) for x in sf.rec_cell)
        out += struct.pack("<I", 1)
        out += struct.pack("<iI", pos, nseq)
        if nseq:
            out += struct.pack("<i", seq)
        out += struct.pack("<II", sf.s_trans, sf.rec_n_layer)
        for rl in sf.rec:
            out += struct.pack("<iQ", rl.r_type, rl.r_row)
            out += rl.r
        for rl in sf.rec:
            out += struct.pack("<iQ", rl.s_type, rl.s_row)
            out += rl.s
    out += sf.checkpoints
    draft = sf.draft
    if draft is None and sf.draft_kv is not None:  # rebuilt from store parts
        d, blob = sf.draft_kv, bytearray()
        _encode_kv(blob, sf.version, _KvOut(d.n_stream, d.stream, d.cells, d.v_trans, d.kv))
        draft = bytes(blob)
    if draft is not None:
        out += struct.pack("<IIQ", DRAFT_MAGIC, sf.draft_version, len(draft))
        out += draft
    return bytes(out)
