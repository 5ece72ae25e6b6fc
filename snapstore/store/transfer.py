"""The Store's export and import: ``export``, ``import_file``, and for an integration's own file formats
``check_export`` and ``identity_of`` (a base of :class:`snapstore.Store`,
which supplies the attributes declared here; the format is :mod:`snapstore.transfer.format`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from snapstore._errors import InvalidInputError, NotFoundError
from snapstore._identity import Identity
from snapstore._layout import Layout
from snapstore._refs import SnapshotRef, namespace_key, ref_namespace, snapshot_id
from snapstore.catalog.queries import SnapRow, Txn
from snapstore.check.inspect import snapshot_identity
from snapstore.chunks.repo import Repo, SnapshotRepo
from snapstore.lifecycle.access import Access
from snapstore.lifecycle.capacity import Capacity
from snapstore.lifecycle.naming import check_name, resolve_name
from snapstore.store.gate import CallGate, operation
from snapstore.transfer.destination import path_arg
from snapstore.transfer.export import write_export
from snapstore.transfer.importer import import_export
from snapstore.transfer.policy import accepted_key, marked_output
from snapstore.transfer.results import ExportResult, ImportResult

__all__ = ["StoreTransfer"]


class StoreTransfer:
    """export() and import_file(): a snapshot's chain as one portable file, and back (docs/api.md)."""

    _repo: Repo
    _gate: CallGate
    _access: Access
    _capacity: Capacity
    layout: Layout

    @operation
    def export(self, ref: SnapshotRef | str, path: str | os.PathLike[str], *,
               namespace: str | None = None, overwrite: bool = False,
               progress: Callable[[int, int], None] | None = None) -> ExportResult:
        """Write the chain of ``ref`` (a snapshot id, Match or SaveResult, or a *name*: a str) to one
        file at ``path`` (docs/format.md "Export files"); a named export records the name. ``path``
        is never inside a store directory, and an existing file there is replaced only with
        ``overwrite=True`` (ConfigError otherwise, nothing written). ``progress(done, total)``: called
        as the chunks are written, in bytes (a meter for a long chain)."""
        if not isinstance(overwrite, bool):
            raise InvalidInputError(f"overwrite must be True or False, got {overwrite!r}")
        _check_progress(progress)
        name: str | None = None
        if isinstance(ref, str):
            name, ns = check_name(ref), namespace_key(namespace)
            sid = self._repo.db.read(lambda t: resolve_name(t, self._access, ns, name or "", time.time()))
            if sid is None:
                raise NotFoundError(f"no snapshot is named {ref!r} in this identity and namespace")
        else:
            sid, ns = snapshot_id(ref), ref_namespace(ref, namespace)
        access = self._access

        def chain_of(t: Txn, snap: SnapRow) -> list[SnapRow]:
            return access.chain(t, access.own(t, snap, ns))

        return write_export(self._repo, sid, path, chain_of=chain_of, name=name, overwrite=overwrite,
                            progress=progress)

    @operation
    def check_export(self, ref: SnapshotRef, fmt: str, *, namespace: str | None = None,
                     accept_identity: str | None = None) -> bool:
        """Whether snapshot ``ref`` may be written out as ``fmt`` — a file format that cannot carry the
        mark of state imported under an identity override (a llama-server slot file, an mlx_lm prompt
        cache) — and whether that file is exact: True for this identity's own state; False for state
        imported under an override when ``accept_identity`` names the identity that computed it (an
        approximation: say so); IdentityError otherwise, and nothing should be written. The one policy
        for state crossing identities (:mod:`snapstore.transfer.policy`, docs/api.md)."""
        sid, ns = snapshot_id(ref), ref_namespace(ref, namespace)
        accepted_key(accept_identity, self._access.identity_key)  # a wrong type refused, marked state or not
        snap = self._repo.db.read(lambda t: self._access.own(t, t.snapshot(sid), ns))
        return marked_output(snap.imported_from, accept_identity, f"snapshot {sid}", fmt)

    @staticmethod
    def identity_of(path: str | os.PathLike[str], snapshot: SnapshotRef) -> Identity:
        """The Identity snapshot ``snapshot`` (its id) was saved under in the store at ``path``, whichever
        identity that is: what to open the store with to read a snapshot known only by its id
        (``snapstore export-slot ID``). A read-only look at a private copy of the catalog (nothing is
        written); NotFoundError when the store has no such snapshot."""
        sid = snapshot_id(snapshot)
        root = path_arg(path, "the store")  # None, bytes, an int: a ConfigError, not a TypeError
        repo = SnapshotRepo.open(root)
        try:
            return repo.db.read(lambda c: snapshot_identity(c, root, sid))
        finally:
            repo.close()

    @operation
    def import_file(self, path: str | os.PathLike[str], name: str | None = None, *,
                    accept_identity: str | None = None,
                    progress: Callable[[int, int], None] | None = None) -> ImportResult:
        """Import an export file into this store (its namespace; deduplicated against the chunks here);
        ``name``: name the imported snapshot so (None: the name the file was exported by, if any).

        A truncated or altered file raises ExportFileError and nothing is imported. A file of another
        identity raises IdentityError unless ``accept_identity`` names that identity's key: then the
        snapshot is marked imported under an override, restored only by id or name (docs/api.md).
        ``progress(done, total)``: called as the chunks are read, in bytes.
        """
        _check_progress(progress)
        return import_export(self._repo, path, access=self._access, layout=self.layout, capacity=self._capacity,
                             accept_identity=accept_identity, name=name, progress=progress)


def _check_progress(progress: object) -> None:
    """``progress`` is None or a callable (checked before any file is opened)."""
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be a callable progress(done, total) or None, got {progress!r:.60}")
