"""The state machine's rules that save."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from snapstore._config import Budget
from snapstore._errors import LayoutError
from snapstore._results import SaveResult
from snapstore.testing.base import _MachineBase
from snapstore.testing.model import NAMESPACES, SEEDS, _Abandon


class _Saves(_MachineBase):
    """Rules that save: save(), turns, save(wait=False), commit/abandon of pending captures."""

    @initialize(disk=st.integers(30_000, 400_000), entries=st.none() | st.integers(2, 12),
                ttl=st.sampled_from([None, 3600.0]), write=st.sampled_from([None, None, None, 150_000]),
                admit=st.sampled_from(["always", "always", "always", "second_hit"]), data=st.data())
    def start(self, disk: int, entries: int | None, ttl: float | None, write: int | None, admit: str,
              data: st.DataObject) -> None:
        self.budget = Budget(disk_bytes=disk, max_entries=entries, reserve_bytes=0, ram_bytes=1 << 20, ttl=ttl,
                             write_bytes_per_hour=write)
        self.codec = data.draw(st.sampled_from(self.codecs), label="codec")
        self.admit = admit if self.open_takes_options else "always"
        self.store = self._open()
        for _ in range(data.draw(st.integers(0, 3), label="first saves")):
            self.save(data)  # a store with something in it: the other rules have work from the first step


    @rule(data=st.data())
    def save(self, data: st.DataObject) -> None:
        """save() through the engine: any session, namespace, parent rule, with or without the draft."""
        assert self.store is not None
        session = data.draw(st.sampled_from([None, "s0", "s1"]), label="session")
        commit = data.draw(st.booleans(), label="commit")
        parent = data.draw(st.sampled_from(["auto", None, "explicit", "named"]), label="parent")
        with_draft = data.draw(st.booleans(), label="with_draft")
        seed = data.draw(SEEDS, label="seed")
        namespace = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        n = self._draw_n(data)
        live = self._live()
        roots = sorted(i for i, x in live.items() if self._whole(x) and x.parent_id is None)
        again: bool = data.draw(st.booleans(), label="a live root's state again")
        if roots and again:
            # the same state as a stored root (maybe an override import of it: the pair of 46A item 5)
            same = self.model[data.draw(st.sampled_from(roots), label="root")]
            conv, n, seed, namespace = same.conv, same.n, same.fixed_seed, same.namespace
            with_draft, parent, session = any(c is not None for c in same.components), None, None
        state = self._state(conv, seed, with_draft)
        par: Any = parent
        q = w.tokens[conv][:n]
        if parent == "explicit":
            m = self.store.match(q, namespace=namespace)
            par = m if m is not None and m.n_tokens < n else None
        elif parent == "named":  # a named snapshot below it, maybe one imported under an override
            live = self._live()
            below = sorted(v.sid for (ns, _), v in self._valid_names(self.time.now()).items()
                           if ns == namespace and v.sid in live and self.model[v.sid].n < n
                           and np.array_equal(self._tokens(self.model[v.sid]), q[:self.model[v.sid].n]))
            par = self._ref(data.draw(st.sampled_from(below), label="named parent")) if below else None
            if par is not None and self.model[par.snapshot_id].foreign:
                session = None  # it inherits the override mark: kept out of sessions (see _whole)
        before = set(self._live())
        try:
            r = self.engine.save(self.store, q, state, session=session, commit=commit, parent=par,
                                 namespace=namespace)
        except LayoutError:
            assert parent in ("explicit", "named"), "only an explicit parent with other components may be refused"
            return
        if r.skipped in ("write_budget", "first_sighting"):
            assert set(self._live()) == before, f"a save skipped by write admission ({r.skipped}) changed the store"
        parent_foreign = r.parent_id is not None and r.parent_id in self.model and self.model[r.parent_id].foreign
        if r.parent_id is not None and parent in ("auto", "explicit"):
            assert not parent_foreign, "parent='auto' chose a snapshot imported under an identity override"
        self._record(r, conv, n, seed, session, commit, state, namespace, foreign=parent_foreign)
        if r.snapshot_id is not None and commit and not parent_foreign:
            # 46A item 5: a native save deduplicated onto an override import is never matched
            m = self.store.match(q, namespace=namespace)
            assert m is not None and m.n_tokens == n, \
                f"a committed native save of {n} tokens does not match its own tokens ({m})"


    @rule(data=st.data(), seed=SEEDS)
    def next_turn(self, data: st.DataObject, seed: int) -> None:
        """A session's conversation goes on: a longer prefix of it, committed in the same session
        (so supersede runs, often over a snapshot ``restore_elsewhere`` used from outside)."""
        assert self.store is not None
        w = self.workload
        live = self._live()
        going = sorted(i for i, x in live.items() if x.matchable and not x.pending and not self.model[i].foreign
                       and x.session is not None and self.model[i].n < w.max_tokens)
        if not going:
            return
        sid = data.draw(st.sampled_from(going), label="turn of")
        saved, session = self.model[sid], live[sid].session
        n = data.draw(st.integers(saved.n + 1, w.max_tokens), label="n")
        state = w.state(saved.conv, seed)
        r = self.engine.save(self.store, w.tokens[saved.conv][:n], state, session=session, commit=True,
                             parent="auto", namespace=saved.namespace)
        self._record(r, saved.conv, n, seed, session, True, state, saved.namespace)

    @rule(data=st.data(), seed=SEEDS, session=st.sampled_from([None, "s0", "s1"]),
          namespace=st.sampled_from(NAMESPACES), how=st.sampled_from(["commit", "abandon", "async", "error"]))
    def turn(self, data: st.DataObject, seed: int, session: str | None, namespace: str | None, how: str) -> None:
        """``Store.turn``: two captures a delta apart, then committed (the chain, root first), abandoned,
        captured without waiting, or left by an exception (abandoned)."""
        assert self.store is not None
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        a = data.draw(st.integers(1, w.max_tokens - 1), label="first")
        b = data.draw(st.integers(a + 1, w.max_tokens), label="second")
        state = w.state(conv, seed)
        caps: list[tuple[SaveResult, int]] = []
        try:
            with self.store.turn(session=session, namespace=namespace) as t:
                for n in (a, b):
                    if how == "async":
                        h = t.capture(w.tokens[conv][:n], state, wait=False)
                        caps.append((h.result(), n))
                    else:
                        caps.append((t.capture(w.tokens[conv][:n], state), n))
                if how == "abandon":
                    t.abandon()
                if how == "error":
                    raise _Abandon
        except _Abandon:
            pass
        live = self._live()
        for r, n in caps:
            if r.snapshot_id is not None and r.snapshot_id not in self.model and r.snapshot_id in live:
                self._record(r, conv, n, seed, session, False, state, namespace)
        if how in ("abandon", "error"):
            assert not [r for r, _ in caps if r.snapshot_id in live and live[r.snapshot_id].pending], \
                "an abandoned turn left pending captures"
        self._sync_pending()

    @rule(data=st.data(), seed=SEEDS, namespace=st.sampled_from(NAMESPACES),
          session=st.sampled_from([None, "s0"]))
    def save_without_waiting(self, data: st.DataObject, seed: int, namespace: str | None, session: str | None) -> None:
        """``save(wait=False)`` then ``flush()``: the handle's result is what a waiting save returns."""
        assert self.store is not None
        w = self.workload
        conv = data.draw(st.integers(0, w.conversations - 1), label="conv")
        n = self._draw_n(data)
        state = w.state(conv, seed)
        h = self.store.save(w.tokens[conv][:n], state, session=session, namespace=namespace, wait=False)
        assert self.store.flush(timeout=60)
        self._record(h.result(), conv, n, seed, session, True, state, namespace)

    @precondition(lambda self: any(s.pending for s in self.model.values()))
    @rule(data=st.data(), commit=st.booleans())
    def finish_pending(self, data: st.DataObject, commit: bool) -> None:
        assert self.store is not None
        live = self._live()
        pend = sorted(i for i, s in self.model.items() if s.pending and i in live)
        if not pend:
            return
        sid = data.draw(st.sampled_from(pend), label="pending")
        ns = self.model[sid].namespace
        if not commit:
            self.store.abandon(sid, namespace=ns)
            return
        if self.store.commit(sid, namespace=ns).snapshot_id is not None:
            self._sync_pending()

    # -- reads -------------------------------------------------------------------------------
