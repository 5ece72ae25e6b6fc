"""StoreStateMachine: time, restarts, maintenance and the invariants checked after every step."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from snapstore._identity import Identity
from snapstore.store.store import Store
from snapstore.testing.engine import NumpyEngine, Workload
from snapstore.testing.model import _MARGIN, _digest
from snapstore.testing.names_and_files import _Transfer


class StoreStateMachine(_Transfer):
    """Drives ``engine`` (a :class:`NumpyEngine` or subclass) against a reference model.

    Use :meth:`for_engine` to bind an engine; ``.TestCase`` is then a unittest/pytest test.
    """

    engine: NumpyEngine
    @classmethod
    def for_engine(cls, engine: NumpyEngine, *, workload: Workload | None = None,
                   codecs: tuple[str, ...] | None = None) -> type[StoreStateMachine]:
        """A machine class bound to ``engine`` (and a workload over its layout)."""
        work = workload or Workload(engine.layout)
        if work.max_tokens > engine.max_rows:
            raise ValueError(f"the workload needs {work.max_tokens} rows, the engine restores {engine.max_rows}")
        params = inspect.signature(engine.restore).parameters
        observe = "session" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        oparams = inspect.signature(engine.open).parameters
        options = "admit" in oparams or any(p.kind == p.VAR_KEYWORD for p in oparams.values())
        attrs: dict[str, Any] = {"engine": engine, "workload": work, "codecs": codecs or cls.codecs,
                                 "observe_as_session": observe, "open_takes_options": options}
        return type(f"{cls.__name__}For{type(engine).__name__}", (cls,), attrs)


    @rule(seconds=st.sampled_from([600.0, 4000.0]), gc=st.booleans(), reopen=st.booleans())
    def advance_clock(self, seconds: float, gc: bool, reopen: bool) -> None:
        """Time passes: names with ``ttl_s`` end, the store's TTL passes over unused snapshots (never
        named ones), the write rate refills."""
        assert self.store is not None
        self.time.offset += seconds
        now = self.time.now()
        for k, v in list(self.names.items()):
            if v.expires is not None and v.expires < now - _MARGIN:
                assert self.store.named(k[1], namespace=k[0]) is None, f"name {k} outlived its ttl_s"
                del self.names[k]
        if self.budget.ttl:
            self._aged = True
            if seconds > self.budget.ttl + _MARGIN and not self._unsure_names(now):
                # nothing was used since the jump: only named snapshots may match (46C item 8 if they do not)
                live = self._live()
                named = self._ttl_exempt(live, now)
                for sid in sorted(i for i in live if not self.model[i].foreign)[:6]:
                    saved = self.model[sid]
                    q = self._tokens(saved)
                    m = self.store.match(q, namespace=saved.namespace)
                    best = max((self.model[i].n for i in self._candidates(live, q, saved.namespace, only=named)),
                               default=0)
                    assert (m.n_tokens if m else 0) == best, (
                        f"after the store's TTL, match() served {m} where only named snapshots may match "
                        f"(the longest named: {best} tokens)")
                if gc or reopen:  # the TTL's drops: every unnamed leaf goes (a pending capture keeps its parents)
                    if gc:
                        self.store.gc(grace=0)
                    else:
                        self.reopen()
                    live = self._live()
                    parents = {x.parent_id for x in live.values()}
                    left = sorted(i for i, x in live.items() if i not in named and i not in parents and not x.pending)
                    assert not left, f"unnamed snapshots {left} outlived the store's TTL through gc/open"

    @rule(kind=st.sampled_from(["reopen", "reopen", "rebuilt", "read_only"]), gc_first=st.booleans())
    def restart(self, kind: str, gc_first: bool) -> None:
        """The engine restarts (close, open), the same model opens under another build, or a
        read-only Store of the directory looks on."""
        assert self.store is not None
        if gc_first:
            self.store.gc(grace=0)
        {"reopen": self.reopen, "rebuilt": self.rebuilt_engine, "read_only": self.read_only_view}[kind]()
        if gc_first and self.store is not None:
            assert self.store.verify(deep=True).ok

    def reopen(self) -> None:
        assert self.store is not None
        self.store.close()
        self.store = self._open()
        live = self._live()
        assert not [i for i, s in self.model.items() if s.pending and i in live], \
            "close() must abandon this process's pending captures"

    def rebuilt_engine(self) -> None:
        """The same model opens under another build (drop_stale): this identity's snapshots go as stale,
        except named ones and their chains (46C item 11: today they are dropped too)."""
        assert self.store is not None
        self.store.close()
        self.store = None
        ident = self.engine.identity
        rebuilt = Identity(build=ident.build + "+rebuilt", pack=ident.pack, kv=ident.kv, mtp=ident.mtp,
                           extra=dict(ident.extra))
        Store.open(self.dir, identity=rebuilt, layout=self.engine.layout, budget=self.budget,
                   drop_stale=True).close()
        self.store = self._open()
        live = self._live()
        keep: set[int] = set()
        now = self.time.now()
        for v in self.names.values():
            if v.expires is not None and v.expires <= now - _MARGIN:
                continue  # clearly expired: it protects nothing
            sid: int | None = v.sid
            while sid is not None and sid in live and sid not in keep:
                keep.add(sid)
                sid = live[sid].parent_id
        assert set(live) <= keep, f"a stale drop kept unnamed snapshots {sorted(set(live) - keep)}"
        self._shared_live &= set(live)

    @rule(gc=st.booleans(), deep=st.booleans(), warm=st.booleans())
    def maintenance(self, gc: bool, deep: bool, warm: bool) -> None:
        """gc (else a dry run, which changes nothing), then verify (quick or deep), stats and warm_up:
        reads that change nothing a match sees."""
        assert self.store is not None
        if gc:
            self.store.gc(grace=0)
        else:
            before = self._live()
            self.store.gc(grace=0, dry_run=True)
            assert set(self._live()) == set(before), "gc(dry_run=True) changed the store"
        report = self.store.verify(deep=deep)
        assert report.ok, f"verify found damage: {report.problems}"
        if warm:
            self.store.warm_up()
        stats = self.store.stats()
        assert stats.entries <= len(self._live())

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def pins_and_budgets(self) -> None:
        if self.store is None:
            return
        live = self._live()
        assert set(live) <= set(self.model), "a snapshot the model never saved"
        for x in live.values():
            assert x.parent_id is None or x.parent_id in live, "a parent was dropped under a live child"
        stats = self.store.stats()
        assert stats.stored_bytes <= (self.budget.disk_bytes or 0), "disk budget exceeded"
        if self.budget.max_entries is not None:
            assert stats.entries <= self.budget.max_entries, "max_entries exceeded"

    @invariant()
    def override_marks(self) -> None:
        """A snapshot is marked imported under an override exactly when the model says its state is
        another identity's (46A items 1 and 5 break this)."""
        if self.store is None:
            return
        for sid, x in self._live().items():
            foreign = self.model[sid].foreign
            assert (x.imported_from is not None) == foreign, (
                f"snapshot {sid}: imported_from={x.imported_from!r}, but the model says its state is "
                f"{'another identity' if foreign else 'this identity'}'s")

    @invariant()
    def names_hold(self) -> None:
        """Every live name finds its snapshot, which restores and (when native) matches its own tokens."""
        if self.store is None:
            return
        now = self.time.now()
        live = self._live()
        for (ns, nm), v in self._valid_names(now).items():
            m = self.store.named(nm, namespace=ns)
            # 46C item 11: a stale drop took a named snapshot
            assert m is not None and m.snapshot_id == v.sid, f"named({nm!r}, namespace={ns!r}) is {m}, not #{v.sid}"
            assert v.sid in live, f"named snapshot #{v.sid} is gone"
            saved = self.model[v.sid]
            assert m.n_tokens == saved.n
            if not saved.foreign:
                got = self.store.match(self._tokens(saved), namespace=ns)
                # 46C item 8: a named snapshot stops matching once unused for the store's TTL
                assert got is not None and got.n_tokens == saved.n, \
                    f"named snapshot #{v.sid} ({saved.n} tokens) does not match its own tokens: {got}"

    @invariant()
    def supersede_in_sessions(self) -> None:
        if self.store is None:
            return
        w = self.workload
        live = [x for x in self._live().values() if x.matchable and not x.pending]
        for a in live:
            for b in live:
                ma, mb = self.model[a.snapshot_id], self.model[b.snapshot_id]
                if a.session is not None and a.session == b.session and ma.namespace == mb.namespace \
                        and ma.n < mb.n and ma.order < mb.order:
                    assert not np.array_equal(w.tokens[ma.conv][:ma.n], w.tokens[mb.conv][:ma.n]), \
                        "a superseded prefix is still matchable in its session"
        live_now = self._live()
        stats = self.store.stats()
        evictions = stats.evictions + stats.expired  # the budget's drops and the TTL's
        for sid, x in live_now.items():
            if self.model[sid].shared:
                assert x.matchable, f"snapshot {sid} was restored from outside its session, then superseded away"
        gone = {i for i in self._shared_live if i not in live_now}
        assert not gone or evictions > self._evictions, \
            f"snapshots {sorted(gone)} were restored from outside their session, then dropped (not evicted)"
        self._shared_live = {i for i in live_now if self.model[i].shared}
        self._evictions = evictions

    @invariant()
    def restores_are_exact(self) -> None:
        if self.store is None:
            return
        for sid, x in self._live().items():
            if not self._whole(x):
                continue
            saved = self.model[sid]
            res, got = self._restore(sid, x.session)
            assert res.n_tokens == saved.n
            want = self.workload.expected(saved.conv, saved.n, saved.fixed_seed, set(saved.components))
            assert _digest(got) == _digest(want), f"snapshot {sid} did not restore byte-exact"
            assert res.missing_components == frozenset(c for c in {s.component for s in
                                                                   self.engine.layout.parts.values()}
                                                       if c is not None and c not in saved.components)

    @invariant()
    def verify_clean(self) -> None:
        if self.store is not None:
            report = self.store.verify(deep=False)
            assert report.ok, f"verify found damage: {report.problems}"
