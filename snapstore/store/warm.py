"""``Store.warm_up``: a serving process's first-request costs, paid when it starts (issue 31).

In a fresh process the first lookup and restore cost two to three times the later ones (3.0 ms
and 2.8 ms against 1.0 and 1.9, a 12-link chain of 3,000 tokens, page cache): SQLite prepares
each statement at its first use on a connection (apsw then keeps it in the connection's cache),
the residency probe loads libc, numpy's first reductions set themselves up. An engine that serves
its first request right after opening the store pays that on the request. ``warm_up`` runs each
of them once on the calling thread's connection, against a prompt and ids that match nothing:
it reads only, and counts and records nothing a later call sees (no hit, no miss, no last use).
One statement stays for the first request that needs it: the block-prefix holders read, whose text
has one parameter per prefix length it asks about.

It also plans the identity's most recently used snapshots (:data:`PLANNED`) into the process's
memo of plan reads (catalog/chain_cache.py): after a restart the hot ones — the system prompts a
server sees on every request — are planned from memory from the first request on, a third of a
small lookup's cost. Planning reads only; a snapshot that would not restore is passed over (its
own restore says why).
"""

from __future__ import annotations

import time

from snapstore._errors import SnapstoreError
from snapstore._layout import Layout
from snapstore._tokens import as_token_array
from snapstore.catalog.chain_cache import ChainCache
from snapstore.catalog.db import Database
from snapstore.catalog.queries import Txn
from snapstore.chunks.residency import probe_kind
from snapstore.lifecycle.access import Access
from snapstore.plan.chain_rows import ChainRows
from snapstore.plan.match import Prompt, best_match
from snapstore.plan.prefix import granularity
from snapstore.restore.read import plan_of

__all__ = ["PLANNED", "warm_up"]

_NONE = -1  # a snapshot id no row has (ids count from 1)
PLANNED = 64  # snapshots planned into the memo: the most recently used (about 0.3 ms each)


def warm_up(db: Database, access: Access, layout: Layout, memo: ChainCache | None = None) -> None:
    """Prepare what a lookup and a restore run, and plan the most recently used snapshots into
    ``memo`` (see the module docstring); reads only."""
    prompt = Prompt(as_token_array([0, 1] * granularity(layout)))
    never = time.time() + 10 * 365 * 86400.0  # "last used after then": no candidate qualifies

    def run(c: Txn) -> None:
        best_match(c, layout, access.identity_key, "", prompt, set(), never)  # the match's statements
        c.snapshot(_NONE)
        c.parts(_NONE)  # plan.fit's, for a snapshot whose layout key it has not seen
        c.snapshot_and_key(_NONE)  # the plan's: the snapshot and its key, the chain, its parts and chunks
        c.chain(_NONE)
        ChainRows(c, [_NONE])
        if not db.readonly:
            c.catalog_gen()  # the kept plan reads' check (catalog/chain_cache.py)
        c.quarantined_users()
        c.chain_spells(_NONE, 8, memoryview(bytes(8)), 0)
        if memo is not None and memo.enabled:
            wanted = set(layout.components)
            for sid, ns in c.recently_used(access.identity_key, PLANNED):
                try:
                    plan_of(c, access, layout, sid, ns, None, wanted, memo=memo)
                except SnapstoreError:
                    continue

    db.read(run)
    probe_kind()  # loads libc for the residency probes
