"""The pieces of a decoded llama-server slot file, shared by the codec and the store mapping.

``_slotfile`` (bytes <-> :class:`SlotFile`) and ``_slotparts`` (:class:`SlotFile` <-> store parts)
both build on these, and neither imports the other: the constants, the ggml type table, the
model's cache shape (:class:`ModelShape`, read from the GGUF by ``_modelshape``), the decoded
sections and the error the codec raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from snapstore import CorruptionError

__all__ = [
    "CKPT_MAGIC",
    "CKPT_VERSION",
    "DRAFT_MAGIC",
    "DRAFT_VERSION",
    "FORM_PLAIN",
    "FORM_SERVER",
    "GGML_TYPES",
    "DraftKv",
    "KNOWN_VERSIONS",
    "MAGIC",
    "SERVER_TOKENS_VERSION",
    "TOKEN_NULL",
    "KvLayer",
    "ModelShape",
    "RecLayer",
    "SlotFile",
    "SlotFormatError",
    "SwaCache",
]

MAGIC = 0x67677371  # 'ggsq' (LLAMA_STATE_SEQ_MAGIC)
KNOWN_VERSIONS = (3, 4)
TOKEN_NULL = -1
SERVER_TOKENS_VERSION = 1
CKPT_MAGIC = 0x504B4353  # 'SCKP': llama-server's persisted context checkpoints
CKPT_VERSION = 1
DRAFT_MAGIC = 0x54464453  # 'SDFT': the draft context's sequence state, after the checkpoints
DRAFT_VERSION = 1
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
    """What the GGUF says about the caches: which layers hold K/V, which recurrent state, the window.

    ``n_swa`` > 0: the model declares a sliding window, so its slots may carry a second K/V cache
    (llama.cpp's iSWA layout: the full-attention layers, then the sliding-window layers, whose
    cache keeps at most the last ``n_swa`` cells). Which attention layer is in which cache is
    read from each file (every cache section names its layer count).
    """

    arch: str
    n_layer: int
    attn_layers: tuple[int, ...]
    recurrent_layers: tuple[int, ...] = ()
    kv_widths: tuple[tuple[int, int], ...] = ()  # per attention layer: K and V elements per token (0: unchecked)
    rec_widths: tuple[int, int] = (0, 0)  # r and s elements of a recurrent layer's state (0: unchecked)
    n_swa: int = 0

    @property
    def hybrid(self) -> bool:
        """True when the slot's state is only valid at its last token and cannot be cut to a prefix:
        recurrent state beside (or instead of) K/V, or a sliding-window cache that keeps only the
        window."""
        return bool(self.recurrent_layers) or self.n_swa > 0


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
    """One recurrent layer's r (conv) and s (ssm / gated-delta-net / wkv) state of the sequence's cell."""

    r_type: int
    r_row: int
    r: bytes
    s_type: int
    s_row: int
    s: bytes


@dataclass
class SwaCache:
    """The sliding-window K/V cache of an iSWA slot: the window's cells (file order) and their rows."""

    cells: np.ndarray  # int32 [cell][pos, n_seq_id, ext words..., seq_id]
    v_trans: int = 0
    kv: list[KvLayer] = field(default_factory=list)


@dataclass
class DraftKv:
    """The draft context's sequence state (the ``SDFT`` blob) read as one K/V cache: its cells and
    per-token rows, so it is stored as rows like the target's (a delta over a stored prefix)."""

    n_stream: int
    stream: int
    cells: np.ndarray  # int32 [cell][pos, n_seq_id, ext words..., seq_id]
    cell_ext: int
    v_trans: int
    kv: list[KvLayer] = field(default_factory=list)


@dataclass
class SlotFile:
    """A decoded slot file; ``encode(decode(b)) == b``."""

    version: int
    tokens: np.ndarray  # int32
    token_form: int = FORM_SERVER
    # attention cache (the full-attention cache of an iSWA model)
    n_stream: int = 1
    stream: int = 0  # the stream (position in the file) whose cells are saved
    cells: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))  # pos, n_seq_id, [ext], seq_id
    cell_ext: int = 0  # bytes of per-cell extension (M-RoPE positions) between n_seq_id and seq_id
    v_trans: int = 0
    kv: list[KvLayer] = field(default_factory=list)
    # sliding-window cache (iSWA models)
    swa: SwaCache | None = None
    # recurrent cache (hybrid and recurrent models)
    rec_cell: np.ndarray | None = None  # int32 [pos, n_seq_id, seq_id or 0]
    rec_n_layer: int = 0
    rec: list[RecLayer] = field(default_factory=list)
    s_trans: int = 0
    # llama-server context checkpoints (SCKP block), verified and kept verbatim
    checkpoints: bytes = b""
    n_checkpoints: int = 0
    # the draft-context appendix (SDFT block): the blob verbatim (None: the file has none), its
    # version, and the blob read as a K/V cache where it is one (None: kept as bytes only)
    draft: bytes | None = None
    draft_version: int = DRAFT_VERSION
    draft_kv: DraftKv | None = None

    @property
    def n_tokens(self) -> int:
        """Tokens (and cells) in the file."""
        return int(len(self.tokens))
