"""Layout: the named parts of an engine state (fixed parts and row streams) and their dtypes."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3

from snapstore._errors import InvalidInputError, LayoutError
from snapstore._identity import canonical_json
from snapstore._numbers import integer

__all__ = ["DTYPE_NAMES", "DTYPE_SIZES", "Fixed", "Layout", "PartSpec", "Rows", "dtype_size"]

# Element sizes by dtype name. Names follow numpy, plus the ML names torch and ml_dtypes use,
# so the core can describe bf16/fp8 state without importing either.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "float32": 4, "float64": 8,
    "bfloat16": 2, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "complex64": 8, "complex128": 16,
}
#: every dtype name a layout may use (the torch adapter maps each to its torch dtype)
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_SIZES)
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-:/[]")


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name; LayoutError for an unknown name."""
    try:
        return DTYPE_SIZES[dtype]
    except (KeyError, TypeError):
        raise LayoutError(
            f"unknown dtype {dtype!r}; use one of: {', '.join(sorted(DTYPE_SIZES))}"
        ) from None


def _check_shape(shape: Any, what: str) -> tuple[int, ...]:
    """A shape as a tuple of plain ints: each dimension an integer >= 0 (numpy integers too:
    snapstore._numbers), given as a tuple or list."""
    if not isinstance(shape, (tuple, list)):
        raise LayoutError(f"{what} must be a tuple of non-negative ints, got {shape!r}")
    return tuple(integer(d, f"{what} {tuple(shape)!r}: each dimension", minimum=0, err=LayoutError) for d in shape)


def _check_component(component: Any) -> str | None:
    if component is not None and (not isinstance(component, str) or not component
                                  or not set(component) <= _NAME_CHARS):
        raise LayoutError(f"component must be None or a short name, got {component!r}")
    return component if isinstance(component, str) else None


@dataclass(frozen=True)
class Fixed:
    """A fixed part: stored whole in every snapshot (recurrent/conv state, running state)."""

    dtype: str
    shape: tuple[int, ...]
    component: str | None = None

    def __post_init__(self) -> None:
        dtype_size(self.dtype)
        object.__setattr__(self, "shape", _check_shape(self.shape, "Fixed shape"))
        _check_component(self.component)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole part."""
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class Rows:
    """A row stream: one row of ``row_shape`` per token, append-only (K/V arenas).

    ``lag``: the stream holds ``lag`` rows fewer than there are tokens (a draft/MTP head that
    computes row ``i`` when token ``i + lag`` is read): a save of ``n`` tokens stores its first
    ``n - lag`` rows without a per-call ``rows=``, and a save that claims more is refused — rows
    past the valid ones cannot be told from data. 0 (the default): one row per token.
    """

    dtype: str
    row_shape: tuple[int, ...]
    component: str | None = None
    lag: int = 0

    def __post_init__(self) -> None:
        dtype_size(self.dtype)
        object.__setattr__(self, "row_shape", _check_shape(self.row_shape, "Rows row_shape"))
        _check_component(self.component)
        object.__setattr__(self, "lag", integer(self.lag, "Rows lag", minimum=0, maximum=1 << 20, err=LayoutError))
        if self.row_bytes == 0:
            raise LayoutError("a row stream's rows must have at least one byte")

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes of one row (computed once: a restore plan asks for it per chain link)."""
        return math.prod(self.row_shape) * dtype_size(self.dtype)


PartSpec = Fixed | Rows


@dataclass(frozen=True)
class Layout:
    """The parts of a state: ``fixed`` parts and ``rows`` streams, each by a unique name.

    ``tokens_per_row``: None (default) — one row per token and match() at saved boundaries only.
    An int ``g`` — every stream holds one row per ``g`` tokens (a paged engine's block), there are
    no fixed parts, and match() may return any common prefix at the row granularity
    (docs/api.md "Prefixes at block granularity").
    """

    fixed: Mapping[str, Fixed] = field(default_factory=dict)
    rows: Mapping[str, Rows] = field(default_factory=dict)
    tokens_per_row: int | None = None

    def __post_init__(self) -> None:
        for kind, parts, cls in (("fixed", self.fixed, Fixed), ("rows", self.rows, Rows)):
            if not isinstance(parts, Mapping):
                raise LayoutError(f"Layout.{kind} must be a mapping of part name -> {cls.__name__} (or left out), "
                                  f"got {type(parts).__name__}")
            for name, spec in parts.items():
                if not isinstance(name, str) or not name or len(name) > 200 or not set(name) <= _NAME_CHARS:
                    raise LayoutError(f"part name {name!r} must be 1-200 chars of [A-Za-z0-9._-:/[]]")
                if not isinstance(spec, cls):
                    raise LayoutError(f"Layout.{kind}[{name!r}] must be a {cls.__name__}, got {spec!r}")
        dup = set(self.fixed) & set(self.rows)
        if dup:
            raise LayoutError(f"part names used twice (fixed and rows): {sorted(dup)}")
        if not self.fixed and not self.rows:
            raise LayoutError("a layout needs at least one part")
        g = self.tokens_per_row
        if g is not None:
            g = integer(g, "tokens_per_row", minimum=1, err=LayoutError)
            object.__setattr__(self, "tokens_per_row", g)
            lagging = sorted(n for n, s in self.rows.items() if s.lag)
            if lagging:
                raise LayoutError(f"streams {lagging} declare a lag: a lag counts rows behind the tokens, which "
                                  "only a layout of one row per token has (leave tokens_per_row unset)")
            if self.fixed or not self.rows:
                # a fixed part is valid only at the exact point it was captured: no prefix of it exists
                raise LayoutError("tokens_per_row (block-granular prefixes) needs a layout of row streams "
                                  f"only; this one has fixed parts {sorted(self.fixed)}")
        object.__setattr__(self, "fixed", dict(self.fixed))
        object.__setattr__(self, "rows", dict(self.rows))

    @property
    def parts(self) -> dict[str, PartSpec]:
        """Every part by name (fixed first, then row streams)."""
        out: dict[str, PartSpec] = dict(self.fixed)
        out.update(self.rows)
        return out

    @property
    def components(self) -> frozenset[str]:
        """Named optional components (e.g. ``draft``); the base state has component None."""
        return frozenset(s.component for s in self.parts.values() if s.component is not None)

    @property
    def fixed_bytes(self) -> int:
        """Bytes of all fixed parts together."""
        return sum(s.nbytes for s in self.fixed.values())

    def valid_rows(self, name: str, n_tokens: int) -> int:
        """The rows stream ``name`` holds after ``n_tokens`` tokens: one per token (per ``tokens_per_row``
        tokens), less its ``lag`` — the count a save stores when no ``rows=`` says otherwise."""
        spec = self.rows.get(name) if isinstance(name, str) else None
        if spec is None:
            raise LayoutError(f"{name!r:.80} is not a rows stream of this layout; its streams: {sorted(self.rows)}")
        n = integer(n_tokens, "n_tokens", minimum=0, err=InvalidInputError)
        return max(0, n // (self.tokens_per_row or 1) - spec.lag)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one row of every stream together."""
        return sum(s.row_bytes for s in self.rows.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (stored with each snapshot's parts)."""
        out: dict[str, Any] = {
            "fixed": {n: {"dtype": s.dtype, "shape": list(s.shape), "component": s.component}
                      for n, s in sorted(self.fixed.items())},
            "rows": {n: {"dtype": s.dtype, "row_shape": list(s.row_shape), "component": s.component,
                         **({"lag": s.lag} if s.lag else {})}  # absent at 0: older layouts describe as before
                     for n, s in sorted(self.rows.items())},
        }
        if self.tokens_per_row is not None:  # absent otherwise: older layouts describe as before
            out["tokens_per_row"] = self.tokens_per_row
        return out

    @property
    def canonical(self) -> str:
        """Canonical JSON of the layout."""
        return canonical_json(self.to_dict())

    @functools.cached_property
    def key(self) -> bytes:
        """16 bytes naming the layout exactly (BLAKE3 of :attr:`canonical`), computed once."""
        return blake3.blake3(b"snapstore layout|" + self.canonical.encode()).digest(16)
