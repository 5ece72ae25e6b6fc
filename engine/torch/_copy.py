"""Bit-exact copies between byte ranges of a tensor's canonical order and a flat uint8 buffer.

Every copy moves elements as integers of the same width (no float canonicalisation, so bf16 /
fp8 / NaN payloads stay bit-exact, and dtypes whose copy kernels a device lacks still move). A
strided range goes as whole leading-axis rows in one strided copy; a partial row at either end
(a chunk edge, :func:`snapstore.row_span`) recurses into that row. Also here: the refusals that
keep such copies honest (lazy conjugate/negative views, destinations that overlap themselves).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from snapstore import DestinationError, LayoutError, row_span

__all__ = [
    "Copy",
    "copy_range",
    "flat_bytes",
    "host_u8",
    "overlaps_itself",
    "refuse_lazy",
    "refuse_overlap",
    "same_width",
    "sync_copy",
]

# bit-exact copies: move every element as an integer of the same width (no float canonicalisation,
# works for dtypes whose copy kernels a device may lack, e.g. float8 on CPU)
_SAME_WIDTH: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Copy = Callable[[torch.Tensor, torch.Tensor], None]
"""``copy(dst, src)``: a synchronous ``copy_`` on the host, a queued one through the device seam."""


def same_width(c: torch.Tensor) -> torch.Tensor:
    """Same-width integer view (always allowed, whatever the strides)."""
    alt = _SAME_WIDTH.get(c.element_size())
    return c if alt is None or c.dtype == alt else c.view(alt)


def flat_bytes(c: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous (or 0-dim) tensor as a 1-D uint8 view.

    ``as_strided`` rather than ``reshape(-1)``: torch calls a one-element tensor contiguous whatever
    its strides (``t.t()[3:4, 1:2]`` has last stride 5), and ``reshape`` keeps that stride, which
    ``view(torch.uint8)`` then refuses.
    """
    return c.as_strided((c.numel(),), (1,)).view(torch.uint8)


def refuse_lazy(t: torch.Tensor, err: type[LayoutError], what: str) -> None:
    """Refuse lazy conjugate / negative views: their memory is not the values they show."""
    if t.is_conj() or t.is_neg():
        kind = "conjugate" if t.is_conj() else "negative"
        raise err(f"{what} is a lazy {kind} view (its memory holds the un-{kind}d values); pass "
                  f"t.resolve_conj() / t.resolve_neg() (a copy), or the tensor it is a view of")


_EXACT_OVERLAP_MAX = 1 << 22  # elements: beyond this, a layout the fast rule cannot prove is refused


def overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` share memory (``expand``, stride 0), or that cannot be ruled out."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    extent = 1  # elements spanned by the dims seen so far
    for st, sz in dims:
        if st < extent:
            break
        extent += (sz - 1) * st
    else:
        return False  # each stride clears everything the smaller ones reach: no overlap
    if t.numel() > _EXACT_OVERLAP_MAX:
        return True
    offs = torch.zeros(1, dtype=torch.int64)
    for st, sz in dims:
        offs = (offs[:, None] + torch.arange(sz, dtype=torch.int64) * st).reshape(-1)
    return int(torch.unique(offs).numel()) != t.numel()


def refuse_overlap(t: torch.Tensor, what: str) -> None:
    """DestinationError for a destination whose elements share memory (nothing is written)."""
    if overlaps_itself(t):
        raise DestinationError(f"{what} overlaps itself (shape {tuple(t.shape)}, strides {tuple(t.stride())}: "
                               "an expand()ed or stride-0 view); restore into a tensor with distinct elements, "
                               "e.g. torch.empty(shape) or .clone()")


def sync_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, now (host tensors, or a blocking device copy)."""
    dst.copy_(src)


def copy_range(c: torch.Tensor, a: int, b: int, buf: torch.Tensor, into_tensor: bool, copy: Copy) -> None:
    """Copy bytes [a, b) of ``c``'s C-order serialisation to (or, into_tensor, from) ``buf``.

    ``buf`` is a 1-D uint8 tensor of ``b - a`` bytes (host or device). Whole leading-axis rows go
    in one strided copy; a partial row at either end recurses into that row. No host temporaries;
    a strided copy between host and a CUDA tensor makes torch allocate a device temporary of up to
    the copied size (``buf``'s, i.e. at most one staging half).
    """
    if a >= b:
        return
    if c.dim() == 0 or c.is_contiguous():
        flat = flat_bytes(c)[a:b]
        if into_tensor:
            copy(flat, buf)
        else:
            copy(buf, flat)
        return
    rb = (c.numel() // c.shape[0]) * c.element_size()
    sp = row_span(a, b - a, rb)
    if sp.head_len:
        copy_range(c[sp.head_row], sp.head_start, sp.head_start + sp.head_len, buf[:sp.head_len], into_tensor, copy)
    if sp.whole_rows:
        seg = buf[sp.head_len:sp.head_len + sp.whole_rows * rb].view(c.dtype).view(sp.whole_rows, *c.shape[1:])
        if into_tensor:
            copy(c[sp.first:sp.stop], seg)
        else:
            copy(seg, c[sp.first:sp.stop])
    if sp.tail_len:
        copy_range(c[sp.stop], 0, sp.tail_len, buf[b - a - sp.tail_len:], into_tensor, copy)


def host_u8(mv: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor aliasing a (possibly read-only) memoryview; nothing is written through it
    when it is read-only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer" for read-only sources
        return torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)
