"""Integrity checks an engine can run on its own integration (needs the ``testing`` extra: hypothesis).

As ``zarr.testing`` ships its store tests, this module ships snapstore's: Hypothesis strategies for
layouts, token sequences and states, and :class:`StoreStateMachine`, a rule-based state machine
that drives an engine's save/restore callables, and every other public operation of the Store
(namespaces, names, TTLs on a moved clock, export/import with and without ``accept_identity``, write
admission, the weighed match, lost chunk files, a rebuilt engine; docs/engine.md §10), against a
reference model through chains, branches, pending captures, restarts, gc and evictions, and checks
after every step that

- every restorable snapshot restores byte-exact (fixed parts whole, the valid rows of every stream),
- ``match()`` returns the longest committed, matchable prefix the model knows of, never state
  imported under an identity override, and the override mark is on exactly such state,
- every live name finds its snapshot, and a named one matches its own tokens past the TTL,
- a snapshot with a live child never disappears (pins), budgets are never exceeded,
- supersede leaves no matchable strict prefix in a session, and never takes away a snapshot
  restored from outside its session (it is detached instead), ``verify()`` finds no damage.

Wire an engine in a few lines (docs/engine.md)::

    class MyEngine(snapstore.testing.NumpyEngine):
        def save(self, store, tokens, state, **kw):      # state: part name -> raw bytes (np.uint8)
            load_into_my_engine(state); return my_integration.save(store, tokens, **kw)
        def restore(self, store, ref, session=None):      # -> (RestoreResult, part name -> bytes)
            res = my_integration.restore(store, ref, session=session); return res, read_back_from_my_engine()

    TestMyEngine = snapstore.testing.StoreStateMachine.for_engine(MyEngine(layout)).TestCase
"""
from __future__ import annotations

from snapstore.testing.engine import NumpyEngine, Workload
from snapstore.testing.machine import StoreStateMachine
from snapstore.testing.strategies import DTYPES, layouts, states, token_sequences

__all__ = ["DTYPES", "NumpyEngine", "StoreStateMachine", "Workload", "layouts", "states", "token_sequences"]
