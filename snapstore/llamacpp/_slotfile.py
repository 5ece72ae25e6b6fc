"""llama-server slot files (``/slots/N?action=save``) <-> snapstore parts, byte for byte.

A slot file is ``llama_state_seq_save_file`` output: magic ``ggsq``, the state version, the token
payload (a plain token list, or llama-server's serialized server-tokens form that starts with
-1), then the sequence's memory: the attention K/V cache and, on hybrid models, the recurrent
cache; llama-server builds that persist context checkpoints append an ``SCKP`` block. The layout
is documented in docs/format.md ("llama.cpp slot files"). Everything is parsed to the last byte:
a version, section or field this module does not know is refused with an error naming it, so a
file is never mis-parsed.

A transposed V is converted to rows on decode and back on encode, so every per-token thing is a
row per token; how those rows become store parts is ``_slotparts``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from snapstore._errors import CorruptionError

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
    "decode",
    "encode",
]

MAGIC = 0x67677371  # 'ggsq' (LLAMA_STATE_SEQ_MAGIC)
KNOWN_VERSIONS = (3, 4)
TOKEN_NULL = -1
SERVER_TOKENS_VERSION = 1
CKPT_MAGIC = 0x504B4353  # 'SCKP': llama-server's persisted context checkpoints
CKPT_VERSION = 1
FORM_PLAIN, FORM_SERVER = 0, 1

# ggml type id -> (name, block size in elements, bytes per block); the K/V/state types a cache
# can hold. Another id is refused (its row size could not be checked).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22), 7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34), 20: ("iq4_nl", 32, 18),
    30: ("bf16", 1, 2),
}



class SlotFormatError(CorruptionError):
    """A slot file this codec refuses: unknown version/layout, truncated, or inconsistent."""


@dataclass(frozen=True)
class ModelShape:
    """What the GGUF says about the caches: which layers hold K/V, which recurrent state."""

    arch: str
    n_layer: int
    attn_layers: tuple[int, ...]
    recurrent_layers: tuple[int, ...] = ()
    kv_widths: tuple[tuple[int, int], ...] = ()  # per attention layer: K and V elements per token (0: unchecked)
    rec_widths: tuple[int, int] = (0, 0)  # r and s elements of a recurrent layer's state (0: unchecked)

    @property
    def hybrid(self) -> bool:
        """True when the model keeps recurrent state beside (or instead of) K/V."""
        return bool(self.recurrent_layers)


@dataclass
class KvLayer:
    """One attention layer's K and V: rows of every cell (V converted to rows if transposed)."""

    k_type: int
    k_row: int
    k: bytes
    v_type: int
    v_row: int  # bytes per token row (for a transposed V: v_el * n_embd_v)
    v: bytes
    v_el: int = 0  # transposed V only: element size and width, as written in the file
    n_embd_v: int = 0


@dataclass
class RecLayer:
    """One recurrent layer's r (conv) and s (ssm) state of the sequence's cell."""

    r_type: int
    r_row: int
    r: bytes
    s_type: int
    s_row: int
    s: bytes


@dataclass
class SlotFile:
    """A decoded slot file; ``encode(decode(b)) == b``."""

    version: int
    tokens: np.ndarray  # int32
    token_form: int = FORM_SERVER
    # attention cache
    n_stream: int = 1
    stream: int = 0  # the stream (position in the file) whose cells are saved
    cells: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))  # pos, n_seq_id, seq_id
    v_trans: int = 0
    kv: list[KvLayer] = field(default_factory=list)
    # recurrent cache (hybrid models)
    rec_cell: np.ndarray | None = None  # int32 [pos, n_seq_id, seq_id or 0]
    rec_n_layer: int = 0
    rec: list[RecLayer] = field(default_factory=list)
    s_trans: int = 0
    # llama-server context checkpoints (SCKP block), verified and kept verbatim
    checkpoints: bytes = b""
    n_checkpoints: int = 0

    @property
    def n_tokens(self) -> int:
        """Tokens (and cells) in the file."""
        return int(len(self.tokens))


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


def _type_name(t: int, what: str) -> str:
    if t not in GGML_TYPES:
        raise SlotFormatError(f"{what}: unknown ggml type id {t}; this codec knows "
                              f"{sorted(GGML_TYPES)} ({', '.join(v[0] for v in GGML_TYPES.values())})")
    return GGML_TYPES[t][0]


def _check_row(t: int, row: int, what: str, width: int = 0) -> None:
    name, blk, size = GGML_TYPES[t]
    if row <= 0 or row % size or row > (1 << 31):
        raise SlotFormatError(f"{what}: row size {row} is not a whole number of {name} blocks")
    if width and row != width // blk * size:
        raise SlotFormatError(f"{what}: row size {row} bytes, the model's {width} {name} elements take "
                              f"{width // blk * size} (a file of another model?)")


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
        _decode_kv(r, sf, shape, what)
    if shape.recurrent_layers:
        _decode_rec(r, sf, shape, what)
    if r.left():
        _decode_ckpt(r, sf, what)
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


def _decode_kv(r: _Reader, sf: SlotFile, shape: ModelShape, what: str) -> None:
    n_stream = r.u32("kv n_stream")
    if not 1 <= n_stream <= 4096:
        raise SlotFormatError(f"{what}: kv n_stream {n_stream} out of range")
    sf.n_stream = n_stream
    seen = False
    for s in range(n_stream):
        cc = r.u32(f"kv stream {s} cell count")
        if cc == 0:
            continue
        if seen:
            raise SlotFormatError(f"{what}: more than one kv stream holds cells; a slot file is one sequence")
        seen = True
        sf.stream = s
        raw = np.frombuffer(r.take(12 * cc, "kv cells"), dtype="<i4").reshape(cc, 3).astype(np.int32)
        if (raw[:, 1] != 1).any():
            raise SlotFormatError(f"{what}: kv cells with n_seq_id != 1 (or with per-cell extensions, e.g. "
                                  "M-RoPE) are a layout this codec does not know")
        sf.cells = raw
        sf.v_trans = r.u32("kv v_trans")
        if sf.v_trans not in (0, 1):
            raise SlotFormatError(f"{what}: kv v_trans {sf.v_trans} is neither 0 nor 1")
        n_layer = r.u32("kv n_layer")
        if n_layer != len(shape.attn_layers):
            raise SlotFormatError(f"{what}: kv cache of {n_layer} layers, the model has "
                                  f"{len(shape.attn_layers)} attention layers (a file of another model?)")
        if sf.version >= 4:
            # state version 4 writes 8 more bytes here; the builds that write it leave them zero
            a, b = r.u32("kv v4 field a"), r.u32("kv v4 field b")
            if a or b:
                raise SlotFormatError(f"{what}: version-4 kv fields ({a}, {b}) are not zero: a layout "
                                      "this codec does not know")
        ks: list[tuple[int, int, bytes]] = []
        for il in range(n_layer):
            t = r.i32(f"k type (layer {il})")
            _type_name(t, f"{what}: k layer {il}")
            row = r.u64(f"k row size (layer {il})")
            _check_row(t, row, f"{what}: k layer {il}", shape.kv_widths[il][0] if shape.kv_widths else 0)
            ks.append((t, row, bytes(r.take(row * cc, f"k rows (layer {il})"))))
        layers: list[KvLayer] = []
        for il in range(n_layer):
            t = r.i32(f"v type (layer {il})")
            _type_name(t, f"{what}: v layer {il}")
            if not sf.v_trans:
                row = r.u64(f"v row size (layer {il})")
                _check_row(t, row, f"{what}: v layer {il}", shape.kv_widths[il][1] if shape.kv_widths else 0)
                layers.append(KvLayer(*ks[il], t, row, bytes(r.take(row * cc, f"v rows (layer {il})"))))
            else:
                el, ne = r.u32(f"v element size (layer {il})"), r.u32(f"v width (layer {il})")
                want = shape.kv_widths[il][1] if shape.kv_widths else 0
                if GGML_TYPES[t][1] != 1 or el != GGML_TYPES[t][2] or not 0 < ne <= (1 << 20) or want and ne != want:
                    raise SlotFormatError(f"{what}: transposed v layer {il}: element size {el} / width {ne} "
                                          f"do not fit type {GGML_TYPES[t][0]}")
                cols = np.frombuffer(r.take(el * ne * cc, f"v columns (layer {il})"), np.uint8)
                rows = cols.reshape(ne, cc, el).transpose(1, 0, 2).copy()  # [token][dim][byte]
                layers.append(KvLayer(*ks[il], t, el * ne, rows.tobytes(), el, ne))
        sf.kv = layers
    if not seen:
        raise SlotFormatError(f"{what}: the kv cache holds no cells")


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
        for il in shape.recurrent_layers:
            t = r.i32(f"{part} type (layer {il})")
            _type_name(t, f"{what}: {part} layer {il}")
            row = r.u64(f"{part} row size (layer {il})")
            if row:
                _check_row(t, row, f"{what}: {part} layer {il}", shape.rec_widths[0 if part == "r" else 1])
            elif shape.rec_widths[0 if part == "r" else 1]:
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


def encode(sf: SlotFile) -> bytes:
    """The slot file bytes of ``sf`` (exactly what llama-server wrote, for a decoded file)."""
    out = bytearray()
    p = out.extend
    p(struct.pack("<II", MAGIC, sf.version))
    toks = np.ascontiguousarray(sf.tokens, dtype="<i4")
    if sf.token_form == FORM_SERVER:
        words = np.concatenate([np.array([TOKEN_NULL, SERVER_TOKENS_VERSION, len(toks)], "<i4"), toks,
                                np.zeros(1, "<i4")])
    else:
        words = toks
    p(struct.pack("<I", len(words)))
    p(words.tobytes())
    if sf.kv:
        cc = len(sf.cells)
        p(struct.pack("<I", sf.n_stream))
        for s in range(sf.n_stream):
            if s != sf.stream:
                p(struct.pack("<I", 0))
                continue
            p(struct.pack("<I", cc))
            p(np.ascontiguousarray(sf.cells, "<i4").tobytes())
            p(struct.pack("<II", sf.v_trans, len(sf.kv)))
            if sf.version >= 4:
                p(struct.pack("<II", 0, 0))
            for ly in sf.kv:
                p(struct.pack("<iQ", ly.k_type, ly.k_row))
                p(ly.k)
            for ly in sf.kv:
                if not sf.v_trans:
                    p(struct.pack("<iQ", ly.v_type, ly.v_row))
                    p(ly.v)
                else:
                    p(struct.pack("<iII", ly.v_type, ly.v_el, ly.n_embd_v))
                    rows = np.frombuffer(ly.v, np.uint8).reshape(cc, ly.n_embd_v, ly.v_el)
                    p(rows.transpose(1, 0, 2).tobytes())
    if sf.rec_cell is not None:
        pos, nseq, seq = (int(x) for x in sf.rec_cell)
        p(struct.pack("<I", 1))
        p(struct.pack("<iI", pos, nseq))
        if nseq:
            p(struct.pack("<i", seq))
        p(struct.pack("<II", sf.s_trans, sf.rec_n_layer))
        for rl in sf.rec:
            p(struct.pack("<iQ", rl.r_type, rl.r_row))
            p(rl.r)
        for rl in sf.rec:
            p(struct.pack("<iQ", rl.s_type, rl.s_row))
            p(rl.s)
    p(sf.checkpoints)
    return bytes(out)


# Names that lived here before slot files <-> parts moved to ``_slotparts`` (which imports this
# module, so they are looked up on first use rather than imported at the top).
_MOVED_TO_SLOTPARTS = frozenset({"SlotProto", "empty_parts", "from_parts", "layout_for", "to_parts"})


def __getattr__(name: str) -> object:
    """``_slotfile.SlotProto`` and the other moved names keep working for code that imported them from here."""
    if name in _MOVED_TO_SLOTPARTS:
        from snapstore.llamacpp import _slotparts as _slotparts
        return getattr(_slotparts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
