"""Issue 51 item 4, the save side: a save flows one way down.

- it encodes its token segment once and hands the catalog the find key it computed from the
  tokens it holds: no stored token blob is decoded, and the key is the prompt's at its block;
- its metadata transaction is a block opened and committed in one place (``Database.writing``,
  under ``lifecycle.bookkeeping.writing``): a block that raises rolls back, the files published
  for it are unlinked and the store's bookkeeping is given back; BEGIN waits out another writer.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import apsw
import numpy as np
import pytest
from support import LAYOUT, make_state, open_store, save_chain

import snapstore as ss
from snapstore._tokens import BLOCK
from snapstore.catalog import db as _db
from snapstore.catalog import queries
from snapstore.catalog.find_keys import find_keys
from snapstore.lifecycle.bookkeeping import writing
from snapstore.plan.match import tokens_of
from snapstore.save import stages


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of ``module.name`` (the real function still runs)."""
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_save_encodes_its_tokens_once_and_decodes_none(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unaligned boundaries, an explicit parent, a branch and int64 segments: no stored token blob
    is decoded by any save (before: the catalog decoded the new blob and read the parent's last
    partial block from the chain), and every stored find key is the prompt's at its block."""
    rng = np.random.default_rng(4)
    a = rng.integers(0, 50_000, 1300)
    wide = np.concatenate([a[:300], rng.integers(2**31, 2**40, 500)])
    with open_store(store_dir) as s:
        decodes = _counting(monkeypatch, queries, "decode_tokens")
        encodes = _counting(monkeypatch, stages, "encode_tokens")
        saves = 0
        for toks, cuts in [(a, [100, 256, 300, 777, 1300]), (wide, [600, 800])]:
            save_chain(s, toks, cuts)
            saves += len(cuts)
        leaf = s.match(a[:777])
        assert leaf is not None
        st = {k: (v if k == "rec.state" else v[:1000]) for k, v in make_state(LAYOUT, len(a), 3).items()}
        r = s.save(np.concatenate([a[:777], rng.integers(0, 50_000, 223)]), st, parent=leaf.snapshot_id)
        assert r.ok and r.parent_id == leaf.snapshot_id
        saves += 1
        assert decodes == [] and len(encodes) == saves
        monkeypatch.undo()
        rows = s._repo.db.read(lambda c: c.execute("SELECT id, n_tokens, find_key FROM snapshots").fetchall())
        assert len(rows) == saves
        for sid, n, key in rows:
            full = s._repo.db.read(lambda c, sid=sid: tokens_of(c.chain(sid)))
            assert len(full) == n and key == int(find_keys(full)[n // BLOCK]), sid


def test_the_save_transaction_block_rolls_back_what_it_raised(store: ss.Store) -> None:
    """A block that raises: its rows roll back, the chunk files published for it are unlinked,
    and the bookkeeping it took is given back (the next write persists it)."""
    toks = np.arange(1, 65, dtype=np.int64)
    first = store.save(toks, make_state(LAYOUT, 64, 1))
    assert first.ok
    store._ledger.count("flow_probe", 3)
    blob = bytes(range(32))
    path = store._repo.blob_path(blob)
    with open(path, "wb") as f:
        f.write(b"x")
    with pytest.raises(LookupError):
        with writing(store._repo, store._ledger, discard=[blob]) as t:
            t.add_counter("flow_probe", 100)
            raise LookupError("the block failed")
    assert not os.path.exists(path)  # unreferenced: unlinked with the rollback
    with writing(store._repo, store._ledger):
        pass  # the next write persists the bookkeeping given back
    assert store._repo.db.read(lambda t: t.counters()).get("flow_probe") == 3  # once, not the rolled-back 100


def test_the_save_transaction_waits_out_another_writer(store_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BEGIN IMMEDIATE retried while another process holds the write lock longer than one busy
    timeout; the save commits once it is free."""
    monkeypatch.setattr(_db, "_BUSY_TIMEOUT_MS", 20)
    with open_store(store_dir) as s:
        other = apsw.Connection(s._repo.db_path)
        other.set_busy_timeout(5000)
        hooked = threading.Event()

        def hold() -> None:  # the chunk files are durable: another writer takes the lock before the save's BEGIN
            other.execute("BEGIN IMMEDIATE")
            hooked.set()
            threading.Timer(0.3, lambda: other.execute("ROLLBACK")).start()

        real = _db.Database.writing
        monkeypatch.setattr(_db.Database, "writing", lambda self: (hold(), real(self))[1])
        r = s.save(np.arange(3, 40, dtype=np.int64), make_state(LAYOUT, 37, 2))
        assert hooked.is_set() and r.ok and s.match(np.arange(3, 40)).snapshot_id == r.snapshot_id  # type: ignore[union-attr]
        other.close()
