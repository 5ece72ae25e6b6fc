"""Whether a stored slot may be written out for *another* GGUF: the cache layout must agree exactly.

Operators under memory pressure save every slot, restart on a smaller quant of the same model and
restore; llama.cpp accepts a slot file of any model whose caches have the same sizes, with no check
of the weights. ``export-slot --for-model OTHER.gguf`` makes that move explicit and checked: the
snapshot's identity pins its cache layout (``_slotparts.SlotProto``: the attention and recurrent
layers, every layer's K/V types and row bytes, the recurrent state's, the sliding window), and
:func:`check_for_model` compares it with what OTHER's own metadata (``_modelshape``) says its
caches hold, field by field, naming the first difference. K/V *types* are not in a GGUF (they are
the target server's ``-ctk``/``-ctv``), so the caller says which the target runs.

Agreement makes the file restorable, not exact: the K/V and state were computed with other
weights. Such an export is an approximation the operator chose; it writes nothing into the store
(the snapshot stays under its own identity, and no snapshot is ever matched across identities).
The same policy governs the store-to-store move, ``Store.import_file(..., accept_identity=KEY)``:
:mod:`snapstore.transfer.policy` states it once for both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from snapstore import IdentityError

from ._slotmodel import GGML_TYPES, ModelShape
from ._slotparts import SlotProto

__all__ = ["CacheLayoutMismatchError", "check_for_model", "type_id"]


class CacheLayoutMismatchError(IdentityError):
    """A snapshot's cache layout differs from another model's (or the target's cache types): not exported."""


def type_id(name: str) -> int:
    """The ggml type id of a K/V cache type name as llama-server's ``-ctk``/``-ctv`` take it (``f16``, ``q8_0``)."""
    for t, (n, _, _) in GGML_TYPES.items():
        if n == name.lower():
            return t
    raise IdentityError(f"unknown cache type {name!r}; one of {', '.join(v[0] for v in GGML_TYPES.values())}")


def _bytes_of(t: int, elements: int) -> int:
    _, blk, size = GGML_TYPES[t]
    return elements // blk * size


def _layers(xs: tuple[int, ...]) -> str:
    return ",".join(map(str, xs)) or "none"


def check_for_model(extra: Mapping[str, object], other: ModelShape, other_path: str, *,
                    cache_k: int | None = None, cache_v: int | None = None) -> SlotProto:
    """The snapshot's constants, when a slot of identity ``extra`` restores into a server running the
    GGUF of shape ``other`` with K/V cache types ``cache_k``/``cache_v`` (None: not checked);
    otherwise :class:`CacheLayoutMismatchError` naming the first difference."""
    proto = SlotProto.from_extra(extra)

    def refuse(what: str, mine: object, theirs: object) -> CacheLayoutMismatchError:
        return CacheLayoutMismatchError(
            f"{other_path} keeps another cache layout than the snapshot: {what} is {theirs} there, {mine} in the "
            "snapshot; a slot file for it would be refused or misread, so none is written")

    arch = str(extra.get("arch", ""))
    if arch != other.arch:
        raise refuse("the architecture", repr(arch), repr(other.arch))
    if proto.rec is not None and proto.rec_n_layer != other.n_layer:
        raise refuse("the layer count", proto.rec_n_layer, other.n_layer)
    if max(proto.attn_layers + proto.recurrent_layers, default=-1) >= other.n_layer:
        raise refuse("the layer count", f"more than {max(proto.attn_layers + proto.recurrent_layers)}",
                     other.n_layer)
    if proto.attn_layers != other.attn_layers:
        raise refuse("the attention layers", _layers(proto.attn_layers), _layers(other.attn_layers))
    if proto.recurrent_layers != other.recurrent_layers:
        raise refuse("the recurrent layers", _layers(proto.recurrent_layers), _layers(other.recurrent_layers))
    # a snapshot with a sliding-window cache needs OTHER's window; one without (a single cache of
    # every attention layer, checked below) restores wherever OTHER's attention layers are the same
    if proto.swa is not None and proto.swa_cap != other.n_swa:
        raise refuse("the sliding window", proto.swa_cap, other.n_swa or "none")
    _check_kv(proto, other, refuse, cache_k, cache_v)
    if proto.rec is not None:
        for il, (rt, rr, st, sr) in zip(proto.recurrent_layers, proto.rec):
            for part, t, row, width in (("conv (r)", rt, rr, other.rec_widths[0]), ("state (s)", st, sr,
                                                                                       other.rec_widths[1])):
                if width and row != _bytes_of(t, width):
                    raise refuse(f"layer {il}'s recurrent {part} size", f"{row} bytes",
                                 f"{_bytes_of(t, width)} bytes ({width} {GGML_TYPES[t][0]} elements)")
    return proto


_Refuse = Callable[[str, object, object], CacheLayoutMismatchError]


def _check_kv(proto: SlotProto, other: ModelShape, refuse: _Refuse, cache_k: int | None,
              cache_v: int | None) -> None:
    """Every K/V layer's types (against the target's cache types) and row bytes (against OTHER's widths)."""
    layers = list(proto.kv) + list(proto.swa or ())
    # one cache: layer J is attention layer J; iSWA: the file does not say which model layer a
    # cache's layer is, so each must have one of the model's widths (uniform on the models run)
    by_place = proto.swa is None
    for j, (kt, kr, vt, vr, vel, vne) in enumerate(layers):
        name = f"attention layer {proto.attn_layers[j] if by_place else j}"
        for part, t, want_t in (("K", kt, cache_k), ("V", vt, cache_v)):
            if want_t is not None and t != want_t:
                raise refuse(f"{name}'s {part} cache type", GGML_TYPES[t][0], f"{GGML_TYPES[want_t][0]} (the target's)")
        widths = [other.kv_widths[j]] if by_place else list(other.kv_widths)
        k_ok = [_bytes_of(kt, w[0]) for w in widths if w[0]]
        v_ok = [w[1] for w in widths if w[1]] if vel else [_bytes_of(vt, w[1]) for w in widths if w[1]]
        if k_ok and kr not in k_ok:
            raise refuse(f"{name}'s K row", f"{kr} bytes", f"{' or '.join(map(str, sorted(set(k_ok))))} bytes")
        v_have = vne if vel else vr
        if v_ok and v_have not in v_ok:
            unit = "elements" if vel else "bytes"
            raise refuse(f"{name}'s V row", f"{v_have} {unit}", f"{' or '.join(map(str, sorted(set(v_ok))))} {unit}")
