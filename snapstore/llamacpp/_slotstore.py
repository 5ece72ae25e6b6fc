"""Slot files of one model and llama.cpp build <-> snapshots in one store (``SlotStore``), and export by id.

Import stores a slot file as a delta over its deepest stored prefix; export restores a snapshot
into fresh buffers and encodes the slot file llama-server restores. The store identity pins the
slot's constants (``_slotparts.SlotProto``), so a file of another model, build or cache setting is
never matched. No HTTP here: ``LlamaBridge`` (``_bridge``) drives a running server with this.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._catalog_rows import identity_fields
from .._config import Budget
from .._errors import IdentityError, NotFoundError
from .._identity import Identity
from .._refs import SnapshotRef
from .._results import Match, SaveResult
from .._store import Store
from ._identity import ModelInfo, identity_for, model_info
from ._slotfile import SlotFile, decode, encode
from ._slotparts import SlotProto, empty_parts, from_parts, layout_for, to_parts

__all__ = ["ImportResult", "SlotStore", "export_snapshot"]


def _identity_extra_of(root: str, sid: int) -> Identity:
    """The identity of snapshot ``sid`` (read-only look at the catalog; no other identity's data)."""
    from .._repo import SnapshotRepo

    repo = SnapshotRepo.open(root)
    try:
        def run(c: Any) -> Identity:
            snap = c.snapshot(sid)
            if snap is None:
                raise NotFoundError(f"no snapshot {sid} in {root}")
            for iid, _key, canonical, *_ in c.identities():
                if iid == snap.identity_id:
                    where = f"catalog row identities({iid}) column canonical"
                    return Identity.from_dict(identity_fields(canonical, where))
            raise NotFoundError(f"snapshot {sid} has no identity row")
        return repo.db.read(run)
    finally:
        repo.close()


def export_snapshot(root: str, sid: int) -> bytes:
    """The slot file of snapshot ``sid`` (any llama.cpp identity in the store), verified on restore."""
    ident = _identity_extra_of(root, sid)
    if ident.extra.get("engine") != "llama.cpp":
        raise IdentityError(f"snapshot {sid} is not a llama.cpp slot (identity {ident.key})")
    proto = SlotProto.from_extra(ident.extra)
    with Store.open(root, identity=ident, layout=layout_for(proto), drop_stale=False) as store:
        return _export(store, sid, proto)


def _export(store: Store, ref: SnapshotRef, proto: SlotProto, session: str | None = None) -> bytes:
    n = _n_tokens_of(store, ref)
    dest = empty_parts(store.layout, n)
    store.restore(ref, into=dest, session=session)
    return encode(from_parts(dest, n, proto))


def _n_tokens_of(store: Store, ref: SnapshotRef) -> int:
    if isinstance(ref, Match):
        return ref.n_tokens
    sid = ref.snapshot_id if isinstance(ref, SaveResult) else ref
    if not isinstance(sid, int):
        raise NotFoundError(f"not a snapshot: {ref!r}")
    for info in store.snapshots():
        if info.snapshot_id == sid:
            return info.n_tokens
    raise NotFoundError(f"no snapshot {sid} of this model and build")


@dataclass
class ImportResult:
    """What an import stored: the SaveResult and the file's facts."""

    save: SaveResult
    n_tokens: int
    file_bytes: int
    checkpoints_dropped: int


class SlotStore:
    """Slot files of one model (GGUF) and llama.cpp build <-> snapshots in one store directory.

    The store identity also pins the slot's constants (state version, types, streams, V layout),
    so it is opened on the first file; ``drop_stale`` then drops every other identity (a proxy's
    default at start), never on a plain import.
    """

    def __init__(self, path: str | None, model: str | ModelInfo, build: str, *, budget: Budget | None = None,
                 drop_stale: bool = False, check_rows: bool | None = None) -> None:
        self.path = path
        self.model = model if isinstance(model, ModelInfo) else model_info(model)
        self.build = build
        self.budget = budget
        self.drop_stale = drop_stale
        self.check_rows = check_rows
        self.store: Store | None = None
        self.proto: SlotProto | None = None
        self._lock = threading.Lock()

    def decode(self, data: bytes, what: str = "slot file") -> SlotFile:
        """Parse a slot file of this model (refuses any other layout)."""
        return decode(data, self.model.shape, what=what)

    def open_for(self, sf: SlotFile) -> Store:
        """The store for ``sf``'s constants (opened once; a file with other constants is refused)."""
        proto = SlotProto.of(sf, self.model.shape)
        with self._lock:
            if self.store is None:
                ident = identity_for(self.model, self.build, proto)
                self.store = Store.open(self.path, identity=ident, layout=layout_for(proto), budget=self.budget,
                                        drop_stale=self.drop_stale, check_rows=self.check_rows)
                self.proto = proto
            elif proto != self.proto:
                raise IdentityError("this slot file was written with other cache settings (types, streams, "
                                    "flash attention or state version) than the store was opened for")
            return self.store

    def save(self, sf: SlotFile, n: int | None = None, *, session: str | None = None) -> SaveResult:
        """Store the first ``n`` tokens of ``sf`` (all by default) as a delta over its deepest stored prefix."""
        store = self.open_for(sf)
        n = sf.n_tokens if n is None else n
        parts = to_parts(sf, self.model.shape, n)
        return store.save(sf.tokens[:n], parts, session=session, parent="auto")

    def import_bytes(self, data: bytes, *, session: str | None = None, what: str = "slot file") -> ImportResult:
        """Decode (every byte checked) and store a slot file; the store is untouched on any error."""
        sf = self.decode(data, what)
        res = self.save(sf, session=session)
        return ImportResult(res, sf.n_tokens, len(data), sf.n_checkpoints)

    def export_bytes(self, ref: SnapshotRef, *, session: str | None = None) -> bytes:
        """The slot file of a snapshot (a Match, SaveResult or id) of this store; ``session``: the
        conversation restoring it (its own snapshots stay supersedable, Store.restore)."""
        if self.store is None or self.proto is None:
            raise NotFoundError("nothing stored yet for this model and build")
        return _export(self.store, ref, self.proto, session)

    def match(self, tokens: Sequence[int]) -> Match | None:
        """The longest stored prefix of ``tokens``, or None."""
        return None if self.store is None else self.store.match(list(tokens))

    def close(self) -> None:
        """Close the store."""
        if self.store is not None:
            self.store.close()
            self.store = None
