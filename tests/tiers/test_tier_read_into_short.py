"""The Tier interface's ``read_into`` answers one way in every tier (review of 04d2aeb): a buffer too
small for the chunk is a False from the RAM tier as from the chunk files — not a ValueError (not a
SnapstoreError) from one implementation only — and the RAM tier leaves that buffer as it was and
counts no hit. Real store directory, real SQLite, real files."""

from __future__ import annotations

import numpy as np
from support import store_factory

import snapstore as ss

MIB = 1 << 20
LAYOUT = ss.Layout(fixed={"run": ss.Fixed("uint8", (MIB,))}, rows={"kv": ss.Rows("uint8", (16 * 1024,))})
_open = store_factory(layout=LAYOUT, chunk_bytes=MIB, staging_bytes=4 * MIB, check_rows=None,
                      budget=ss.Budget(reserve_bytes=0, ram_bytes=64 * MIB))


def test_a_buffer_too_small_for_the_chunk_is_false_in_every_tier(store_dir: str) -> None:
    rng = np.random.default_rng(3)
    state = {"run": rng.integers(0, 256, MIB, dtype=np.uint8),
             "kv": rng.integers(0, 256, (64, 16 * 1024), dtype=np.uint8)}
    with _open(store_dir) as s:
        ram, files = s._tiers.ram, s._tiers.files
        assert ram is not None
        r = s.save(list(range(64)), state)
        for _ in range(2):  # the second restore admits the chunks into the RAM tier
            s.restore(r, {k: np.zeros_like(v) for k, v in state.items()})
        assert ram.drain(30)
        rows = s._repo.db.read(lambda c: list(c.all_chunks()))
        assert rows and all(ram.has(c.id) for c in rows)
        ram.take_hits()
        for c in rows:
            short = np.full(c.raw_len - 1, 9, np.uint8)
            assert files.read_into(c, short.data) is False
            short[...] = 9
            assert ram.read_into(c, short.data) is False
            assert (short == 9).all()  # nothing copied into a buffer that cannot hold the chunk
        assert ram.take_hits() == 0  # a refused read is no hit
        whole = np.empty(rows[0].raw_len, np.uint8)
        assert ram.read_into(rows[0], whole.data) and ram.take_hits() == 1  # a buffer that fits still reads
