"""Slot files of one model and llama.cpp build <-> snapshots in one store (``SlotStore``), and export by id.

Import stores a slot file as a delta over its deepest stored prefix; export restores a snapshot
into fresh buffers and encodes the slot file llama-server restores. The store identity pins the
slot's constants (``_slotparts.SlotProto``) and the server's runtime settings (``_served.Runtime``),
so a file of another model, build, cache or runtime setting is never matched. ``switch`` moves it
to what the server serves now. No HTTP here: ``LlamaBridge`` (``_bridge``) drives a server with this.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from snapstore import (
    Budget,
    IdentityError,
    Match,
    NotFoundError,
    PrefillRate,
    SaveResult,
    SnapshotRef,
    StateError,
    Store,
)

from ._identify import ModelInfo, identity_for, model_info
from ._served import unseen_runtime
from ._slotckpt import MAX_WRITTEN, checkpoint_block, checkpoint_slots
from ._slotfile import SlotFile, decode, encode
from ._slotparts import DRAFT, SlotProto, empty_parts, from_parts, layout_for, to_parts
from ._slotwindow import fill_from_parent

log = logging.getLogger("snapstore.engine.llamacpp")

__all__ = ["ImportResult", "SlotStore", "export_slot", "export_snapshot"]


def export_snapshot(root: str, sid: int, *, check: Callable[[Mapping[str, Any]], object] | None = None,
                    draft: bool = True, accept_identity: str | None = None) -> bytes:
    """The slot file of snapshot ``sid`` (:func:`export_slot`, without saying whether it is exact)."""
    return export_slot(root, sid, check=check, draft=draft, accept_identity=accept_identity)[0]


def export_slot(root: str, sid: int, *, check: Callable[[Mapping[str, Any]], object] | None = None,
                draft: bool = True, accept_identity: str | None = None) -> tuple[bytes, bool]:
    """The slot file of snapshot ``sid`` (any llama.cpp identity in the store), verified on restore;
    ``check`` is called with the snapshot's identity keys first and refuses by raising (the
    ``--for-model`` layout check, ``_formodel``); ``draft``: write the draft context's state
    (``SDFT``) where the snapshot has it (False: a target that does not run that draft). On a
    hybrid model the snapshot's stored prefixes are written back as llama-server's context
    checkpoints (``SCKP``, the deepest ``MAX_WRITTEN``): one restore each, so only here, not on
    the proxy's restore path, which restores the exact prefix a request needs. Returns the file and
    whether it is the store's own state: a snapshot imported under an identity override is written
    only when ``accept_identity`` names the identity that computed it (``Store.check_export``)."""
    ident = Store.identity_of(root, sid)  # any identity in the store: a look at the catalog, nothing written
    if ident.extra.get("engine") != "llama.cpp":
        raise IdentityError(f"snapshot {sid} is not a llama.cpp slot (identity {ident.key})")
    if check is not None:
        check(ident.extra)
    proto = SlotProto.from_extra(ident.extra)
    # read only, as `snapstore export`: the store is left as it was, and one this user may not write
    # (another user's, on read-only media) exports too
    with Store.open(root, identity=ident, layout=layout_for(proto), drop_stale=False, read_only=True) as store:
        own = store.check_export(sid, "slot file", accept_identity=accept_identity)
        return _export(store, sid, proto, draft=draft, checkpoints=True), own


def _export(store: Store, ref: SnapshotRef, proto: SlotProto, session: str | None = None, *,
            draft: bool = True, checkpoints: bool = False) -> bytes:
    n = _n_tokens_of(store, ref)
    dest = empty_parts(store.layout, n)
    # without the draft, the draft parts are not read (a snapshot saved without them restores the
    # rest and reports the component missing: the file then has no SDFT block, an empty draft)
    got = store.restore(ref, into=dest, session=session, components=None if draft else [])
    with_draft = draft and proto.draft is not None and DRAFT not in got.missing_components
    sf = from_parts(dest, n, proto, draft=with_draft)
    if checkpoints and proto.rec is not None and proto.swa is None:  # a hybrid: its stored prefixes as checkpoints
        states = _prefix_states(store, got.chain[:-1], proto, session)
        sf.checkpoints, sf.n_checkpoints = checkpoint_block(states), len(states)
    return encode(sf)


def _prefix_states(store: Store, chain: list[int], proto: SlotProto, session: str | None) -> list[SlotFile]:
    """The slot at each of the deepest ``MAX_WRITTEN`` snapshots of ``chain`` (the exported one's stored
    prefixes): each is the exact state at its own position, which llama-server resumes from as a
    context checkpoint."""
    sizes = {info.snapshot_id: info.n_tokens for info in store.snapshots()}
    out = []
    for sid in chain[-MAX_WRITTEN:]:
        n = sizes.get(sid)
        if n is None:
            continue
        dest = empty_parts(store.layout, n)
        store.restore(sid, into=dest, session=session, components=[])
        out.append(from_parts(dest, n, proto))
    return out


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
    draft: str = "none"  # the file's draft state: "none" (no SDFT block), "stored", or "dropped" (not storable here)
    checkpoints: list[SaveResult] = field(default_factory=list)  # the saves of its context checkpoints


class SlotStore:
    """Slot files of one model (GGUF) and llama.cpp build <-> snapshots in one store directory.

    The store identity also pins the slot's constants (state version, types, streams, V layout),
    so it is opened on the first file; ``drop_stale`` then applies the store's stale rule (a
    proxy's default at start), never on a plain import. ``runtime`` is the server's runtime part of
    the identity (``_served``); without it (a file without its server) the identity says "unseen",
    which no proxy's identity does. ``generation`` counts ``switch``es: a save or restore planned
    under another generation is refused, so state computed under one identity never lands in another.
    """

    def __init__(self, path: str | None, model: str | ModelInfo, build: str, *, budget: Budget | None = None,
                 drop_stale: bool = False, check_rows: bool | None = None,
                 runtime: Mapping[str, str] | None = None) -> None:
        self.path = path
        self.model = model if isinstance(model, ModelInfo) else model_info(model)
        self.build = build
        self.runtime = dict(runtime if runtime is not None else unseen_runtime().to_extra())
        self.budget = budget
        self.drop_stale = drop_stale
        self.check_rows = check_rows
        self.store: Store | None = None
        self.proto: SlotProto | None = None
        self.generation = 0
        # llama-server's prefill rate, from the ``timings`` of its responses (llama-proxy feeds it): with
        # match(weigh=True) a restore estimated slower than reading its tokens is not made (docs/api.md)
        self.prefill_rate = PrefillRate()
        self._lock = threading.Lock()

    def switch(self, model: ModelInfo, build: str, runtime: Mapping[str, str], probe: SlotFile | None = None) -> bool:
        """Serve ``model``/``build``/``runtime`` from now on; True when that is another identity (the
        current store is closed, the next file opens the new one, and the generation moves on).
        ``probe``: a slot file the server writes now — slots of other constants (a server restarted with
        another number of slots or streams) are another identity too."""
        with self._lock:
            same_proto = probe is None or self.proto is None or \
                SlotProto.of(probe, model.shape).base() == self.proto.base()
            if self.is_current(model, build, runtime) and same_proto:
                return False
            old, self.store, self.proto = self.store, None, None
            self.model, self.build, self.runtime = model, build, dict(runtime)
            self.generation += 1
        if old is not None:
            old.close()  # calls already running on it finish first; later ones raise StateError
        return True

    def is_current(self, model: ModelInfo, build: str, runtime: Mapping[str, str]) -> bool:
        """True when ``model``/``build``/``runtime`` is the identity this store serves now."""
        return (model.sha256, model.shape, build, dict(runtime)) == \
            (self.model.sha256, self.model.shape, self.build, self.runtime)

    def _check(self, generation: int | None) -> None:
        if generation is not None and generation != self.generation:
            raise StateError(f"the server's identity changed since this request was planned (generation "
                             f"{generation}, now {self.generation}); its state is not stored or restored")

    def decode(self, data: bytes, what: str = "slot file") -> SlotFile:
        """Parse a slot file of this model (refuses any other layout)."""
        return decode(data, self.model.shape, what=what)

    def open_for(self, sf: SlotFile, generation: int | None = None) -> Store:
        """The store for ``sf``'s constants (opened once; a file with other constants is refused);
        ``generation``: refuse unless the identity is still the one of that generation."""
        proto = SlotProto.of(sf, self.model.shape)
        with self._lock:
            self._check(generation)
            if self.store is None:
                ident = identity_for(self.model, self.build, proto, self.runtime)
                self.store = Store.open(self.path, identity=ident, layout=layout_for(proto), budget=self.budget,
                                        drop_stale=self.drop_stale, check_rows=self.check_rows)
                self.proto = proto
                log.info("store %s: identity %s (model %s, build %s, K/V probe %s)", self.store.path, ident.key,
                         self.model.pack, self.build, self.runtime.get("kv_probe", "")[:16])
            elif self.proto is None or proto.base() != self.proto.base():
                raise IdentityError("this slot file was written with other cache settings (types, streams, "
                                    "flash attention or state version) than the store was opened for")
            return self.store

    def save(self, sf: SlotFile, n: int | None = None, *, session: str | None = None,
             generation: int | None = None) -> SaveResult:
        """Store the first ``n`` tokens of ``sf`` (all by default) as a delta over its deepest stored prefix;
        ``generation``: the identity generation ``sf`` was read under (refused if it moved on)."""
        store = self.open_for(sf, generation)
        n = sf.n_tokens if n is None else n
        parts = to_parts(sf, self.model.shape, n, draft=self.keeps_draft(sf))
        parent: SnapshotRef | str = "auto"
        if sf.swa is not None and self.proto is not None:  # sliding-window rows below the file's window
            parent = fill_from_parent(store, sf.tokens[:n], parts, self.proto, session)
        return store.save(sf.tokens[:n], parts, session=session, parent=parent)

    def keeps_draft(self, sf: SlotFile) -> bool:
        """True when ``sf``'s draft state is stored with it: a storable draft with the draft constants
        the store was opened for (the first file fixes them; otherwise the rest is stored, the draft not)."""
        return self.proto is not None and self.proto.draft is not None and \
            SlotProto.of(sf, self.model.shape) == self.proto

    def import_bytes(self, data: bytes, *, session: str | None = None, what: str = "slot file") -> ImportResult:
        """Decode (every byte checked) and store a slot file; the store is untouched on any error."""
        sf = self.decode(data, what)
        # each usable context checkpoint first, shortest first: a snapshot at its own position, a
        # delta over the shorter ones; the file's own state is then a delta over the deepest
        kept = [self.save(cp) for cp in checkpoint_slots(sf, self.model.shape)]
        res = self.save(sf, session=session)
        draft = "none" if sf.draft is None else "stored" if self.keeps_draft(sf) else "dropped"
        if draft == "dropped":
            log.info("%s: its draft-context state (%d bytes) is not stored: %s", what, len(sf.draft or b""),
                     "not one K/V cache of the slot's positions" if sf.draft_kv is None or
                     SlotProto.of(sf, self.model.shape).draft is None else "other draft settings than the store's")
        return ImportResult(res, sf.n_tokens, len(data), sf.n_checkpoints - len(kept), draft, kept)

    def export_bytes(self, ref: SnapshotRef, *, session: str | None = None, generation: int | None = None,
                     draft: bool = True) -> bytes:
        """The slot file of a snapshot (a Match, SaveResult or id) of this store; ``session``: the
        conversation restoring it (its own snapshots stay supersedable, Store.restore)."""
        with self._lock:
            self._check(generation)
            store, proto = self.store, self.proto
        if store is None or proto is None:
            raise NotFoundError("nothing stored yet for this model and build")
        return _export(store, ref, proto, session, draft=draft)

    def match(self, tokens: Sequence[int], generation: int | None = None, *, weigh: bool = False) -> Match | None:
        """The longest stored prefix of ``tokens``, or None (also when the identity left ``generation``);
        ``weigh``: the one whose restore saves the most time at :attr:`prefill_rate` once it is measured,
        or None (Store.match's ``prefill_tokens_per_s``)."""
        with self._lock:
            store = self.store
            if generation is not None and generation != self.generation:
                return None
        rate = self.prefill_rate.tokens_per_s if weigh else None  # None until a response was timed: the longest
        return None if store is None else store.match(list(tokens), prefill_tokens_per_s=rate)

    def holds(self, tokens: Sequence[int]) -> bool:
        """True when exactly ``tokens`` are stored (a save of them would add nothing)."""
        m = self.match(tokens)
        return m is not None and m.n_tokens == len(tokens)

    def close(self) -> None:
        """Close the store."""
        if self.store is not None:
            self.store.close()
            self.store = None
