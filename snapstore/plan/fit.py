"""Which saved snapshots restore into a store's layout: the layout key a save records, and the
per-key answer match() keeps.

One identity may hold snapshots saved under two layouts (two programs, or one that changed its
parts without changing its identity). A snapshot whose parts cannot restore into the matching
store's layout — a part it needs saved with another dtype, shape or row granularity, a required
part missing — must never be what match() returns: it would fail every restore and hide the
shorter snapshot that does restore. A save records its parts' specs as one 16-byte key
(``snapshots.layout_key``, schema v9); the answer for a key is the restore plan's own rule
(:func:`snapstore.plan.restore_plan.parts_fit`), computed from one snapshot's part rows the first time a layout meets
the key and remembered (both keys name specs exactly, so the answer never changes). Optional components
stay optional: a snapshot without the ``draft`` parts fits a layout that has them (it restores
with ``missing_components``), and one with parts the layout lacks fits too (they are not read).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import blake3

from snapstore._errors import StoreFormatError
from snapstore._forks import ProcessLock
from snapstore._identity import canonical_json
from snapstore._layout import Fixed, Layout
from snapstore.catalog.queries import Txn
from snapstore.plan.prefix import granularity
from snapstore.plan.restore_plan import parts_fit

__all__ = ["fits", "layout_key", "saved_layout_key"]

_REMEMBERED = 4096  # answers remembered (a process meets a handful of layouts)


def layout_key(specs: Iterable[tuple[str, int, str, Sequence[int], int | None]]) -> bytes:
    """The key of a set of saved part specs ``(name, kind, dtype, shape, tokens_per_row)``."""
    rows = sorted([name, int(kind), dtype, [int(d) for d in shape], per] for name, kind, dtype, shape, per in specs)
    return blake3.blake3(b"snapstore layout v1|" + canonical_json(rows).encode()).digest(16)


def saved_layout_key(layout: Layout, names: Iterable[str]) -> bytes:
    """The key a save of parts ``names`` under ``layout`` records: the specs its part rows get."""
    specs = layout.parts
    out: list[tuple[str, int, str, Sequence[int], int | None]] = []
    for name in names:
        spec = specs[name]
        if isinstance(spec, Fixed):
            out.append((name, 0, spec.dtype, spec.shape, None))
        else:
            out.append((name, 1, spec.dtype, spec.row_shape, granularity(layout)))
    return layout_key(out)


# (opener layout key, saved layout key) -> fits: answers never change (both keys name specs
# exactly), so every store of the process shares them
_known: dict[tuple[bytes, bytes], bool] = {}
_lock = ProcessLock()  # fresh in a forked child (._forks)


def fits(c: Txn, layout: Layout, sid: int, key: bytes | None) -> bool:
    """Whether snapshot ``sid`` (of layout key ``key``; None: not recorded) restores into ``layout``."""
    pair = (layout.key, key) if key is not None else None
    if pair is not None:
        known = _known.get(pair)
        if known is not None:
            return known
    try:
        ok = parts_fit(c.parts(sid), layout)
    except StoreFormatError:
        return False  # a damaged part row cannot restore: passed over (verify reports it), never remembered
    if pair is not None:
        with _lock:
            if len(_known) >= _REMEMBERED:
                _known.clear()
            _known[pair] = ok
    return ok
