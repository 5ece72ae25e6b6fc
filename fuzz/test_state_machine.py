"""The store against a reference model, through ``snapstore.testing.StoreStateMachine``.

The public machine checks exact restores, longest-prefix match, pins, budgets, supersede and
verify after every step; here it also checks the accounting against the catalog and the chunk
files on disk (internals an engine's own run cannot see). Two layouts: raw bytes with a draft
component (raw/zstd codecs), and typed parts (float16/bfloat16/float32) with the shuffle codec.
Step counts come from the Hypothesis profile (tests/README.md); the dev profile runs fewer.
"""

from __future__ import annotations

import os
import sys

from hypothesis.stateful import invariant

import snapstore as ss
from snapstore.testing import NumpyEngine, StoreStateMachine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from support.profile import lighter_in_dev  # noqa: E402

RAW = ss.Layout(fixed={"rec": ss.Fixed("uint8", (200,))},
                rows={"kv": ss.Rows("uint8", (96,)), "d": ss.Rows("uint8", (8,), component="draft")})
TYPED = ss.Layout(fixed={"gdn": ss.Fixed("float32", (5, 7)), "pos": ss.Fixed("int64", (1,))},
                  rows={"attn": ss.Rows("bfloat16", (2, 3, 8)), "mtp": ss.Rows("float16", (2, 4), component="draft")})


class AccountedMachine(StoreStateMachine):
    """Adds: stored bytes == the catalog's chunk rows == the files on disk == the persisted counter."""

    @invariant()
    def accounting_exact(self) -> None:
        if self.store is None:
            return
        repo = self.store._repo
        stats = self.store.stats()
        rows = repo.db.read(lambda c: [(bytes(r[0]), r[1], r[2]) for r in c.execute(
            "SELECT id, stored_len, refs FROM chunks")])
        assert sum(r[1] for r in rows) == stats.stored_bytes
        assert repo.db.read(lambda c: c.execute("SELECT value FROM counters WHERE name='stored_bytes'"
                                                ).fetchone() or (0,))[0] == stats.stored_bytes
        for cid, size, refs in rows:
            assert refs > 0
            path = repo.blob_path(cid)
            assert os.path.exists(path), f"chunk file {path} of a chunk row is missing"
            assert os.path.getsize(path) == size
        infos = self.store.snapshots()
        # an import under an override is counted (it takes budget) though match() never serves it
        assert stats.logical_bytes == sum(x.logical_bytes for x in infos if x.matchable or x.imported_from)


# the dev profile (make test) runs 3 x 15 steps of each, not its 5 x 20; ci and long run their own counts
TestRawLayout = lighter_in_dev(AccountedMachine.for_engine(NumpyEngine(RAW), codecs=("raw", "zstd")).TestCase, 3, 15)
TestTypedLayout = lighter_in_dev(
    AccountedMachine.for_engine(NumpyEngine(TYPED), codecs=("zstd-shuffle2", "raw")).TestCase, 3, 15)
