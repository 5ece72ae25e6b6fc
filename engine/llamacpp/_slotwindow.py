"""iSWA slots across snapshots: the sliding-window rows a file lacks, taken from the parent snapshot.

llama-server writes only the last ``n_swa`` cells of a sliding-window cache, and it reads a slot
restored with just those as "not enough cache" (it needs ``n_swa + 1`` to continue from the
slot's end), so a restore of its own file reuses nothing unless a context checkpoint covers it.
Each cell's K/V depends only on the tokens up to it, so the rows of a stored prefix are this
slot's rows too: a save over a parent whose known rows reach the file's window copies the rows
below the window from it (``swa.from`` moves down to the parent's), and the export then writes
``n_swa + 1`` cells (``_slotparts.from_parts``), which llama-server continues from. The proxy
captures a boundary as two slot saves, the tokens but the last and then all (``widen``), so its
snapshots carry that cell themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from snapstore import SnapshotRef, Store

from ._slotmodel import SlotFile, SlotFormatError
from ._slotparts import SlotProto, empty_parts

__all__ = ["capture", "fill_from_parent", "widen"]


def fill_from_parent(store: Store, tokens: np.ndarray, parts: dict[str, np.ndarray], proto: SlotProto,
                     session: str | None = None) -> SnapshotRef | str:
    """The parent to save ``parts`` (an iSWA slot of ``len(tokens)`` tokens) over; where that parent's
    known sliding-window rows reach the file's window, they are copied in below it."""
    n = len(tokens)
    lo = int(parts["swa.from"][0])
    m = store.match([int(t) for t in tokens[: n - 1]]) if n > 1 else None
    if m is None or lo == 0 or m.n_tokens < lo:
        return "auto" if m is None else m  # nothing stored reaches the window: only the window is known
    dest = empty_parts(store.layout, m.n_tokens)
    store.restore(m, into=dest, session=session)
    p_from = int(np.frombuffer(dest["swa.from"], np.int32)[0])
    if p_from >= lo:
        return m
    assert proto.swa is not None
    names = ["swa.cells", *(f"{kv}.swa.{j}" for j in range(len(proto.swa)) for kv in ("k", "v"))]
    for name in names:
        have = parts[name]
        have[:lo] = np.frombuffer(dest[name], have.dtype).reshape(-1, *have.shape[1:])[:lo]
    parts["swa.from"] = np.array([p_from], np.int32)
    return m


def widen(sf: SlotFile, prev: SlotFile) -> bool:
    """Prepend to ``sf``'s sliding window the cells of ``prev`` (a slot of the same tokens but the
    last) below it, so an export of ``sf`` carries ``n_swa + 1`` cells; False (``sf`` unchanged)
    when ``prev`` is not that slot or adds nothing."""
    if sf.swa is None or prev.swa is None or not np.array_equal(prev.tokens, sf.tokens[:-1]) or \
            len(prev.swa.cells) == 0 or prev.swa.cells.shape[1] != sf.swa.cells.shape[1] or \
            len(prev.swa.kv) != len(sf.swa.kv):
        return False
    lo = int(sf.swa.cells[:, 0].min())
    order = np.argsort(prev.swa.cells[:, 0], kind="stable")
    take = order[prev.swa.cells[order, 0] < lo]
    if len(take) == 0 or int(prev.swa.cells[take[-1], 0]) != lo - 1:
        return False
    sf.swa.cells = np.concatenate([prev.swa.cells[take], sf.swa.cells])
    for mine, old in zip(sf.swa.kv, prev.swa.kv):
        if (mine.k_row, mine.v_row) != (old.k_row, old.v_row):
            raise SlotFormatError("two captures of one slot differ in their sliding-window row sizes")
        k = np.frombuffer(old.k, np.uint8).reshape(-1, old.k_row)[take]
        v = np.frombuffer(old.v, np.uint8).reshape(-1, old.v_row)[take]
        mine.k, mine.v = k.tobytes() + mine.k, v.tobytes() + mine.v
    return True


def capture(read: Callable[[list[int]], SlotFile], tokens: list[int], n_swa: int) -> SlotFile:
    """The slot of exactly ``tokens``: ``read(toks)`` evaluates ``toks`` into a slot (no generation) and
    decodes the slot. On a model with a sliding window (``n_swa`` > 0) it reads the tokens but the
    last first and widens the window with that slot's cell below it (one more token evaluated)."""
    prev = read(tokens[:-1]) if n_swa and len(tokens) > 1 else None
    sf = read(tokens)
    if prev is not None:
        widen(sf, prev)
    return sf
