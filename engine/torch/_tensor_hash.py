"""SHA-256 of named torch tensors on any device, in bounded memory: what an integration keys an
identity by when the weights are tensors (the transformers integration's ``weights_sha256``)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from ._copy import copy_range, flat_bytes, same_width, sync_copy
from ._device import CUDA

__all__ = ["tensors_sha256"]


@torch.no_grad()
def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]], chunk: int = 64 << 20) -> str:
    """SHA-256 over named tensors, in the order given (name, dtype, shape, C-order bytes).

    Contiguous CPU tensors are hashed in place; anything else (device, strided) is copied through
    one reused host buffer of ``chunk`` bytes (page-locked for CUDA), so memory stays bounded.
    """
    h = hashlib.sha256()
    buf: torch.Tensor | None = None
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        c = same_width(t.detach().resolve_conj().resolve_neg())
        if c.device.type == "cpu" and (c.dim() == 0 or c.is_contiguous()):
            h.update(flat_bytes(c).numpy().data)
            continue
        n = c.numel() * c.element_size()
        if buf is None or (c.device.type == "cuda" and not buf.is_pinned()):
            buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=c.device.type == "cuda" and CUDA.available())
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            copy_range(c, a, b, buf[:b - a], False, sync_copy)
            h.update(buf[:b - a].numpy().data)
    return h.hexdigest()
