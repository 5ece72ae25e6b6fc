"""The state machine's rules on names, deletes, export/import and lost chunk files."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from snapstore._config import Budget
from snapstore._errors import IdentityError, SnapstoreError, StateError
from snapstore._identity import Identity
from snapstore.store.store import Store
from snapstore.testing.model import _MARGIN, NAMES, NAMESPACES, SEEDS, _digest, _File, _Name, _Saved
from snapstore.testing.reads import _Reads
from snapstore.transfer.output_file import OutputFile


class _Transfer(_Reads):
    """Rules on names, deletes, export and import (own and another identity's files), lost chunk files."""

    @rule(data=st.data())
    def name(self, data: st.DataObject) -> None:
        """name() a snapshot (maybe with ``ttl_s``), or unname() a name."""
        assert self.store is not None
        name = data.draw(st.sampled_from(NAMES), label="name")
        ttl = data.draw(st.sampled_from([None, None, 1800.0, 9000.0]), label="ttl_s")
        unname = data.draw(st.sampled_from([False, False, True]), label="unname")
        if unname:
            self._unname(name, data.draw(st.sampled_from(NAMESPACES), label="namespace"))
            return
        ok = sorted(i for i, x in self._live().items() if self._whole(x))
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok), label="snapshot")
        ns = self.model[sid].namespace
        now = self.time.now()
        self.store.name(self._ref(sid), name, ttl_s=ttl)
        self.names[(ns, name)] = _Name(sid, now + ttl if ttl is not None else None)

    def _unname(self, name: str, namespace: str | None) -> None:
        assert self.store is not None
        had = self.store.unname(name, namespace=namespace)
        entry = self.names.pop((namespace, name), None)
        now = self.time.now()
        if entry is not None and (entry.expires is None or entry.expires > now + _MARGIN):
            assert had, "unname() of a live name said it did not exist"

    @rule(data=st.data(), leaf=st.booleans(), gc=st.booleans())
    def delete(self, data: st.DataObject, leaf: bool, gc: bool) -> None:
        """delete() a snapshot and its subtree (``leaf``: one without children)."""
        assert self.store is not None
        live = self._live()
        parents = {x.parent_id for x in live.values()}
        ok = sorted(i for i, x in live.items() if not x.pending and (not leaf or i not in parents))
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok), label="snapshot")
        try:
            res = self.store.delete(self._ref(sid))
        except StateError:
            return  # a pending capture of this process in the subtree
        if gc:
            self.store.gc(grace=0)
        assert sid in res.snapshot_ids
        self._shared_live -= set(res.snapshot_ids)
        after = self._live()
        assert not set(res.snapshot_ids) & set(after), "delete() reported a snapshot that is still there"
        for k, v in list(self.names.items()):
            if v.sid in res.snapshot_ids:
                del self.names[k]

    # -- export and import -------------------------------------------------------------------

    @rule(data=st.data())
    def export(self, data: st.DataObject) -> None:
        """Export a snapshot (by reference or by name); ``again``: import the file back at once, with
        the override key of the identity that computed the state or without one ("skip": not now)."""
        by_name = data.draw(st.booleans(), label="by name")
        again = data.draw(st.sampled_from([None, "right", None, "right", "skip"]), label="again")
        assert self.store is not None
        live = self._live()
        now = self.time.now()
        names = sorted((k for k, v in self._valid_names(now).items() if v.sid in live), key=str)
        if by_name and names:
            ns, nm = data.draw(st.sampled_from(names), label="name")
            ref: Any = nm
            sid = self.names[(ns, nm)].sid
        else:
            ok = sorted(i for i, x in live.items() if self._whole(x))
            marked = [i for i in ok if self.model[i].foreign]
            prefer: bool = data.draw(st.booleans(), label="one imported under an override")
            if marked and prefer:
                ok = marked  # the pair of 46A item 1: an export of another identity's state
            if not ok:
                return
            sid, ns, nm = data.draw(st.sampled_from(ok), label="snapshot"), None, None
            ref = self._ref(sid)
            ns = self.model[sid].namespace
        path = self._new_file()
        try:
            out = self.store.export(ref, path, namespace=ns)
        except SnapstoreError:
            # 46A item 1 allows refusing the export of state imported under an override
            assert self.model[sid].foreign, "export() of a native snapshot was refused"
            assert not os.path.exists(path)
            return
        assert out.snapshot_id == sid and out.n_tokens == self.model[sid].n
        chain = self._chain(live, sid)
        assert len(chain) == out.links, f"the export holds {out.links} links, the chain has {len(chain)}"
        self.files.append(_File(path, tuple(self.model[i] for i in chain), False, nm))
        if again != "skip":
            self._import(self.files[-1], None, again)


    @rule(data=st.data())
    def foreign_export(self, data: st.DataObject) -> None:
        """Another identity (another quant of the same model) saves the same workload and exports it;
        ``again``: import the file here at once (with the right override key, none, or a wrong one)."""
        seed = data.draw(SEEDS, label="seed")
        namespace = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        name = data.draw(st.booleans(), label="name it")
        again = data.draw(st.sampled_from(["right", "right", None, "wrong", "skip"]), label="again")
        w = self.workload
        if self.foreign is None:
            ident = self.engine.identity
            other = Identity(build=ident.build, pack=ident.pack + "-q4", kv=ident.kv, mtp=ident.mtp,
                             extra=dict(ident.extra))
            self.foreign = Store.open(os.path.join(self.root, "foreign"), identity=other, layout=self.engine.layout,
                                      budget=Budget(disk_bytes=1 << 30, reserve_bytes=0, ram_bytes=0),
                                      chunk_bytes=self.engine.chunk_bytes, staging_bytes=self.engine.staging_bytes)
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        n = self._draw_n(data)
        with_draft = data.draw(st.booleans(), label="with draft")
        state = self._state(conv, seed, with_draft)
        r = self.foreign.save(w.tokens[conv][:n], state, namespace=namespace)
        assert r.snapshot_id is not None
        comps = frozenset({s.component for k, s in self.engine.layout.parts.items() if k in state})
        saved = _Saved(conv, n, seed, None, False, comps, namespace=namespace, foreign=True)
        self.foreign_model.setdefault(r.snapshot_id, saved)
        nm = None
        if name:
            nm = data.draw(st.sampled_from(NAMES), label="name")
            self.foreign.name(r, nm)
        path = self._new_file()
        out = self.foreign.export(r, path)
        chain = self._chain({x.snapshot_id: x for x in self.foreign.snapshots()}, r.snapshot_id)
        assert len(chain) == out.links
        self.files.append(_File(path, tuple(self.foreign_model[i] for i in chain), True, nm))
        if again != "skip":
            self._import(self.files[-1], None, again)

    @rule(data=st.data(), accept=st.sampled_from([None, "mark", "own"]))
    def export_own_format(self, data: st.DataObject, accept: str | None) -> None:
        """Write a snapshot out in an engine's own format, as an integration does (``export-slot``): the
        identity from its id alone (``Store.identity_of``), the identity-override check (``check_export``:
        exact for this identity's own state; marked state only when ``accept_identity`` names the mark),
        the file put in place whole by the store's rule (``OutputFile``) or not at all."""
        assert self.store is not None
        live = self._live()
        ok = sorted(i for i, x in live.items() if self._whole(x))
        marked = [i for i in ok if live[i].imported_from is not None]
        prefer: bool = data.draw(st.booleans(), label="one imported under an override")
        if marked and prefer:
            ok = marked
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok), label="snapshot")
        mark = live[sid].imported_from
        assert Store.identity_of(self.store.path, sid) == self.store.identity, "identity_of named another identity"
        key = {None: None, "mark": mark, "own": self.store.identity.key}[accept]
        path = os.path.join(self.root, "files", "own-format.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with OutputFile(path, store_root=self.store.path, what="the engine's file") as out:
                exact = self.store.check_export(self._ref(sid), "engine file", accept_identity=key)
                out.write(sid.to_bytes(8, "little"))
        except IdentityError:
            assert mark is not None and key != mark, "check_export refused the store's own state, or the named mark"
            assert not os.path.exists(path), "a refused export left a file"
            return
        assert exact == (mark is None), f"check_export said exact={exact} for a snapshot marked {mark!r}"
        with open(path, "rb") as f:
            assert f.read() == sid.to_bytes(8, "little")
        os.unlink(path)

    @precondition(lambda self: bool(self.files))
    @rule(data=st.data(), name=st.sampled_from([None, None, *NAMES]), accept=st.sampled_from(["right", None, "wrong"]))
    def import_file(self, data: st.DataObject, name: str | None, accept: str | None) -> None:
        """Import a file the machine exported earlier (maybe of a snapshot deleted or evicted since)."""
        self._import(data.draw(st.sampled_from(self.files), label="file"), name, accept)

    def _import(self, f: _File, name: str | None, accept: str | None) -> None:
        """Import ``f``: the store's own identity needs no override; another's needs accept_identity
        naming it, and is then restored by id or name only; a wrong key is refused, nothing changes."""
        assert self.store is not None
        foreign_key = self.foreign.identity.key if self.foreign is not None else None
        key = {"right": foreign_key if f.foreign_identity or f.saved.foreign else None,
               "wrong": "id-" + "0" * 32, None: None}[accept]
        before = set(self._live())
        try:
            res = self.store.import_file(f.path, name, accept_identity=key)
        except IdentityError:
            assert set(self._live()) == before, "a refused import changed the store"
            assert f.foreign_identity or f.saved.foreign or key is not None, "the store's own export was refused"
            return
        except StateError:  # the chain does not fit the budget
            assert set(self._live()) == before, "a refused import changed the store"
            return
        assert accept != "wrong", "an import under a key that names no identity was accepted"
        if f.foreign_identity:
            assert key is not None, "another identity's file was imported without accept_identity"
        saved = f.saved
        sid = res.snapshot_id
        assert res.n_tokens == saved.n and res.namespace == saved.namespace
        assert res.links == len(f.chain), f"the import reports {res.links} links, the file holds {len(f.chain)}"
        live = self._live()
        chain = self._chain(live, sid)
        assert len(chain) == len(f.chain), f"the imported chain has {len(chain)} links, the file {len(f.chain)}"
        marked_file = f.foreign_identity or any(link.foreign for link in f.chain)
        for link_id, link in zip(chain, f.chain):
            # 46A item 1: a snapshot imported under an override, exported and imported again without one
            # keeps its mark (or the export is refused): another identity's state never turns native
            foreign = f.foreign_identity or link.foreign
            if link_id not in self.model and marked_file and live[link_id].imported_from is not None:
                foreign = True  # a native link of a marked file may come back marked: over-cautious, not wrong
            if link_id in self.model:
                old = self.model[link_id]
                assert (old.conv, old.n, old.namespace) == (link.conv, link.n, link.namespace), \
                    "an import reused a snapshot of other tokens"
                # 46A item 5 (the import's side): native state is never deduplicated onto an override import
                assert foreign or not old.foreign, "a native import was deduplicated onto an override import"
            else:
                self.clock += 1
                self.model[link_id] = _Saved(link.conv, link.n, link.fixed_seed, None, False, link.components,
                                             self.clock, namespace=link.namespace, foreign=foreign)
        if res.name is not None:
            assert res.name == (name if name is not None else f.name)
            self.names[(saved.namespace, res.name)] = _Name(sid, None)

    @rule(data=st.data(), gc=st.booleans(), twice=st.booleans())
    def lose_a_chunk_file(self, data: st.DataObject, gc: bool, twice: bool) -> None:
        """A chunk file is lost (a disk, an operator); the restores that need it fail (and quarantine
        it); importing the backups exported before heals it as a save would (46A item 6)."""
        assert self.store is not None
        live = self._live()
        whole = sorted(i for i, x in live.items() if self._whole(x))
        if not whole or any(x.pending for x in live.values()):
            return  # a pending capture's own chunks have no backup to heal them from
        backups: dict[int, _File] = {}
        for sid in whole:
            path = self._new_file()
            self.store.export(self._ref(sid), path)
            backups[sid] = _File(path, tuple(self.model[i] for i in self._chain(live, sid)), False, None)
            self.files.append(backups[sid])
        blobs = os.path.join(self.dir, "blobs")
        chunk_files = sorted(os.path.join(d, f) for d, _, fs in os.walk(blobs) for f in fs)
        if not chunk_files:
            return
        os.unlink(data.draw(st.sampled_from(chunk_files), label="lost chunk file"))
        broken = []
        for sid in whole:
            dest = self._dest()
            try:
                res = self.store.restore(self._ref(sid), dest)
            except SnapstoreError:
                broken.append(sid)
                continue
            assert _digest(self._got(dest, res.rows, res.missing_components)) == _digest(self._expected(sid))
        if gc:
            self.store.gc(grace=0)
        for sid in broken * (2 if twice else 1):
            self._import(backups[sid], None, "right")
        if not self.store.verify(deep=False).ok:  # a chunk the RAM tier still held: no restore failed
            for sid in whole:
                self._import(backups[sid], None, "right")
        report = self.store.verify(deep=False)  # 46A item 6: an import that does not heal a lost chunk file
        assert report.ok, f"importing the backups did not heal a lost chunk file: {report.problems}"
        for sid in broken:
            dest = self._dest()
            res = self.store.restore(self._ref(sid), dest)  # 46A item 6: the import did not heal the chunk
            assert _digest(self._got(dest, res.rows, res.missing_components)) == _digest(self._expected(sid)), \
                f"snapshot {sid} did not restore byte-exact after its backup was imported"

    # -- time, restarts, maintenance --------------------------------------------------------
