"""One synchronous save, attempt by attempt, over the stages of :mod:`snapstore.save.stages`: parent, plan,
capacity pre-check, publish (:mod:`snapstore.save.chunker`), commit — redone when it loses a race
(:class:`snapstore.lifecycle.access.Retry`), skipped with a reason when it does not fit
(:class:`snapstore.save.stages.Skip`).

The flow runs one way down: the engine's parts -> the stages -> chunk files (durable) -> one
metadata transaction, opened and committed here (:func:`snapstore.lifecycle.bookkeeping.writing`
over the catalog's ``Database.writing``), whose COMMIT publishes the snapshot. The tokens are
hashed once per save (the BLAKE3 chain and the find keys, :class:`snapstore.save.token_keys.TokenKeys`), for
every attempt, and for a ``save(wait=False)`` once with its parent's prediction at the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from snapstore._errors import InvalidInputError, NotFoundError, SnapstoreError, StateError
from snapstore._refs import namespace_key, session_key, snapshot_id
from snapstore._results import SaveResult
from snapstore._tokens import TokenIndex, as_token_array
from snapstore.catalog.db import Database
from snapstore.catalog.find_keys import stored_key
from snapstore.catalog.queries import SnapRow, Txn
from snapstore.chunks.repo import Repo
from snapstore.lifecycle.access import Access, Retry
from snapstore.lifecycle.admission import Admission, sighting_key
from snapstore.lifecycle.bookkeeping import Ledger, writing
from snapstore.lifecycle.capacity import Capacity
from snapstore.parts.buffers import Source
from snapstore.save.chunker import Chunker
from snapstore.save.delta import RowsAbove
from snapstore.save.stages import MAX_ATTEMPTS, WHOLE_AFTER, Saver, Skip, validate_parts
from snapstore.save.token_keys import TokenKeys

__all__ = ["HOOKS", "SaveRun", "skipped"]

# Test hooks: name -> callable run at that point (tests force race windows through them; empty
# in production). "save_committed": a save's transaction has committed, its freed files not yet
# unlinked.
HOOKS: dict[str, Callable[[], None]] = {}


def _hook(name: str) -> None:
    fn = HOOKS.get(name)
    if fn is not None:
        fn()


def skipped(db: Database | None, reason: str, par: SnapRow | None, logical: int, n: int, ns: str) -> SaveResult:
    """Count a save skipped for ``reason`` and describe it (nothing was stored). ``db`` None: the
    caller counted it already (in the transaction that decided it)."""
    if db is not None:
        db.write(lambda t: t.add_counter(f"skipped:{reason}", 1))
    return SaveResult(snapshot_id=None, skipped=reason, parent_id=par.id if par else None, stored_bytes=0,
                      logical_bytes=logical, n_tokens=n, pending=False, namespace=ns or None)


@dataclass(frozen=True)
class SaveRun:
    """What a save needs of its store: the stages, the store directory (its catalog) and the
    bookkeeping its transaction persists."""

    stages: Saver
    chunker: Chunker
    capacity: Capacity
    repo: Repo
    ledger: Ledger
    access: Access  # this identity's row id in a transaction, and its re-creation when dropped
    count: Callable[[str], None]  # bump one in-memory counter
    check_rows: bool
    admission: Admission = Admission()  # write admission (Store.open(admit=...), Budget.write_bytes_per_hour)

    def run(self, tokens: Any, parts: Mapping[str, Any], rows: Any, session: str | None, parent: Any,
            commit: bool, namespace: str | None, hashed: TokenKeys | None = None) -> SaveResult:
        """Check the inputs (stage 1), then save, retrying lost races up to MAX_ATTEMPTS times. ``hashed``:
        the keys of ``tokens`` (this very array) a ``save(wait=False)`` computed to predict its parent."""
        arr = as_token_array(tokens)
        n = len(arr)
        if n == 0:
            raise InvalidInputError("save() needs at least one token")
        session = session_key(session)
        ns = namespace_key(namespace)
        sources, row_counts = validate_parts(self.stages.layout, parts, rows, n)
        tk = hashed if hashed is not None and hashed.arr is tokens else TokenKeys(arr)
        index = tk.index  # the BLAKE3 chain: prefix keys, the anchor
        keys = tk.keys  # the find keys: parent="auto"'s candidates and the snapshot's own key
        reason = self.admit(index, session, ns)  # once, not per attempt: a sighting is consumed by the first
        if reason is not None:
            return skipped(None, reason, None, 0, n, ns)
        for attempt in range(MAX_ATTEMPTS):
            # "auto" whose parent keeps being evicted under it: after WHOLE_AFTER tries store it whole
            use = None if parent == "auto" and attempt >= WHOLE_AFTER else parent
            try:
                return self.once(arr, index, keys, sources, row_counts, session, use, commit, ns)
            except Retry as r:
                if r.identity_gone:
                    self.access.ensure_identity(self.repo.db)  # committed on its own before the save is redone
                if r.parent_gone and use not in ("auto", None):
                    raise NotFoundError(f"parent {snapshot_id(use)} was removed (evicted, superseded or "
                                        "abandoned) during the save; save again with parent='auto'") from None
        raise StateError(f"save() lost a race with concurrent evictions {MAX_ATTEMPTS} times; try again")

    def parent_rows_now(self, parent: Any, tk: TokenKeys, namespace: str | None,
                        row_counts: dict[str, int]) -> dict[str, int]:
        """The rows per stream of the parent a save over ``parent`` would have now (one catalog
        read; {} when it has none or the save would fail: the save itself then says why). The keys
        it computes stay in ``tk``, which the queued save is handed (:meth:`run`'s ``hashed``)."""
        try:
            ns = namespace_key(namespace)
            index, keys = tk.index, tk.keys
            _par, prows = self.repo.db.read(lambda t: self.stages.resolve_parent(t, parent, index, keys, ns, row_counts,
                                                                                 False))
        except SnapstoreError:
            return {}
        return prows

    def once(self, arr: np.ndarray, index: TokenIndex, keys: np.ndarray, sources: dict[str, Source],
             row_counts: dict[str, int], session: str | None, parent: Any, commit: bool, ns: str) -> SaveResult:
        """One attempt: parent, plan, capacity pre-check, publish, commit (Retry / Skip / saved)."""
        saver, db = self.stages, self.repo.db
        n = len(arr)
        par, prows = db.read(lambda t: saver.resolve_parent(t, parent, index, keys, ns, row_counts, commit))
        floors = {name: src.reader.base_rows for name, src in sources.items() if isinstance(src.reader, RowsAbove)}
        if any(prows.get(name, 0) < f for name, f in floors.items()):
            # a wait=False save copied only the rows above the parent it predicted (save.delta)
            return skipped(db, "parent_gone", par, 0, n, ns)
        vouched = par
        if vouched is not None and self.check_rows and not db.read(
                lambda t: saver.rows_vouched(t, vouched, prows, sources)):
            self.count("rows_mismatch")
            if parent != "auto":
                raise InvalidInputError(
                    f"check_rows: rows below parent {vouched.id}'s boundary differ from what it stored; "
                    "the engine changed rows it vouched for (save with parent=None to store them whole)")
            par, prows = None, {}
        plan = saver.plan(sources, row_counts, par, prows, ns)
        reason = self.capacity.precheck(plan.upper_bytes, db.read(lambda t: t.stored_bytes()))
        if reason is not None:
            return skipped(db, reason, par, plan.logical_bytes, n, ns)
        refs = self.chunker.store(plan.pieces)  # the chunk files, durable before a row names them
        created = [r.id for rs in refs for r in rs if r.created]
        try:  # the one metadata transaction: its COMMIT publishes the snapshot (invariant 4)
            with writing(self.repo, self.ledger, discard=created, committed=lambda: _hook("save_committed")) as t:
                done = saver.commit(t, iid=self.access.iid(t), plan=plan, refs=refs, arr=arr, index=index,
                                    find_key=stored_key(keys, n), session=session, commit=commit, ns=ns)
                self.admission.debit(t, 0 if done.existed else done.new_bytes)  # dedup hits are free
        except Skip as s:
            return skipped(db, s.reason, par, plan.logical_bytes, n, ns)
        return SaveResult(snapshot_id=done.snapshot_id, skipped=None, parent_id=done.parent_id,
                          stored_bytes=0 if done.existed else done.new_bytes, logical_bytes=plan.logical_bytes,
                          n_tokens=n, pending=not commit and not done.existed, namespace=ns or None)

    def admit(self, index: TokenIndex, session: str | None, ns: str) -> str | None:
        """Write admission before anything is planned or written: the reason to skip (counted in the
        same transaction), or None. The write rate first: a save it refuses is no sighting."""
        rules = self.admission
        if rules.rate is None and (rules.mode != "second_hit" or session is not None):
            return None  # nothing to decide: no catalog transaction
        key = sighting_key(self.stages.identity_key, ns, index.prefix_key(len(index)))

        def decide(t: Txn) -> str | None:
            if rules.over_rate(t):
                reason: str | None = "write_budget"
            elif session is None and rules.first_sighting(t, key):
                reason = "first_sighting"
            else:
                return None
            t.add_counter(f"skipped:{reason}", 1)
            return reason

        return self.repo.db.write(decide)
