"""A writer's optional ``views(offset, n)`` that does not cover exactly ``[offset, offset + n)``.

The restore reads chunks straight into those views and checks them there; views that cover fewer
bytes left the rest of the range unwritten while the O_DIRECT path reported success, and made the
buffered path blame (and quarantine) a good chunk. Such views are the destination's fault: a
RestoreError before a byte is read into them, the chunk left alone. Real files, real page cache.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from support import IDENT, store_factory
from support.pagecache import cached_pages, drop_cache

import snapstore as ss
from snapstore.chunks import direct_io as _direct_io

MIB = 1 << 20
ROW = 4096
N = 600  # 2.4 MB of rows: 1 MiB chunks
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (ROW,))})

_open = store_factory(identity=IDENT, layout=LAYOUT, chunk_bytes=MIB, staging_bytes=4 * MIB,
                      budget=ss.Budget(reserve_bytes=0, ram_bytes=0), check_rows=None, direct_io=False)


class ShortViews:
    """A host destination whose views leave out the last 4096 bytes of every range asked for."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.buf = bytearray(b"\x07" * nbytes)

    def write_from(self, offset: int, data: memoryview) -> None:
        self.buf[offset:offset + len(data)] = data

    def views(self, offset: int, n: int) -> list[memoryview]:
        return [memoryview(self.buf)[offset:offset + max(0, n - 4096)]]


@pytest.fixture
def cold_dir(tmp_path: Any) -> str:
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(MIB))
    drop_cache(str(probe))
    if cached_pages(str(probe)):
        pytest.skip("this file system keeps files in memory: no cold reads to test")
    try:
        os.close(os.open(probe, os.O_RDONLY | _direct_io.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    return str(tmp_path / "store")


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "buffered"])
def test_views_short_of_the_range_are_refused_and_the_chunk_is_left_alone(cold_dir: str, direct_reads: bool) -> None:
    kv = np.random.default_rng(5).integers(0, 256, (N, ROW), dtype=np.uint8)
    with _open(cold_dir, direct_reads=direct_reads) as s:
        r = s.save(list(range(N)), {"kv": kv})
        for root, _, files in os.walk(os.path.join(cold_dir, "blobs")):
            for f in files:
                drop_cache(os.path.join(root, f))  # cold: the direct path takes them
        dest = ShortViews(N * ROW)
        with pytest.raises(ss.RestoreError, match="views") as e:
            s.restore(r, {"kv": dest})
        assert not isinstance(e.value, ss.CorruptChunkError)  # the chunk is good: the destination is not
        assert s.verify().ok
        back = np.zeros((N, ROW), dtype=np.uint8)
        assert s.match(list(range(N)) + [1]) is not None  # nothing quarantined
        s.restore(r, {"kv": back})
        assert np.array_equal(back, kv)
