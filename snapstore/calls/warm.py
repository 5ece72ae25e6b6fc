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
"""

from __future__ import annotations

import time

from snapstore._layout import Layout
from snapstore._tokens import as_token_array
from snapstore.catalog.db import Database
from snapstore.catalog.queries import Txn
from snapstore.chunks.residency import probe_kind
from snapstore.lifecycle.access import Access
from snapstore.plan.chain_rows import ChainRows
from snapstore.plan.match import Prompt, best_match
from snapstore.plan.prefix import granularity

__all__ = ["warm_up"]

_NONE = -1  # a snapshot id no row has (ids count from 1)


def warm_up(db: Database, access: Access, layout: Layout) -> None:
    """Prepare what a lookup and a restore run (see the module docstring); reads only."""
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

    db.read(run)
    probe_kind()  # loads libc for the residency probes
