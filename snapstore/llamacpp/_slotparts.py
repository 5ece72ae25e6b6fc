"""llama-server slot files as snapstore parts: the store layout of a model's slots, and parts <-> SlotFile.

In the store, every per-token thing is a row stream (``tokens``; ``cells``: pos/n_seq_id/seq_id
of each cell; ``k.L``/``v.L``: one row per token per attention layer) and the recurrent state is
fixed parts (``r.L``/``s.L``, ``rec.cell``); ``slot.hdr`` keeps the per-file choices (token form,
which stream held the cells) so ``encode`` writes the same bytes. :class:`SlotProto` holds what
is constant per identity (version, streams, types, row sizes) and pins it in the identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from snapstore._errors import InvalidInputError, SnapstoreError
from snapstore._layout import Fixed, Layout, Rows
from snapstore.llamacpp._slotfile import (
    FORM_PLAIN,
    FORM_SERVER,
    GGML_TYPES,
    KvLayer,
    ModelShape,
    RecLayer,
    SlotFile,
    SlotFormatError,
)

__all__ = ["SlotProto", "empty_parts", "from_parts", "layout_for", "to_parts"]

# stored dtype of a row stream / fixed part of that type (bytes for the block-quantized ones)
_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _dtype(t: int) -> str:
    return _DTYPE.get(GGML_TYPES[t][0], "uint8")


def _elems(t: int, nbytes: int) -> int:
    """Elements of the stored dtype in ``nbytes`` of type ``t``."""
    return nbytes // 4 if _dtype(t) == "float32" else nbytes // 2 if _dtype(t) != "uint8" else nbytes


def layout_for(proto: SlotProto) -> Layout:
    """The store layout of slot files with constants ``proto`` (same model, types and settings)."""
    rows: dict[str, Rows] = {"tokens": Rows("int32", (1,)), "cells": Rows("int32", (3,))}
    for il, (kt, kr, vt, vr, _, _) in zip(proto.attn_layers, proto.kv):
        rows[f"k.{il}"] = Rows(_dtype(kt), (_elems(kt, kr),))
        rows[f"v.{il}"] = Rows(_dtype(vt), (_elems(vt, vr),))
    fixed: dict[str, Fixed] = {"slot.hdr": Fixed("int32", (2,))}
    if proto.rec is not None:
        fixed["rec.cell"] = Fixed("int32", (3,))
        for il, (rt, rr, st, sr) in zip(proto.recurrent_layers, proto.rec):
            if rr:
                fixed[f"r.{il}"] = Fixed(_dtype(rt), (_elems(rt, rr),))
            if sr:
                fixed[f"s.{il}"] = Fixed(_dtype(st), (_elems(st, sr),))
    return Layout(fixed=fixed, rows=rows)


def _raw(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8)


def to_parts(sf: SlotFile, shape: ModelShape, n: int | None = None) -> dict[str, np.ndarray]:
    """The file's state as store parts (byte views, no copies), cut to its first ``n`` tokens.

    Cutting is only exact for attention state: a hybrid file's recurrent state belongs to its
    last token, so ``n`` must then equal the file's token count.
    """
    n = sf.n_tokens if n is None else n
    if not 0 < n <= sf.n_tokens:
        raise InvalidInputError(f"cut at {n} tokens of a slot of {sf.n_tokens}")
    if sf.rec_cell is not None and n != sf.n_tokens:
        raise InvalidInputError("a hybrid slot's recurrent state is only valid at its last token; it cannot "
                                f"be cut to {n} of {sf.n_tokens} tokens")
    if len(sf.cells) != sf.n_tokens or not np.array_equal(sf.cells[:, 0], np.arange(sf.n_tokens)):
        raise SlotFormatError(f"the slot's {len(sf.cells)} cells are not positions 0..{sf.n_tokens - 1} of its "
                              f"{sf.n_tokens} tokens (shifted or sparse context); it cannot be stored as a prefix")
    parts: dict[str, np.ndarray] = {
        "slot.hdr": np.array([sf.token_form, sf.stream], np.int32),
        "tokens": sf.tokens[:n].reshape(n, 1),
        "cells": sf.cells[:n],
    }
    for il, ly in zip(shape.attn_layers, sf.kv):
        parts[f"k.{il}"] = _u8(ly.k)[: n * ly.k_row].reshape(n, ly.k_row)
        parts[f"v.{il}"] = _u8(ly.v)[: n * ly.v_row].reshape(n, ly.v_row)
    if sf.rec_cell is not None:
        parts["rec.cell"] = sf.rec_cell
        for il, rl in zip(shape.recurrent_layers, sf.rec):
            if rl.r_row:
                parts[f"r.{il}"] = _u8(rl.r)
            if rl.s_row:
                parts[f"s.{il}"] = _u8(rl.s)
    return parts


def empty_parts(layout: Layout, n: int) -> dict[str, np.ndarray]:
    """Writable destination buffers for a restore of ``n`` tokens."""
    out: dict[str, np.ndarray] = {}
    for name, f in layout.fixed.items():
        out[name] = np.zeros(f.nbytes, np.uint8)
    for name, rw in layout.rows.items():
        out[name] = np.zeros((n, rw.row_bytes), np.uint8)
    return out


def from_parts(parts: dict[str, np.ndarray], n: int, proto: SlotProto) -> SlotFile:
    """A slot file of ``n`` tokens from restored parts; ``proto`` carries what the identity fixes."""
    tokens = np.frombuffer(parts["tokens"], np.int32)[:n]
    hdr = np.frombuffer(parts["slot.hdr"], np.int32)
    sf = SlotFile(version=proto.version, tokens=np.asarray(tokens, np.int32), token_form=int(hdr[0]),
                  n_stream=proto.n_stream, stream=int(hdr[1]), v_trans=proto.v_trans)
    if not 0 <= sf.stream < sf.n_stream or sf.token_form not in (FORM_PLAIN, FORM_SERVER):
        raise SlotFormatError(f"stored slot header {hdr.tolist()} is out of range")
    sf.cells = np.frombuffer(parts["cells"], np.int32)[: 3 * n].reshape(n, 3).copy()
    for il, (kt, kr, vt, vr, vel, vne) in zip(proto.attn_layers, proto.kv):
        sf.kv.append(KvLayer(kt, kr, _raw(parts[f"k.{il}"])[: n * kr], vt, vr,
                             _raw(parts[f"v.{il}"])[: n * vr], vel, vne))
    if proto.rec is not None:
        sf.rec_cell = np.frombuffer(parts["rec.cell"], np.int32).copy()
        sf.rec_n_layer = proto.rec_n_layer
        for il, (rt, rr, st, sr) in zip(proto.recurrent_layers, proto.rec):
            sf.rec.append(RecLayer(rt, rr, _raw(parts[f"r.{il}"]) if rr else b"",
                                   st, sr, _raw(parts[f"s.{il}"]) if sr else b""))
    return sf


@dataclass(frozen=True)
class SlotProto:
    """The per-identity constants of a slot file: version, streams, types and row sizes."""

    version: int
    n_stream: int
    v_trans: int
    attn_layers: tuple[int, ...]
    kv: tuple[tuple[int, int, int, int, int, int], ...]  # k_type, k_row, v_type, v_row, v_el, n_embd_v
    recurrent_layers: tuple[int, ...] = ()
    rec: tuple[tuple[int, int, int, int], ...] | None = None  # r_type, r_row, s_type, s_row
    rec_n_layer: int = 0

    @classmethod
    def of(cls, sf: SlotFile, shape: ModelShape) -> SlotProto:
        """The constants of ``sf``."""
        return cls(sf.version, sf.n_stream, sf.v_trans, shape.attn_layers,
                   tuple((x.k_type, x.k_row, x.v_type, x.v_row, x.v_el, x.n_embd_v) for x in sf.kv),
                   shape.recurrent_layers,
                   None if sf.rec_cell is None else tuple((x.r_type, x.r_row, x.s_type, x.s_row) for x in sf.rec),
                   sf.rec_n_layer)

    def to_extra(self) -> dict[str, str]:
        """Identity extra keys that pin these constants (canonical text)."""
        kv = ";".join(",".join(map(str, t)) for t in self.kv)
        rec = "" if self.rec is None else ";".join(",".join(map(str, t)) for t in self.rec)
        return {"attn_layers": ",".join(map(str, self.attn_layers)),
                "rec_layers": ",".join(map(str, self.recurrent_layers)),
                "state_version": str(self.version), "n_stream": str(self.n_stream), "v_trans": str(self.v_trans),
                "flash_attn": "0" if self.v_trans else "1", "kv_unified": "1" if self.n_stream == 1 else "0",
                "kv_layout": kv, "rec_layout": rec, "rec_n_layer": str(self.rec_n_layer)}

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> SlotProto:
        """Inverse of ``to_extra``."""
        try:
            attn = tuple(int(x) for x in str(extra["attn_layers"]).split(",") if x)
            recl = tuple(int(x) for x in str(extra["rec_layers"]).split(",") if x)
            kv = tuple(tuple(int(x) for x in t.split(",")) for t in str(extra["kv_layout"]).split(";") if t)
            rs = str(extra["rec_layout"])
            rec = None if not rs else tuple(tuple(int(x) for x in t.split(",")) for t in rs.split(";"))
            return cls(int(str(extra["state_version"])), int(str(extra["n_stream"])), int(str(extra["v_trans"])),
                       attn, kv, recl, rec,  # type: ignore[arg-type]
                       int(str(extra["rec_n_layer"])))
        except (KeyError, ValueError) as e:
            raise SnapstoreError(f"identity is not a llama.cpp slot identity: {e}") from None
