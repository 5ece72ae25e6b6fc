"""A save queued over a save still in flight: ``save(..., parent=handle)``.

An engine that captures every N tokens with ``wait=False`` chains each capture on the previous
one without waiting for it. The child runs on the same writer thread after its parent (one FIFO
queue per store), and then takes its parent from the parent's outcome:

- saved: the child is a delta over the parent's snapshot;
- skipped (the budget refused it): the child is a delta over the parent's own parent — the
  snapshot the skipped save would have been stored over (``SaveResult.parent_id``), or stored
  whole when it had none. A parent skipped under ``parent="auto"`` has as its own parent what
  "auto" chose then; nothing is chosen again;
- failed: the child fails too, with a :class:`StateError` naming the parent's error (its cause).

The rule lives here so the synchronous path (``wait=True`` over a handle: it waits for the handle
first) and the writer thread apply the same one.
"""

from __future__ import annotations

from typing import Protocol

from snapstore._errors import StateError
from snapstore._results import SaveResult

__all__ = ["PendingSave", "parent_after"]


class PendingSave(Protocol):
    """What the rule reads of a parent save in flight (a :class:`snapstore.SaveHandle`)."""

    def result(self, timeout: float | None = None) -> SaveResult: ...


def parent_after(handle: PendingSave) -> int | None:
    """The snapshot id a save queued over ``handle`` is a delta over (None: stored whole), once
    ``handle`` is done (this waits for it); a StateError when the parent save failed."""
    try:
        res = handle.result()
    except Exception as e:
        raise StateError(f"the parent save this save was queued over (parent=<SaveHandle>) failed with "
                         f"{type(e).__name__}: {e}; nothing was saved: save again over another parent "
                         "(parent='auto' or None)") from e
    if res.skipped is None:
        return res.snapshot_id
    return res.parent_id
