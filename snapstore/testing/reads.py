"""The state machine's rules that read."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import rule

from snapstore._results import Match, MatchDetails
from snapstore.store.store import Store
from snapstore.testing.model import NAMESPACES, _digest
from snapstore.testing.saves import _Saves


class _Reads(_Saves):
    """Rules that read: match, lookup, the weighed match, every way to restore, a read-only view."""

    @rule(data=st.data(), session=st.sampled_from([None, "s0", "s1"]))
    def restore_elsewhere(self, data: st.DataObject, session: str | None) -> None:
        """Another conversation (or a caller without a session) restores a session's snapshot."""
        assert self.store is not None
        outside = sorted(i for i, x in self._live().items()
                         if x.matchable and not x.pending and x.session is not None and x.session != session)
        if not outside:
            return
        sid = data.draw(st.sampled_from(outside), label="snapshot")
        self._restore(sid, session)
        self.model[sid].shared = True


    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        """match(), lookup() and match_many() against the model, plain and weighed against prefill.

        Hypothesis draws the rules with the fewest arguments most often: this cheap, checking one is
        first; the destructive ones (delete, restarts, maintenance) take more."""
        assert self.store is not None
        namespace = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        exclude = data.draw(st.booleans(), label="exclude")
        # numpy scalars too: every numeric argument takes what numbers.Real takes (46B item 13)
        rate = data.draw(st.sampled_from([None, None, 1.0, 1e12, 2000.0, np.int64(1), np.float32(2000.0)]),
                         label="prefill_tokens_per_s")
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        q = w.tokens[conv][:self._draw_n(data)]
        live = self._live()
        skip: set[int] = set()
        if exclude and live:
            skip = {data.draw(st.sampled_from(sorted(live)), label="exclude")}
        if rate is None:
            m = self.store.match(q, namespace=namespace, exclude=skip)
            self._check_match(q, namespace, m, live, skip)
            d = self.store.lookup(q, namespace=namespace, exclude=skip)
            assert (d.n_tokens if d is not None else None) == (m.n_tokens if m is not None else None), \
                "lookup() and match() disagree"
            if not skip:
                [many] = self.store.match_many([q], namespace=namespace)
                assert (many.n_tokens if many else None) == (m.n_tokens if m else None), "match_many() != match()"
            return
        plain = self.store.match(q, namespace=namespace, exclude=skip)
        weighed = self.store.match(q, namespace=namespace, exclude=skip, prefill_tokens_per_s=rate)
        if weighed is not None:
            self._check_match_safe(q, namespace, weighed, skip, "a weighed match()")
            assert weighed.why is not None and weighed.why.chosen == weighed.snapshot_id
        if rate == 1.0 and plain is not None and plain.n_tokens >= 20:
            # a token a second: any restore saves time (20 s against estimates of milliseconds), the longest wins
            assert (weighed.n_tokens if weighed else None) == (plain.n_tokens if plain else None), \
                "a weighed match at 1 token/s did not take the longest prefix"
        if rate == 1e12:  # reading is faster than any restore
            assert weighed is None, "a weighed match at 1e12 tokens/s chose a restore"
        d = self.store.lookup(q, namespace=namespace, exclude=skip, prefill_tokens_per_s=rate)
        if d is not None:
            self._check_match_safe(q, namespace, Match(d.snapshot_id, d.n_tokens, namespace), skip,
                                   "a weighed lookup()")

    def _check_match_safe(self, q: np.ndarray, ns: str | None, got: Match, skip: set[int], what: str) -> None:
        saved = self.model.get(got.snapshot_id)
        assert saved is not None and not saved.foreign, f"{what} served state imported under an identity override"
        assert saved.namespace == ns and got.snapshot_id not in skip
        assert np.array_equal(self._tokens(saved), q[:saved.n]), f"{what} served a snapshot that is not a prefix"

    @rule(data=st.data(), how=st.sampled_from(["match", "describe", "callable", "base", "rows_from", "many", "load",
                                               "details"]))
    def restore_ways(self, data: st.DataObject, how: str) -> None:
        """The other ways to restore: a Match, describe() then restore, a callable ``into``, the base
        state alone, ``rows_from``, restore_many(), load() — each byte-exact, as the model says."""
        assert self.store is not None
        live = self._live()
        ok = sorted(i for i, x in live.items() if self._whole(x))
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok), label="snapshot")
        saved, ref = self.model[sid], self._ref(sid)
        store = self.store
        want = self._expected(sid)
        if how == "load":
            if saved.foreign:
                return
            q = self._tokens(saved)
            dests: list[dict[str, np.ndarray]] = []

            def allocate(details: MatchDetails) -> dict[str, np.ndarray]:
                dests.append(self._dest())
                return dests[-1]

            lr = store.load(q, allocate=allocate, namespace=saved.namespace)
            assert lr is not None and lr.n_tokens <= saved.n
            got_sid = lr.match.snapshot_id
            self._check_match(q, saved.namespace, lr.match, live)
            got = self._got(dests[-1], lr.rows, lr.missing_components)
            assert _digest(got) == _digest(self._expected(got_sid)), "load() was not byte-exact"
            return
        if how == "many":
            other = data.draw(st.sampled_from(ok), label="second")
            reqs = [(ref, self._dest()), (self._ref(other), self._dest())]
            if self.model[other].namespace != saved.namespace:
                return
            many = store.restore_many(reqs, namespace=saved.namespace)
            for (r, dest), rr in zip(reqs, many):
                got = self._got(dest, rr.rows, rr.missing_components)
                assert _digest(got) == _digest(self._expected(r.snapshot_id)), "restore_many() was not byte-exact"
            return
        details = store.describe(ref)
        assert details.n_tokens == saved.n and details.snapshot_id == sid
        if how == "details" and not saved.foreign:  # lookup()'s MatchDetails as the ref (46B item 2)
            d = store.lookup(self._tokens(saved), namespace=saved.namespace)
            assert d is not None and d.n_tokens == saved.n
            dest = self._dest()
            res = store.restore(d, dest)
            assert res.n_tokens == d.n_tokens
            got = self._got(dest, res.rows, res.missing_components)
            assert _digest(got) == _digest(self._expected(d.snapshot_id)), "restore(MatchDetails) was not byte-exact"
            return
        est = store.estimate_restore(ref)
        assert est.bytes >= 0 and est.seconds > 0
        dest = self._dest()
        comps: set[str | None] | None = None
        if how == "callable":
            seen: list[MatchDetails] = []

            def plan_then_write(d: MatchDetails) -> dict[str, np.ndarray]:
                seen.append(d)
                return dest

            res = store.restore(ref, plan_then_write)
            assert seen and seen[0].n_tokens == saved.n
        elif how == "base":
            comps = {None}
            res = store.restore(ref, dest, components=())
        elif how == "rows_from":
            k = data.draw(st.integers(0, saved.n), label="rows_from")
            res = store.restore(ref, dest, rows_from=k)
            got = self._got(dest, res.rows, res.missing_components)
            for name, spec in self.engine.layout.rows.items():
                if name in got:  # rows below k were not written; the rest are the snapshot's
                    rb = spec.row_bytes
                    assert got[name][:k * rb] == bytes(min(k, res.rows[name]) * rb)
                    assert got[name][k * rb:] == want[name][k * rb:], "restore(rows_from=k) was not byte-exact"
            return
        elif how == "match":
            res = store.restore(ref, dest)
        else:
            res = store.restore(sid, dest, namespace=saved.namespace)
        assert res.n_tokens == saved.n
        got = self._got(dest, res.rows, res.missing_components, comps)
        assert _digest(got) == _digest(self._expected(sid, comps)), f"restore ({how}) was not byte-exact"

    def read_only_view(self) -> None:
        """A read-only Store of the same directory sees what the writer sees, and restores it exactly."""
        assert self.store is not None
        ro = Store.open(self.dir, identity=self.engine.identity, layout=self.engine.layout, read_only=True)
        try:
            live = self._live()
            for sid in sorted(i for i, x in live.items() if self._whole(x))[:2]:
                saved = self.model[sid]
                dest = self._dest()
                res = ro.restore(self._ref(sid), dest)
                assert _digest(self._got(dest, res.rows, res.missing_components)) == _digest(self._expected(sid)), \
                    "a read-only store did not restore byte-exact"
                m = ro.match(self._tokens(saved), namespace=saved.namespace)
                self._check_match(self._tokens(saved), saved.namespace, m, live)
        finally:
            ro.close()

    # -- names -------------------------------------------------------------------------------
