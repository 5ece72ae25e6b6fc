"""llama-server slot files as snapstore parts: the store layout of a model's slots, and parts <-> SlotFile.

In the store, every per-token thing is a row stream (``tokens``; ``cells``: pos/n_seq_id/[per-cell
extension]/seq_id of each cell; ``k.L``/``v.L``: one row per token per attention layer) and the
state valid only at the slot's last token is fixed parts: the recurrent state (``r.L``/``s.L``,
``rec.cell``). On iSWA models the sliding-window cache is row streams by position too
(``swa.cells``, ``k.swa.J``/``v.swa.J``) with ``swa.from``, the first position whose rows are
known: a file holds only the window, a save fills the rows below it from its parent
(``_slotwindow``), and an export writes the last window + 1 known cells. On an iSWA model the full-attention
cache's layers are ``k.full.J``/``v.full.J`` (J: the layer's place in its cache; the file does not
say which model layer it is). ``slot.hdr`` keeps the per-file choices (token form, which stream
held the cells) so ``encode`` writes the same bytes. :class:`SlotProto` holds what is constant
per identity (version, streams, types, row sizes, cell layout, window) and pins it in the identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from snapstore import Fixed, InvalidInputError, Layout, Rows, SnapstoreError

from ._slotmodel import (
    FORM_PLAIN,
    FORM_SERVER,
    GGML_TYPES,
    DraftKv,
    KvLayer,
    ModelShape,
    RecLayer,
    SlotFile,
    SlotFormatError,
    SwaCache,
)

__all__ = ["DRAFT", "SlotProto", "empty_parts", "from_parts", "layout_for", "storable_draft", "to_parts"]

DRAFT = "draft"  # the store component of the draft context's state (the SDFT appendix)

# stored dtype of a row stream / fixed part of that type (bytes for the block-quantized ones)
_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _dtype(t: int) -> str:
    return _DTYPE.get(GGML_TYPES[t][0], "uint8")


def _elems(t: int, nbytes: int) -> int:
    """Elements of the stored dtype in ``nbytes`` of type ``t``."""
    return nbytes // 4 if _dtype(t) == "float32" else nbytes // 2 if _dtype(t) != "uint8" else nbytes


def layout_for(proto: SlotProto) -> Layout:
    """The store layout of slot files with constants ``proto`` (same model, types and settings)."""
    rows: dict[str, Rows] = {"tokens": Rows("int32", (1,))}
    if proto.attn_layers:  # a recurrent-only model (Mamba, RWKV) keeps no K/V cells
        rows["cells"] = Rows("int32", (proto.cell_words,))
    for name, (kt, kr, vt, vr, _, _) in zip(_kv_names(proto), proto.kv):
        rows[f"k.{name}"] = Rows(_dtype(kt), (_elems(kt, kr),))
        rows[f"v.{name}"] = Rows(_dtype(vt), (_elems(vt, vr),))
    fixed: dict[str, Fixed] = {"slot.hdr": Fixed("int32", (2,))}
    if proto.swa is not None:  # rows by position; those below swa.from are not known (zeros)
        fixed["swa.from"] = Fixed("int32", (1,))
        rows["swa.cells"] = Rows("int32", (proto.cell_words,))
        for j, (kt, kr, vt, vr, _, _) in enumerate(proto.swa):
            rows[f"k.swa.{j}"] = Rows(_dtype(kt), (_elems(kt, kr),))
            rows[f"v.swa.{j}"] = Rows(_dtype(vt), (_elems(vt, vr),))
    if proto.draft is not None:  # optional: a snapshot without it restores with an empty draft
        fixed["draft.hdr"] = Fixed("int32", (1,), component=DRAFT)
        rows["draft.cells"] = Rows("int32", (3 + proto.draft_cell_ext // 4,), component=DRAFT)
        for j, (kt, kr, vt, vr, _, _) in enumerate(proto.draft):
            rows[f"draft.k.{j}"] = Rows(_dtype(kt), (_elems(kt, kr),), component=DRAFT)
            rows[f"draft.v.{j}"] = Rows(_dtype(vt), (_elems(vt, vr),), component=DRAFT)
    if proto.rec is not None:
        fixed["rec.cell"] = Fixed("int32", (3,))
        for il, (rt, rr, st, sr) in zip(proto.recurrent_layers, proto.rec):
            if rr:
                fixed[f"r.{il}"] = Fixed(_dtype(rt), (_elems(rt, rr),))
            if sr:
                fixed[f"s.{il}"] = Fixed(_dtype(st), (_elems(st, sr),))
    return Layout(fixed=fixed, rows=rows)


def _kv_names(proto: SlotProto) -> list[str]:
    """Part-name suffixes of the (full-attention) K/V cache's layers: the model layer where the file
    alone tells it (one cache), the place in the cache on an iSWA model."""
    if proto.swa is None:
        return [str(il) for il in proto.attn_layers]
    return [f"full.{j}" for j in range(len(proto.kv))]


def _window_parts(swa: SwaCache, n: int, cell_words: int) -> dict[str, np.ndarray]:
    """The sliding-window cache of a slot of ``n`` tokens as rows by position: the window's rows at
    their positions, zeros below it, and ``swa.from`` = the window's first position (the rows a
    save may fill in from its parent: ``_slotwindow``)."""
    order = np.argsort(swa.cells[:, 0], kind="stable")  # the file lists cells in cache order
    pos = swa.cells[order, 0]
    lo = n - len(pos)
    if not np.array_equal(pos, np.arange(lo, n)):
        raise SlotFormatError(f"the slot's sliding-window cells are not positions {lo}..{n - 1} (shifted or "
                              "sparse context); it cannot be stored")
    cells = np.zeros((n, cell_words), np.int32)
    cells[lo:] = swa.cells[order]
    out: dict[str, np.ndarray] = {"swa.from": np.array([lo], np.int32), "swa.cells": cells}
    for j, ly in enumerate(swa.kv):
        for name, data, row in ((f"k.swa.{j}", ly.k, ly.k_row), (f"v.swa.{j}", ly.v, ly.v_row)):
            rows = np.zeros((n, row), np.uint8)
            rows[lo:] = np.frombuffer(data, np.uint8).reshape(len(pos), row)[order]
            out[name] = rows
    return out


def _raw(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8)


def storable_draft(sf: SlotFile) -> DraftKv | None:
    """The file's draft state where it can be stored as rows: one K/V cache whose cells are the
    slot's own positions 0..n-1 (the draft context read the same prompt); else None (not stored)."""
    d = sf.draft_kv
    if d is None or len(d.cells) != sf.n_tokens or not np.array_equal(d.cells[:, 0], np.arange(sf.n_tokens)):
        return None
    return d


def to_parts(sf: SlotFile, shape: ModelShape, n: int | None = None, *, draft: bool = True) -> dict[str, np.ndarray]:
    """The file's state as store parts (byte views, no copies), cut to its first ``n`` tokens;
    ``draft``: with the draft component where the file has a storable one.

    Cutting is only exact for attention state: a hybrid file's recurrent state and an iSWA file's
    sliding window belong to its last token, so ``n`` must then equal the file's token count.
    """
    n = sf.n_tokens if n is None else n
    if not 0 < n <= sf.n_tokens:
        raise InvalidInputError(f"cut at {n} tokens of a slot of {sf.n_tokens}")
    if (sf.rec_cell is not None or sf.swa is not None) and n != sf.n_tokens:
        kind = "recurrent state" if sf.rec_cell is not None else "sliding-window cache"
        raise InvalidInputError(f"a slot's {kind} is only valid at its last token; it cannot "
                                f"be cut to {n} of {sf.n_tokens} tokens")
    if shape.attn_layers and (len(sf.cells) != sf.n_tokens or
                              not np.array_equal(sf.cells[:, 0], np.arange(sf.n_tokens))):
        raise SlotFormatError(f"the slot's {len(sf.cells)} cells are not positions 0..{sf.n_tokens - 1} of its "
                              f"{sf.n_tokens} tokens (shifted or sparse context); it cannot be stored as a prefix")
    parts: dict[str, np.ndarray] = {
        "slot.hdr": np.array([sf.token_form, sf.stream], np.int32),
        "tokens": sf.tokens[:n].reshape(n, 1),
    }
    if shape.attn_layers:
        parts["cells"] = sf.cells[:n]
    proto = SlotProto.of(sf, shape)
    for name, ly in zip(_kv_names(proto), sf.kv):
        parts[f"k.{name}"] = _u8(ly.k)[: n * ly.k_row].reshape(n, ly.k_row)
        parts[f"v.{name}"] = _u8(ly.v)[: n * ly.v_row].reshape(n, ly.v_row)
    if sf.swa is not None:
        parts.update(_window_parts(sf.swa, n, proto.cell_words))
    d = storable_draft(sf) if draft else None
    if d is not None:
        parts["draft.hdr"] = np.array([d.stream], np.int32)
        parts["draft.cells"] = d.cells[:n]
        for j, ly in enumerate(d.kv):
            parts[f"draft.k.{j}"] = _u8(ly.k)[: n * ly.k_row].reshape(n, ly.k_row)
            parts[f"draft.v.{j}"] = _u8(ly.v)[: n * ly.v_row].reshape(n, ly.v_row)
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


def from_parts(parts: dict[str, np.ndarray], n: int, proto: SlotProto, *, draft: bool = False) -> SlotFile:
    """A slot file of ``n`` tokens from restored parts; ``proto`` carries what the identity fixes;
    ``draft``: the restore brought the draft component, so the file carries its ``SDFT`` block."""
    tokens = np.frombuffer(parts["tokens"], np.int32)[:n]
    hdr = np.frombuffer(parts["slot.hdr"], np.int32)
    sf = SlotFile(version=proto.version, tokens=np.asarray(tokens, np.int32), token_form=int(hdr[0]),
                  n_stream=proto.n_stream, stream=int(hdr[1]), v_trans=proto.v_trans, cell_ext=proto.cell_ext)
    if not 0 <= sf.stream < sf.n_stream or sf.token_form not in (FORM_PLAIN, FORM_SERVER):
        raise SlotFormatError(f"stored slot header {hdr.tolist()} is out of range")
    w = proto.cell_words
    if proto.attn_layers:
        sf.cells = np.frombuffer(parts["cells"], np.int32)[: w * n].reshape(n, w).copy()
    for name, (kt, kr, vt, vr, vel, vne) in zip(_kv_names(proto), proto.kv):
        sf.kv.append(KvLayer(kt, kr, _raw(parts[f"k.{name}"])[: n * kr], vt, vr,
                             _raw(parts[f"v.{name}"])[: n * vr], vel, vne))
    if proto.swa is not None:
        # the window llama-server needs to continue from position n: n_swa + 1 cells (it reads
        # anything less as "not enough cache" and re-reads the prompt), or all that is known
        lo = max(int(np.frombuffer(parts["swa.from"], np.int32)[0]), n - (proto.swa_cap + 1), 0)
        cells = np.frombuffer(parts["swa.cells"], np.int32)[lo * w: n * w].reshape(n - lo, w).copy()
        if lo >= n or not np.array_equal(cells[:, 0], np.arange(lo, n)):
            raise SlotFormatError(f"stored sliding-window cells {lo}..{n - 1} are not those positions")
        swa = SwaCache(cells, proto.swa_v_trans)
        for j, (kt, kr, vt, vr, vel, vne) in enumerate(proto.swa):
            swa.kv.append(KvLayer(kt, kr, _raw(parts[f"k.swa.{j}"])[lo * kr: n * kr], vt, vr,
                                  _raw(parts[f"v.swa.{j}"])[lo * vr: n * vr], vel, vne))
        sf.swa = swa
    if draft and proto.draft is not None:
        dw = 3 + proto.draft_cell_ext // 4
        dk = DraftKv(proto.draft_n_stream, int(np.frombuffer(parts["draft.hdr"], np.int32)[0]),
                     np.frombuffer(parts["draft.cells"], np.int32)[: dw * n].reshape(n, dw).copy(),
                     proto.draft_cell_ext, proto.draft_v_trans)
        if not 0 <= dk.stream < dk.n_stream:
            raise SlotFormatError(f"stored draft stream {dk.stream} is out of range")
        for j, (kt, kr, vt, vr, vel, vne) in enumerate(proto.draft):
            dk.kv.append(KvLayer(kt, kr, _raw(parts[f"draft.k.{j}"])[: n * kr], vt, vr,
                                 _raw(parts[f"draft.v.{j}"])[: n * vr], vel, vne))
        sf.draft_kv, sf.draft_version = dk, proto.draft_version
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
    cell_ext: int = 0  # bytes of per-cell extension (M-RoPE) in every K/V cell
    swa: tuple[tuple[int, int, int, int, int, int], ...] | None = None  # the sliding-window cache's layers
    swa_v_trans: int = 0
    swa_cap: int = 0  # the model's window: an exported slot carries up to this + 1 sliding-window cells
    # the draft context's K/V (SDFT appendix), where the server writes one: layers as ``kv``
    draft: tuple[tuple[int, int, int, int, int, int], ...] | None = None
    draft_n_stream: int = 0
    draft_v_trans: int = 0
    draft_cell_ext: int = 0
    draft_version: int = 0

    def base(self) -> SlotProto:
        """These constants without the draft's: what a file must share to be stored under them
        (its draft is stored only where it has the same draft constants too)."""
        return replace(self, draft=None, draft_n_stream=0, draft_v_trans=0, draft_cell_ext=0, draft_version=0)

    @property
    def cell_words(self) -> int:
        """int32 words of one stored K/V cell: pos, n_seq_id, the extension, seq_id."""
        return 3 + self.cell_ext // 4

    @classmethod
    def of(cls, sf: SlotFile, shape: ModelShape) -> SlotProto:
        """The constants of ``sf``."""
        def kv(layers: list[KvLayer]) -> tuple[tuple[int, int, int, int, int, int], ...]:
            return tuple((x.k_type, x.k_row, x.v_type, x.v_row, x.v_el, x.n_embd_v) for x in layers)

        d = storable_draft(sf)
        return cls(sf.version, sf.n_stream, sf.v_trans, shape.attn_layers, kv(sf.kv),
                   shape.recurrent_layers,
                   None if sf.rec_cell is None else tuple((x.r_type, x.r_row, x.s_type, x.s_row) for x in sf.rec),
                   sf.rec_n_layer, sf.cell_ext, None if sf.swa is None else kv(sf.swa.kv),
                   0 if sf.swa is None else sf.swa.v_trans, 0 if sf.swa is None else shape.n_swa,
                   *((None, 0, 0, 0, 0) if d is None else
                     (kv(d.kv), d.n_stream, d.v_trans, d.cell_ext, sf.draft_version)))

    def to_extra(self) -> dict[str, str]:
        """Identity extra keys that pin these constants (canonical text). The keys of the cell
        extension and the sliding-window cache appear only where a file has them, so the
        identity of an attention-only or LFM2 slot is what it was before they existed."""
        kv = ";".join(",".join(map(str, t)) for t in self.kv)
        rec = "" if self.rec is None else ";".join(",".join(map(str, t)) for t in self.rec)
        out = {"attn_layers": ",".join(map(str, self.attn_layers)),
               "rec_layers": ",".join(map(str, self.recurrent_layers)),
               "state_version": str(self.version), "n_stream": str(self.n_stream), "v_trans": str(self.v_trans),
               "flash_attn": "0" if self.v_trans else "1", "kv_unified": "1" if self.n_stream == 1 else "0",
               "kv_layout": kv, "rec_layout": rec, "rec_n_layer": str(self.rec_n_layer)}
        if self.cell_ext:
            out["cell_ext"] = str(self.cell_ext)
        if self.swa is not None:
            out["swa_layout"] = ";".join(",".join(map(str, t)) for t in self.swa)
            out["swa_v_trans"] = str(self.swa_v_trans)
            out["swa_window"] = str(self.swa_cap)
        if self.draft is not None:
            out["draft_layout"] = ";".join(",".join(map(str, t)) for t in self.draft)
            out["draft_form"] = f"{self.draft_version},{self.draft_n_stream},{self.draft_v_trans},{self.draft_cell_ext}"
        return out

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> SlotProto:
        """Inverse of ``to_extra``."""
        try:
            attn = tuple(int(x) for x in str(extra["attn_layers"]).split(",") if x)
            recl = tuple(int(x) for x in str(extra["rec_layers"]).split(",") if x)
            kv = tuple(tuple(int(x) for x in t.split(",")) for t in str(extra["kv_layout"]).split(";") if t)
            rs = str(extra["rec_layout"])
            rec = None if not rs else tuple(tuple(int(x) for x in t.split(",")) for t in rs.split(";"))
            sw = extra.get("swa_layout")
            swa = None if sw is None else tuple(tuple(int(x) for x in t.split(",")) for t in str(sw).split(";") if t)
            dl = extra.get("draft_layout")
            draft = None if dl is None else tuple(tuple(int(x) for x in t.split(",")) for t in str(dl).split(";") if t)
            form = [int(x) for x in str(extra.get("draft_form", "0,0,0,0")).split(",")]
            return cls(int(str(extra["state_version"])), int(str(extra["n_stream"])), int(str(extra["v_trans"])),
                       attn, kv, recl, rec,  # type: ignore[arg-type]
                       int(str(extra["rec_n_layer"])), int(str(extra.get("cell_ext", 0))),
                       swa, int(str(extra.get("swa_v_trans", 0))), int(str(extra.get("swa_window", 0))),  # type: ignore[arg-type]
                       draft, form[1], form[2], form[3], form[0])  # type: ignore[arg-type]
        except (KeyError, ValueError, IndexError) as e:
            raise SnapstoreError(f"identity is not a llama.cpp slot identity: {e}") from None
