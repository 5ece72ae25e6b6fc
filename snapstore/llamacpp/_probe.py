"""Learn a running llama-server's slot constants without running a task in any slot.

The store identity pins the slot file's constants (state version, streams, K/V types, transposed
V), which only a slot file shows. At start the proxy must not leave a trace a client could see (a
task in ``/slots``, a cached token, a count in ``/metrics``), so :func:`learn_constants`:

1. saves each idle slot (a slot save changes nothing in the server): a slot holding tokens is
   adopted as it is — its file is the answer;
2. else takes version and streams from an empty slot's file and restores one-token files of every
   candidate type combination into that empty slot until the server accepts one (llama.cpp checks
   version, streams, layers, types and row sizes on restore and refuses any mismatch), then erases
   the slot again — no decode, no counter, the slot as empty as before;
3. only where that cannot answer (hybrid models, a shape the GGUF does not give) evaluates one
   token in an empty slot and erases it (this one shows in the server's counters; logged).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .._errors import SnapstoreError
from ._slotfile import FORM_PLAIN, FORM_SERVER, GGML_TYPES, MAGIC, TOKEN_NULL, ModelShape, SlotFile, decode, encode
from ._slotparts import SlotProto, empty_parts, from_parts, layout_for
from ._upstream import LlamaServer, UpstreamError

__all__ = ["Learned", "learn_constants"]

log = logging.getLogger("snapstore.llamacpp")

# the K/V cache types llama-server accepts (--cache-type-k/-v), the default first
_CACHE_TYPES = (1, 30, 8, 0, 2, 3, 6, 7, 20)  # f16, bf16, q8_0, f32, q4_0, q4_1, q5_0, q5_1, iq4_nl


@dataclass
class Learned:
    """A slot file with the server's constants, and how it was learned."""

    sf: SlotFile
    how: str  # "slot N" (adopted), "restore probe", "capture"
    adopted: int | None = None  # the slot whose real contents ``sf`` is


def _header(data: bytes) -> tuple[int, int, int]:
    """(state version, token form, kv streams) of an empty slot's file."""
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    if magic != MAGIC:
        raise UpstreamError(f"an empty slot's file is not a llama.cpp sequence state (magic {magic:#010x})")
    o = 12 + 4 * n_words
    form = FORM_SERVER if n_words and struct.unpack_from("<i", data, 12)[0] == TOKEN_NULL else FORM_PLAIN
    (n_stream,) = struct.unpack_from("<I", data, o)
    return int(version), form, int(n_stream)


def _candidates(version: int, n_stream: int, shape: ModelShape) -> Iterator[SlotProto]:
    """Every slot-constant combination the server could run with (types, V layout), likeliest first."""
    for v_trans in (0, 1):
        for kt in _CACHE_TYPES:
            for vt in _CACHE_TYPES:
                _, kb, ks = GGML_TYPES[kt]
                _, vb, vs = GGML_TYPES[vt]
                if v_trans and vb != 1:
                    continue  # a quantized V needs flash attention (not transposed)
                kv = []
                for wk, wv in shape.kv_widths:
                    if wk % kb or wv % vb:
                        break
                    kv.append((kt, wk // kb * ks, vt, vs * wv if v_trans else wv // vb * vs,
                               vs if v_trans else 0, wv if v_trans else 0))
                else:
                    yield SlotProto(version, n_stream, v_trans, shape.attn_layers, tuple(kv))


def _one_token_file(proto: SlotProto, form: int, slot: int, token: int) -> SlotFile:
    """A one-token slot file of constants ``proto`` (zero K/V: it is erased right after the check)."""
    parts = empty_parts(layout_for(proto), 1)
    stream = slot if slot < proto.n_stream else 0
    parts["slot.hdr"][:] = np.frombuffer(np.array([form, stream], np.int32).tobytes(), np.uint8)
    parts["tokens"][:] = np.frombuffer(np.array([token], np.int32).tobytes(), np.uint8)
    parts["cells"][:] = np.frombuffer(np.array([0, 1, slot], np.int32).tobytes(), np.uint8)
    return from_parts(parts, 1, proto)


def _restore_probe(server: LlamaServer, shape: ModelShape, slot: int, empty: bytes, token: int) -> SlotFile | None:
    version, form, n_stream = _header(empty)
    for proto in _candidates(version, n_stream, shape):
        sf = _one_token_file(proto, form, slot, token)
        try:
            server.restore_slot(slot, encode(sf), 1)
        except UpstreamError:
            continue  # the server refused these constants: not its cache
        finally:
            server.erase_slot(slot)
        return sf
    return None


def learn_constants(server: LlamaServer, shape: ModelShape, token: int) -> Learned:
    """The server's slot constants, learned as the module docstring says; ``token``: one the vocabulary has."""
    empty: tuple[int, bytes] | None = None
    for slot in sorted(server.idle_slots()):
        data = server.save_slot(slot)
        try:
            return Learned(decode(data, shape, what=f"slot {slot}"), f"slot {slot}", slot)
        except SnapstoreError:
            if empty is None:
                empty = (slot, data)  # an empty slot (or one the codec refuses): a place to probe
    if empty is None:
        raise UpstreamError("no idle slot to learn the slot layout from (every slot is busy); start the proxy "
                            "while the server is idle")
    slot, data = empty
    if not shape.hybrid and all(w for kv in shape.kv_widths for w in kv):
        sf = _restore_probe(server, shape, slot, data, token)
        if sf is not None:
            return Learned(sf, "restore probe")
    log.warning("slot %d: learning the slot layout by evaluating one token (hybrid model or unknown cache "
                "types); it shows in llama-server's counters", slot)
    server.post("/completion", {"prompt": [token], "n_predict": 0, "id_slot": slot, "cache_prompt": True,
                                "stream": False})
    try:
        return Learned(decode(server.save_slot(slot), shape, what=f"slot {slot}"), "capture")
    finally:
        server.erase_slot(slot)
