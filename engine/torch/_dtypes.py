"""torch tensors described as snapstore parts: dtype names, the canonical view, part specs.

A part is stored canonically: C-order bytes with the token axis outermost. These functions name
a tensor's dtype the way the core does and give the view (no copy) whose C order is that order.
"""

from __future__ import annotations

import torch

from snapstore import DTYPE_NAMES, Fixed, LayoutError, Rows

__all__ = ["canonical", "dtype_name", "fixed_spec", "rows_spec", "torch_dtype"]

_BY_NAME: dict[str, torch.dtype] = {}
for _name in DTYPE_NAMES:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _BY_NAME[_name] = _dt
_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The core's dtype name of a torch dtype ('bfloat16', 'float8_e4m3fn', 'float16', ...)."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise LayoutError(f"torch dtype {dtype} has no snapstore dtype name") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a core dtype name; LayoutError if this torch build lacks it."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise LayoutError(f"dtype {name!r} is not available in torch {torch.__version__}") from None


def canonical(t: torch.Tensor, token_dim: int | None = None) -> torch.Tensor:
    """A view of ``t`` with the token axis outermost (no copy); ``t`` itself when token_dim is None/0."""
    t = t.detach()
    if token_dim is None:
        return t
    if t.dim() == 0:
        raise LayoutError("a 0-dim tensor has no token axis")
    d = token_dim % t.dim()
    return t if d == 0 else t.movedim(d, 0)


def rows_spec(t: torch.Tensor, token_dim: int = 0, component: str | None = None) -> Rows:
    """The row-stream spec of a tensor whose axis ``token_dim`` counts tokens."""
    c = canonical(t, token_dim)
    return Rows(dtype_name(t.dtype), tuple(c.shape[1:]), component=component)


def fixed_spec(t: torch.Tensor, token_dim: int | None = None, component: str | None = None) -> Fixed:
    """The fixed-part spec of a tensor (stored in canonical order when token_dim is given)."""
    c = canonical(t, token_dim)
    return Fixed(dtype_name(t.dtype), tuple(c.shape), component=component)
