"""A shared-tier chain keeps its row granularity (``tokens_per_row``, schema v7) against a real
SeaweedFS on loopback: a node whose layout differs only in tokens_per_row is refused the chain
(fetched or streamed) before a byte reaches its destination; a node of the same granularity fetches
it and its local parts record the granularity the manifest carried."""
# ruff: noqa: F811 - the fixtures `bucket` and `seaweed` come from s3_fixtures by import

from __future__ import annotations

from pathlib import Path

import apsw
import numpy as np
import pytest
from remote_helpers import identity
from s3_fixtures import bucket, seaweed  # noqa: F401 - the fixtures

import snapstore

pytestmark = pytest.mark.slow  # starts a SeaweedFS cluster

N = 640  # tokens: 40 rows of 16, 80 rows of 8


def _layout(g: int) -> snapstore.Layout:
    return snapstore.Layout(rows={"kv": snapstore.Rows("float16", (2, 64))}, tokens_per_row=g)


def test_a_published_chain_keeps_its_granularity(bucket: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 50_000, N, dtype=np.int64)
    kv = rng.standard_normal((N // 16, 2, 64)).astype(np.float16)
    with snapstore.Store.open(tmp_path / "a", identity=identity(), layout=_layout(16), remote=bucket) as a:
        assert a.save(tokens, {"kv": kv}).ok
        assert a.flush().uploaded == 1
    for mode in ("fetch", "stream"):
        monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", mode)
        with snapstore.Store.open(tmp_path / f"b-{mode}", identity=identity(), layout=_layout(8),
                                  remote=bucket) as b:
            m = b.match(tokens)
            assert m is not None and m.n_tokens == N
            dest = {"kv": np.full((N // 8, 2, 64), 5.0, np.float16)}
            with pytest.raises(snapstore.DestinationError, match="tokens per row"):
                b.restore(m, dest)
            assert (dest["kv"] == 5.0).all(), mode
    monkeypatch.setenv("SNAPSTORE_REMOTE_RESTORE", "fetch")
    with snapstore.Store.open(tmp_path / "c", identity=identity(), layout=_layout(16), remote=bucket) as c:
        m = c.match(tokens)
        assert m is not None
        dest = {"kv": np.zeros_like(kv)}
        assert c.restore(m, dest).rows == {"kv": N // 16}
        assert dest["kv"].tobytes() == kv.tobytes()
    db = apsw.Connection(str(tmp_path / "c" / "snapstore.db"))
    assert db.execute("SELECT DISTINCT tokens_per_row FROM parts").fetchall() == [(16,)]
    db.close()
