"""Issue 51 item 4 on the shared tier: a chain fetched into the local tier is inserted with the find
keys of the tokens the fetch holds (``insert_snapshot(find_key=...)``, as a save and an import do),
against a real SeaweedFS on loopback: the catalog decodes no stored token blob to derive them (before:
each link's blob, and its parent's last partial block read back from the chain above).
"""
# ruff: noqa: F811 - the fixtures `bucket` and `seaweed` come from s3_fixtures by import

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from remote_helpers import LAYOUT, identity, state
from s3_fixtures import bucket, seaweed  # noqa: F401 - the fixtures

import snapstore
from snapstore._tokens import BLOCK
from snapstore.catalog import queries
from snapstore.catalog.find_keys import find_keys

LENGTHS = [600, 1300, 2100]  # links that end inside a 256-token block: a key needs its parent's last block


@pytest.mark.parametrize("mode", ["fetch", "tee"])
def test_a_fetched_chain_is_keyed_from_its_tokens_without_decoding_a_stored_blob(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    tokens, kv, st = state(41, LENGTHS[-1])
    with snapstore.Store.open(tmp_path / "a", identity=identity(), layout=LAYOUT, remote=bucket,
                              chunk_bytes=65536) as a:
        for n in LENGTHS:
            a.save(tokens[:n], {"st": st + n, "kv": kv}, rows=n)
        assert a.flush().uploaded == 3
    monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", mode)
    with snapstore.Store.open(tmp_path / "b", identity=identity(), layout=LAYOUT, remote=bucket) as b:
        m = b.match(tokens)
        assert m is not None and type(m).__name__ == "RemoteMatch"
        decodes: list[int] = []
        real = queries.decode_tokens

        def counted(*a: Any, **k: Any) -> Any:
            decodes.append(1)
            return real(*a, **k)

        with monkeypatch.context() as mp:
            mp.setattr(queries, "decode_tokens", counted)
            dest = {"st": np.zeros((8, 8), np.float32), "kv": np.zeros((LENGTHS[-1], 2, 64), np.float16)}
            b.restore(m, dest)
            assert b.flush().timed_out is False  # a tee's import done
        assert np.array_equal(dest["kv"], kv) and np.array_equal(dest["st"], st + LENGTHS[-1])
        assert decodes == []  # before: the catalog decoded every inserted link's blob (and its parent's)
        rows = b._repo.db.read(lambda c: c.execute("SELECT n_tokens, find_key FROM snapshots ORDER BY n_tokens")
                               .fetchall())
        keys = find_keys(tokens)
        assert [(int(n), int(k)) for n, k in rows] == [(n, int(keys[n // BLOCK])) for n in LENGTHS]
        local = b.match(tokens)  # found locally by its find key now
        assert local is not None and type(local).__name__ == "Match" and local.n_tokens == LENGTHS[-1]
