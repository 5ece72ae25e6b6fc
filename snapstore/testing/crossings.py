"""The state machine's rules where features meet: the read calls agreeing with one another and the
model (match / lookup / describe / estimate_restore / load), batches (match_many, restore_many),
gc's grace period beside the model's snapshots, and a read-only reopen reading exactly what the
model says (and writing nothing)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from snapstore._config import Budget
from snapstore._errors import StateError
from snapstore._results import Match, MatchDetails
from snapstore.store.store import Store
from snapstore.testing.model import NAMESPACES, _digest
from snapstore.testing.names_and_files import _Transfer


class _Crossings(_Transfer):
    """Rules that check one call against another and against the model."""

    def _comps_of(self, sid: int) -> tuple[frozenset[str], dict[str, int]]:
        """The components the model says ``sid`` holds (named ones) and its stream row counts."""
        saved = self.model[sid]
        comps = frozenset(c for c in saved.components if c is not None)
        rows = {name: saved.n for name, spec in self.engine.layout.rows.items() if spec.component in saved.components}
        return comps, rows

    @rule(data=st.data())
    def reads_agree(self, data: st.DataObject) -> None:
        """For a prompt that extends a live snapshot's tokens: match(), lookup(), describe(match),
        estimate_restore(match) and load(match / details) agree with one another and the model
        (rows, components, chain, bytes)."""
        assert self.store is not None
        live = self._live()
        ok = sorted(i for i, x in live.items() if x.matchable and not x.pending and not self.model[i].foreign)
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok), label="snapshot")
        saved = self.model[sid]
        w = self.workload
        q = w.tokens[saved.conv][:data.draw(st.integers(saved.n, w.max_tokens), label="prompt length")]
        ns = saved.namespace
        m = self.store.match(q, namespace=ns)
        self._check_match(q, ns, m, live)
        assert m is not None, f"match() of a prompt extending live snapshot {sid} missed"
        d = self.store.lookup(q, namespace=ns)
        assert d is not None and (d.snapshot_id, d.n_tokens) == (m.snapshot_id, m.n_tokens), \
            f"lookup() {d and (d.snapshot_id, d.n_tokens)} != match() {(m.snapshot_id, m.n_tokens)}"
        desc = self.store.describe(m)
        got = self.model[m.snapshot_id]
        comps, rows = self._comps_of(m.snapshot_id)
        for what, x in (("lookup()", d), ("describe()", desc)):
            assert x.n_tokens == got.n and x.rows == rows, f"{what} rows {x.rows}, the model: {rows}"
            assert x.components == comps, f"{what} components {x.components}, the model: {comps}"
            every = frozenset(s.component for s in self.engine.layout.parts.values() if s.component is not None)
            assert x.missing_components == every - comps, f"{what} missing {x.missing_components}"
            assert x.chain == self._chain(live, m.snapshot_id), f"{what} chain {x.chain}"
            assert not x.pending
        assert (d.nbytes, d.part_bytes) == (desc.nbytes, desc.part_bytes), "lookup() and describe() disagree on bytes"
        want = self._expected(m.snapshot_id)
        assert desc.nbytes == sum(len(v) for v in want.values()), "describe() bytes are not what a restore writes"
        est = self.store.estimate_restore(m)
        assert est.seconds > 0 and est.bytes >= 0 and sum(est.tiers.values()) == est.bytes, f"estimate {est}"
        dests: list[dict[str, np.ndarray]] = []

        def allocate(details: MatchDetails) -> dict[str, np.ndarray]:
            assert (details.snapshot_id, details.rows, details.nbytes) == (desc.snapshot_id, desc.rows, desc.nbytes)
            dests.append(self._dest())
            return dests[-1]

        ref: Any = data.draw(st.sampled_from([m, d]), label="load(Match or MatchDetails)")
        lr = self.store.load(ref, allocate=allocate, namespace=ns)
        assert lr is not None and lr.match.snapshot_id == m.snapshot_id and lr.n_tokens == got.n
        assert lr.chain == desc.chain and lr.rows == rows
        assert _digest(self._got(dests[-1], lr.rows, lr.missing_components)) == _digest(want), \
            "load() of a Match / MatchDetails was not byte-exact"

    @rule(data=st.data())
    def batches(self, data: st.DataObject) -> None:
        """match_many() of a few prompts, each as the model says; restore_many() of its hits (by Match,
        by id, by MatchDetails) byte-exact, with the chains the model knows."""
        assert self.store is not None
        # one argument: Hypothesis draws the rules with the fewest arguments most often
        namespace = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        session = data.draw(st.sampled_from([None, "s0"]), label="session")
        w = self.workload
        live = self._live()
        k = data.draw(st.integers(1, 4), label="prompts")
        qs = [w.tokens[data.draw(st.integers(0, w.conversations - 1), label="conv")][:self._draw_n(data)]
              for _ in range(k)]
        many = self.store.match_many(qs, namespace=namespace)
        assert len(many) == len(qs)
        for q, m in zip(qs, many):
            self._check_match(q, namespace, m, live, what="match_many()")
        hits: list[Any] = [m for m in many if m is not None]
        ok = sorted(i for i, x in live.items() if self._whole(x) and self.model[i].namespace == namespace)
        if ok:  # and a snapshot match() may not serve (an override import, a shorter prefix)
            hits.append(data.draw(st.sampled_from(ok), label="by id"))
        if not hits:
            return
        reqs: list[tuple[Any, dict[str, np.ndarray]]] = []
        for m in hits:
            sid = m if isinstance(m, int) else m.snapshot_id
            how = data.draw(st.sampled_from(["match", "id", "details"]), label="ref")
            ref: Any = (m if not isinstance(m, int) else self._ref(sid)) if how == "match" else \
                sid if how == "id" else self.store.describe(self._ref(sid))
            reqs.append((ref, self._dest()))
        results = self.store.restore_many(reqs, namespace=namespace, session=session)
        assert len(results) == len(reqs)
        for (ref, dest), res in zip(reqs, results):
            sid = ref if isinstance(ref, int) else ref.snapshot_id
            saved = self.model[sid]
            _, rows = self._comps_of(sid)
            assert res.n_tokens == saved.n and res.rows == rows, f"restore_many(): {res.n_tokens} tokens, {res.rows}"
            assert res.chain == self._chain(live, sid), f"restore_many() chain {res.chain}"
            got = self._got(dest, res.rows, res.missing_components)
            assert _digest(got) == _digest(self._expected(sid)), f"restore_many() of {sid} was not byte-exact"
            if session is not None and live[sid].session is not None and live[sid].session != session \
                    and live[sid].matchable:
                saved.shared = True  # a use from outside its session, as restore_elsewhere's

    @rule(data=st.data())
    def gc_grace(self, data: st.DataObject) -> None:
        """gc with a grace period: a fresh temp file (and an orphan chunk file) stay, and an old one goes;
        gc removes no snapshot the model keeps (no TTL passed, budgets hold), and a dry run nothing."""
        assert self.store is not None
        orphan = data.draw(st.booleans(), label="an orphan chunk file too")
        tmp = os.path.join(self.dir, "tmp")
        planted = [os.path.join(tmp, f"w-planted-{len(self.files)}-{data.draw(st.integers(0, 999))}")]
        if orphan:
            blobs = os.path.join(self.dir, "blobs")
            real = sorted(os.path.join(d, f) for d, _, fs in os.walk(blobs) for f in fs)
            if real:  # the name of a chunk no catalog row holds, beside the real ones
                h = format(data.draw(st.integers(0, 2**256 - 1), label="orphan id"), "064x")
                planted.append(os.path.join(blobs, h[:2], h))
        for p in planted:
            if not os.path.exists(p):
                with open(p, "wb") as f:
                    f.write(b"left over by a crash")
        now = self.time.now()
        grace = (now - min(os.stat(p).st_mtime for p in planted)) + 3600.0  # every planted file is young
        before = self._live()
        rep = self.store.gc(grace=grace)
        for p in planted:
            assert os.path.exists(p), f"gc(grace={grace:.0f}) removed {p}, younger than the grace period"
        self._check_gc(before, rep)
        old = now - grace - 60.0  # past the grace period (on the machine's clock)
        for p in planted:
            os.utime(p, (old, old))
        before = self._live()
        dry = self.store.gc(grace=grace, dry_run=True)
        assert set(self._live()) == set(before) and all(os.path.exists(p) for p in planted), "a dry run changed"
        listed = set(dry.temp_files) | set(dry.orphan_files)
        assert {os.path.realpath(p) for p in planted} <= {os.path.realpath(p) for p in listed}, \
            f"gc(dry_run=True) did not list the old leftovers {planted}: {sorted(listed)}"
        rep = self.store.gc(grace=grace)
        for p in planted:
            assert not os.path.exists(p), f"gc(grace={grace:.0f}) kept {p}, older than the grace period"
        self._check_gc(before, rep)

    def _check_gc(self, before: dict[int, Any], rep: Any) -> None:
        """What gc took: exactly what it reports, and only what the TTL lets go (dead owners, stale
        identities and over-budget leaves: none here, one live process within its budgets)."""
        after = self._live()
        gone = set(before) - set(after)
        assert not set(after) - set(before), "gc() made snapshots"
        assert gone == set(rep.removed_snapshots) & set(before), \
            f"gc() removed {sorted(gone)} but reported {sorted(rep.removed_snapshots)}"
        assert not rep.dead_pending and not rep.stale, f"gc() dropped a live owner's or this identity's: {rep}"
        assert not rep.evicted, f"gc() evicted {rep.evicted} from a store within its budgets"
        if gone and not self.budget.ttl:
            raise AssertionError(f"gc() removed {sorted(gone)} without a TTL")
        now = self.time.now()
        if gone and not self._unsure_names(now):
            kept = self._ttl_exempt(before, now)
            assert not gone & kept, f"gc() expired named snapshots (or their chains) {sorted(gone & kept)}"
        for i in gone:
            assert not before[i].pending, f"gc() removed this process's pending capture {i}"
        self._shared_live &= set(after)
        assert self.store is not None
        stats = self.store.stats()
        self._evictions = stats.evictions + stats.expired

    def read_only_reopen(self) -> None:
        """The engine stops; a read-only Store of the directory reads exactly what the model says —
        snapshots, names, matches, restores — refuses every change, and writes nothing; then the
        engine starts again."""
        assert self.store is not None
        infos = {i: x for i, x in self._live().items() if not x.pending}
        self.store.close()
        self.store = None
        listing = _listing(self.dir)
        now = self.time.now()
        ro = Store.open(self.dir, identity=self.engine.identity, layout=self.engine.layout, read_only=True,
                        budget=Budget(ram_bytes=self.budget.ram_bytes, reserve_bytes=0))  # no TTL: every match
        try:
            assert ro.read_only
            seen = {x.snapshot_id: x for x in ro.snapshots()}
            assert set(seen) == set(infos), \
                f"a read-only store lists {sorted(seen)}, the writer left {sorted(infos)}"
            for sid, x in seen.items():
                y = infos[sid]
                assert (x.parent_id, x.n_tokens, x.matchable, x.namespace, x.session, x.imported_from) == \
                       (y.parent_id, y.n_tokens, y.matchable, y.namespace, y.session, y.imported_from), \
                    f"snapshot {sid} reads otherwise read-only"
            for (ns, nm), v in self._valid_names(now).items():
                m = ro.named(nm, namespace=ns)
                assert m is not None and m.snapshot_id == v.sid, f"read-only named({nm!r}) is {m}, not #{v.sid}"
            whole = sorted(i for i, x in seen.items() if self._whole(x))
            saved_aged, self._aged = self._aged, False  # the read-only store has no TTL: the longest, exactly
            try:
                qs = [self._tokens(self.model[i]) for i in whole[:4]]
                for i, q in zip(whole, qs):
                    ns = self.model[i].namespace
                    self._check_match(q, ns, ro.match(q, namespace=ns), seen, what="a read-only match()")
                    d = ro.lookup(q, namespace=ns)
                    self._check_match(q, ns, Match(d.snapshot_id, d.n_tokens, ns) if d else None, seen,
                                      what="a read-only lookup()")
            finally:
                self._aged = saved_aged
            reqs = [(self._ref(i), self._dest()) for i in whole[-3:]]
            for (ref, dest), res in zip(reqs, ro.restore_many(reqs)):
                assert _digest(self._got(dest, res.rows, res.missing_components)) == \
                    _digest(self._expected(ref.snapshot_id)), "a read-only restore_many() was not byte-exact"
            assert ro.verify(deep=False).ok
            ro.gc(grace=0, dry_run=True)
            ro.stats()
            w = self.workload
            refusals: list[tuple[str, Any]] = [
                ("save", lambda: ro.save(w.tokens[0][:10], w.state(0, 0))),
                ("gc", lambda: ro.gc(grace=0)),
                ("turn", lambda: ro.turn()),
            ]
            if whole:
                refusals += [("delete", lambda: ro.delete(self._ref(whole[0]))),
                             ("name", lambda: ro.name(self._ref(whole[0]), "ro-name"))]
            for what, call in refusals:
                try:
                    call()
                except StateError:
                    continue
                raise AssertionError(f"a read-only store did not refuse {what}()")
        finally:
            ro.close()
        after = _listing(self.dir)
        assert after == listing, ("a read-only store wrote to the directory: "
                                  f"{sorted(set(after.items()) ^ set(listing.items()))[:6]}")
        self.store = self._open()

    @invariant()
    def infos_agree(self) -> None:
        """snapshots() describes each snapshot as the model saved it: tokens, namespace, components, rows;
        stats() counts its entries."""
        if self.store is None:
            return
        live = self._live()
        for sid, x in live.items():
            saved = self.model[sid]
            comps, rows = self._comps_of(sid)
            assert (x.n_tokens, x.namespace) == (saved.n, saved.namespace), \
                f"snapshot {sid}: {x.n_tokens} tokens in {x.namespace!r}, the model: {saved.n} in {saved.namespace!r}"
            assert frozenset(x.components) == comps and x.rows == rows, \
                f"snapshot {sid}: components {x.components} rows {x.rows}, the model: {sorted(comps)} {rows}"
            assert x.pending == saved.pending, f"snapshot {sid}: pending={x.pending}, the model: {saved.pending}"
        stats = self.store.stats()
        assert stats.snapshots == len(live), f"stats().snapshots={stats.snapshots}, snapshots() lists {len(live)}"
        assert stats.pending == sum(x.pending for x in live.values()), f"stats().pending={stats.pending}"
        entries = stats.entries
        low = sum(1 for x in live.values() if x.matchable and not x.pending)
        high = sum(1 for x in live.values() if not x.pending and (x.matchable or x.quarantined or x.imported_from))
        assert low <= entries <= high, f"stats().entries={entries}; the snapshots say {low}..{high}"


def _listing(root: str) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, mtime in ns)."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            st = os.stat(p, follow_symlinks=False)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out
