"""The restore/read path against files that are not chunk files and destinations that misbehave
(issue 23, items 3, 6, 7, 8, 10). Real stores, real files, real FIFOs, real threads.

- a FIFO at a chunk path is damage, never a hang: restore, the save that heals it (header read),
  the RAM tier's admission and verify all open chunk files without blocking;
- quarantine condemns only a chunk whose current bytes are damaged, whatever inode its file has;
- a chunk checked in the destination's memory that the destination itself changed is the
  destination's error (DestinationError, touched), the chunk stays;
- ``rows_from`` is honoured by a writer that lends buffers;
- writers whose ``views`` / ``buffer_for`` return numpy arrays or bytearrays are coerced, other
  objects refused as a DestinationError with ``touched`` right.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from support import IDENT, store_factory

import snapstore as ss
from snapstore.restore import ramtier as _ramtier
from snapstore.restore import read as _read

ROW = 256
BLOCK = 16  # rows per paged block: 4 KiB
N = 256  # rows saved: 64 KiB, four 16 KiB chunks
LAYOUT = ss.Layout(rows={"kv": ss.Rows("uint8", (ROW,))})
_open = store_factory(identity=IDENT, layout=LAYOUT, chunk_bytes=16 * 1024, staging_bytes=64 * 1024,
                      budget=ss.Budget(reserve_bytes=0, ram_bytes=0), check_rows=None, direct_io=False)
HANG_S = 20.0  # an operation that takes this long on a FIFO is hung


def _state(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (N, ROW), dtype=np.uint8)


def _chunk_paths(s: ss.Store, sid: int) -> list[str]:
    def run(c: Any) -> list[str]:
        return [s._repo.blob_path(ch.id) for p in c.parts(sid) for ch in c.part_chunks(sid, p.name) if ch is not None]
    paths: list[str] = s._repo.db.read(run)
    return paths


def _no_hang(fn: Callable[[], Any], fifos: list[str]) -> Any:
    """Run ``fn`` on a thread; if it is still running after HANG_S (blocked opening a FIFO), open the
    FIFOs for writing so it gets EOF and ends, then fail. Returns what it returned, raises what it raised."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(HANG_S)
    hung = th.is_alive()
    while th.is_alive():  # unblock the old code's blocking open so the test fails instead of hanging
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        th.join(0.05)
    assert not hung, f"blocked for {HANG_S:.0f} s on a FIFO at a chunk path"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _fifo_at(path: str) -> str:
    os.unlink(path)
    os.mkfifo(path, 0o600)
    return path


# -- item 3: a FIFO at a chunk path -----------------------------------------------------------

@pytest.mark.parametrize("direct_reads", [False, True], ids=["buffered", "direct"])
def test_fifo_at_a_chunk_path_is_damage_not_a_hang(tmp_path: Any, direct_reads: bool) -> None:
    kv = _state()
    with _open(tmp_path / "s", direct_reads=direct_reads) as s:
        r = s.save(list(range(N)), {"kv": kv})
        fifo = _fifo_at(_chunk_paths(s, r.snapshot_id)[1])
        dest = np.full_like(kv, 7)
        with pytest.raises(ss.CorruptChunkError, match="FIFO") as e:
            _no_hang(lambda: s.restore(r, {"kv": dest}), [fifo])
        assert e.value.touched is False and (dest == 7).all()  # found when the files are opened: nothing written
        assert s.stats().quarantined == 1 and s.match(list(range(N)) + [0]) is None
        rep = _no_hang(lambda: s.verify(deep=True), [fifo])
        assert not rep.ok
        # the save of the same state reads the header at the address (FIFO: no hang) and heals it
        _no_hang(lambda: s.save(list(range(N)), {"kv": kv}), [fifo])
        assert os.path.isfile(fifo) and s.stats().quarantined == 0
        back = np.zeros_like(kv)
        s.restore(r, {"kv": back})
        assert np.array_equal(back, kv) and s.verify(deep=True).ok


def test_header_read_of_a_fifo_is_damage_not_a_hang(tmp_path: Any) -> None:
    """The header check a save runs on a chunk file it finds at an address (dedup, settle, fetch)."""
    from snapstore.chunks.chunkfile import header_at
    fifo = str(tmp_path / "c")
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ss.CorruptionError, match="FIFO"):
        _no_hang(lambda: header_at(fifo), [fifo])


def test_fifo_at_a_chunk_path_never_blocks_the_ram_tier(tmp_path: Any) -> None:
    """The RAM tier's admission re-reads a chunk file after a restore: a FIFO put there meanwhile is
    skipped, not a thread stuck in open() that close() then waits for forever."""
    kv = _state(2)
    fifos: list[str] = []

    def swap(cid: bytes) -> None:  # on the admission thread, just before it opens the file
        if not fifos:
            fifos.append(_fifo_at(s._repo.blob_path(cid)))

    s = _open(tmp_path / "s", budget=ss.Budget(reserve_bytes=0, ram_bytes=1 << 20))
    try:
        r = s.save(list(range(N)), {"kv": kv})
        s.restore(r, {"kv": np.zeros_like(kv)})
        _ramtier._TEST_HOOK = swap
        s.restore(r, {"kv": np.zeros_like(kv)})  # the second sighting: offered for admission
        assert s._ram is not None
        drained = s._ram.drain(HANG_S)
        if not drained:
            _no_hang(lambda: None, fifos)  # unblock it before failing
        assert drained, "the RAM tier's admission thread is stuck opening a FIFO"
        assert fifos and s._ram.used < 4 * 16 * 1024  # the FIFO's chunk was not admitted
    finally:
        _ramtier._TEST_HOOK = None
        _no_hang(s.close, fifos)


# -- item 6: quarantine re-checks the bytes, not the inode ---------------------------------------

def _with_before_quarantine(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> None:
    """Run ``act`` after a failed restore found its damage and before its quarantine transaction (the
    window in which another thread or process deletes, saves or heals)."""
    real = _read.quarantine

    def late(db: Any, blob_path: Any, damage: Any) -> int:
        act()
        return real(db, blob_path, damage)
    monkeypatch.setattr(_read, "quarantine", late)


def test_resaved_chunk_on_the_damaged_files_inode_is_not_quarantined(tmp_path: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The damaged snapshot is deleted and saved again before the quarantine runs; ext4 gives the new
    chunk file the freed inode number. The healthy new chunk must stay matchable."""
    kv = _state(3)
    toks = list(range(N))
    with _open(tmp_path / "s", chunk_bytes=N * ROW) as s:  # one chunk file: one inode freed, one taken
        r = s.save(toks, {"kv": kv})
        path = _chunk_paths(s, r.snapshot_id)[0]
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 1
        with open(path, "wb") as f:
            f.write(data)
        inodes: list[int] = [os.stat(path).st_ino]
        saved: list[Any] = []

        def resave() -> None:
            s.delete(r)
            saved.append(s.save(toks, {"kv": kv}))
            inodes.append(os.stat(path).st_ino)
        _with_before_quarantine(monkeypatch, resave)
        with pytest.raises(ss.CorruptChunkError):
            s.restore(r, {"kv": np.zeros_like(kv)})
        assert s.stats().quarantined == 0, f"healthy re-saved chunk quarantined (inodes {inodes})"
        m = s.match(toks + [0])
        assert m is not None and m.snapshot_id == saved[0].snapshot_id
        back = np.zeros_like(kv)
        s.restore(m, {"kv": back})
        assert np.array_equal(back, kv)


def test_a_chunk_intact_again_in_the_same_inode_is_not_quarantined(tmp_path: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Same (st_dev, st_ino), bytes right again when the quarantine runs: nothing to condemn; damaged
    bytes in that same inode are condemned."""
    kv = _state(4)
    with _open(tmp_path / "s") as s:
        r = s.save(list(range(N)), {"kv": kv})
        path = _chunk_paths(s, r.snapshot_id)[2]
        good = open(path, "rb").read()
        bad = bytearray(good)
        bad[100] ^= 1
        with open(path, "r+b") as f:
            f.write(bad)

        def fix() -> None:
            with open(path, "r+b") as f:  # the same inode
                f.write(good)
        _with_before_quarantine(monkeypatch, fix)
        with pytest.raises(ss.CorruptChunkError):
            s.restore(r, {"kv": np.zeros_like(kv)})
        assert s.stats().quarantined == 0
        monkeypatch.undo()
        with open(path, "r+b") as f:
            f.write(bad)
        with pytest.raises(ss.CorruptChunkError):
            s.restore(r, {"kv": np.zeros_like(kv)})
        assert s.stats().quarantined == 1


# -- item 7: the destination changed the bytes it was read into ----------------------------------

def test_a_block_table_naming_one_block_twice_is_the_destinations_error(tmp_path: Any) -> None:
    kv = _state(5)
    with _open(tmp_path / "s") as s:
        r = s.save(list(range(N)), {"kv": kv})
        pool = np.zeros((64, BLOCK, ROW), dtype=np.uint8)
        table = [0, 1, 2, 1] + list(range(4, N // BLOCK))  # block 1 twice, inside the first chunk
        with pytest.raises(ss.DestinationError, match="destination changed") as e:
            s.restore(r, {"kv": ss.PagedRows(pool, table)})
        assert e.value.touched is True
        assert s.stats().quarantined == 0 and s.match(list(range(N)) + [0]) is not None
        good = ss.PagedRows(pool, list(range(N // BLOCK)))
        s.restore(r, {"kv": good})
        assert np.array_equal(pool[:N // BLOCK].reshape(N, ROW), kv)


def test_an_engine_thread_writing_the_destination_mid_restore_is_the_destinations_error(tmp_path: Any) -> None:
    """Chunks read in place into a numpy arena that an engine thread keeps writing: any mismatch is the
    destination's (DestinationError, touched), never a quarantined chunk."""
    rows = 16384  # 4 MiB in 1 MiB chunks, read in place
    kv = np.random.default_rng(6).integers(0, 256, (rows, ROW), dtype=np.uint8)
    with _open(tmp_path / "s", chunk_bytes=1 << 20, staging_bytes=2 << 20) as s:
        r = s.save(list(range(rows)), {"kv": kv})
        arena = np.zeros_like(kv)
        stop = threading.Event()

        def scribble() -> None:
            while not stop.is_set():
                arena[::7] = 3  # the engine's thread, writing the arena the restore reads into

        th = threading.Thread(target=scribble, daemon=True)
        th.start()
        raised: list[ss.RestoreError] = []
        try:
            for _ in range(20):
                try:
                    s.restore(r, {"kv": arena})
                except ss.RestoreError as e:
                    raised.append(e)
                    if len(raised) >= 3:
                        break
        finally:
            stop.set()
            th.join()
        if not raised:
            pytest.skip("the engine thread never wrote during a restore's check on this machine")
        assert all(isinstance(e, ss.DestinationError) and e.touched for e in raised), raised
        assert s.stats().quarantined == 0
        back = np.zeros_like(kv)
        s.restore(r, {"kv": back})
        assert np.array_equal(back, kv)


# -- item 8: rows_from with a writer that lends buffers ------------------------------------------

class _Lending:
    """A host destination that lends a private buffer per chunk and copies it in on commit (as the torch
    adapter's staging halves do), recording every byte range it writes."""

    def __init__(self, nbytes: int, fill: int):
        self.nbytes = nbytes
        self.buf = bytearray([fill]) * nbytes
        self.lent: dict[int, bytearray] = {}
        self.wrote: list[tuple[int, int]] = []

    def write_from(self, offset: int, data: memoryview) -> None:
        self.buf[offset:offset + len(data)] = data
        self.wrote.append((offset, offset + len(data)))

    def buffer_for(self, offset: int, n: int) -> memoryview:
        self.lent[offset] = bytearray(n)
        return memoryview(self.lent[offset])

    def commit(self, offset: int, n: int) -> None:
        self.buf[offset:offset + n] = self.lent.pop(offset)
        self.wrote.append((offset, offset + n))

    def discard(self, offset: int, n: int) -> None:
        self.lent.pop(offset, None)


@pytest.mark.parametrize("rows_from", [97, 64, 1, 0])
def test_rows_from_leaves_the_engines_rows_alone_with_a_lending_writer(tmp_path: Any, rows_from: int) -> None:
    kv = _state(7)
    with _open(tmp_path / "s") as s:  # 16 KiB chunks: 64 rows each; rows_from=97 falls inside chunk 1
        r = s.save(list(range(N)), {"kv": kv})
        dest = _Lending(N * ROW, 0xEE)
        s.restore(r, {"kv": dest}, rows_from=rows_from)
        got = np.frombuffer(bytes(dest.buf), dtype=np.uint8).reshape(N, ROW)
        assert (got[:rows_from] == 0xEE).all(), "rows below rows_from (the engine's) were overwritten"
        assert np.array_equal(got[rows_from:], kv[rows_from:])
        assert min(a for a, _ in dest.wrote) == rows_from * ROW
        assert not dest.lent  # every lent buffer was committed or discarded


# -- item 10: what views() / buffer_for() return -------------------------------------------------

class _Returns:
    """A writer whose views() or buffer_for() returns what ``make`` makes of host memory."""

    def __init__(self, nbytes: int, make: Callable[[memoryview], Any]):
        self.nbytes = nbytes
        self.buf = bytearray(b"\x07") * nbytes
        self.make = make
        self.discarded = 0
        self.lent: dict[int, Any] = {}

    def write_from(self, offset: int, data: memoryview) -> None:
        self.buf[offset:offset + len(data)] = data


class _ReturnsViews(_Returns):
    def views(self, offset: int, n: int) -> Any:
        return self.make(memoryview(self.buf)[offset:offset + n])


class _ReturnsLent(_Returns):
    def buffer_for(self, offset: int, n: int) -> Any:
        self.lent[offset] = self.make(memoryview(bytearray(n)))
        return self.lent[offset]

    def commit(self, offset: int, n: int) -> None:
        self.buf[offset:offset + n] = np.asarray(self.lent.pop(offset)).reshape(-1).view(np.uint8).tobytes()

    def discard(self, offset: int, n: int) -> None:
        self.lent.pop(offset, None)
        self.discarded += 1


WRITERS: dict[str, type[_Returns]] = {"views": _ReturnsViews, "buffer_for": _ReturnsLent}


COERCED: dict[str, Callable[[memoryview], Any]] = {
    "numpy": lambda mv: [np.frombuffer(mv, dtype=np.uint8)],
    "numpy-2d": lambda mv: [np.frombuffer(mv, dtype=np.uint8).reshape(-1, ROW)],
    "bytearray-list": lambda mv: [mv],
    # a dtype numpy exports no buffer format for (memoryview() raised a bare ValueError): the stand-in
    # for ml_dtypes' bfloat16, which JAX-style engines hand out ("cannot include dtype 'E' in a buffer")
    "numpy-no-buffer-format": lambda mv: [np.frombuffer(mv, dtype="datetime64[s]")],
}
LENT: dict[str, Callable[[memoryview], Any]] = {
    "numpy": lambda mv: np.frombuffer(mv, dtype=np.uint8),
    "bytearray": lambda mv: mv.obj,
    "numpy-no-buffer-format": lambda mv: np.frombuffer(mv, dtype="datetime64[s]"),
}


@pytest.mark.parametrize("kind", sorted(COERCED))
def test_views_of_numpy_arrays_are_coerced(tmp_path: Any, kind: str) -> None:
    kv = _state(8)
    with _open(tmp_path / "s") as s:
        r = s.save(list(range(N)), {"kv": kv})
        dest = _ReturnsViews(N * ROW, COERCED[kind])
        s.restore(r, {"kv": dest})
        assert bytes(dest.buf) == kv.tobytes()


@pytest.mark.parametrize("kind", sorted(LENT))
def test_lent_numpy_or_bytearray_buffers_are_coerced(tmp_path: Any, kind: str) -> None:
    kv = _state(9)
    with _open(tmp_path / "s") as s:
        r = s.save(list(range(N)), {"kv": kv})
        dest = _ReturnsLent(N * ROW, LENT[kind])
        s.restore(r, {"kv": dest})
        assert bytes(dest.buf) == kv.tobytes() and not dest.lent


REFUSED: dict[str, tuple[str, Callable[[memoryview], Any]]] = {
    "views-int": ("views", lambda mv: 7),
    "views-of-ints": ("views", lambda mv: [1, 2]),
    "views-strided": ("views", lambda mv: [np.frombuffer(mv, dtype=np.uint8)[::2]]),
    "views-read-only": ("views", lambda mv: [np.frombuffer(bytes(mv), dtype=np.uint8)]),
    "buffer-str": ("buffer_for", lambda mv: "not memory"),
    "buffer-read-only": ("buffer_for", lambda mv: bytes(mv)),
    # Python object pointers, not bytes: writing chunk bytes there crashed the interpreter later
    "views-objects": ("views", lambda mv: [np.zeros(len(mv) // 8, dtype=object)]),
    "buffer-objects": ("buffer_for", lambda mv: np.zeros(len(mv) // 8, dtype=object)),
}


@pytest.fixture
def restore_of_two_writers(tmp_path: Any) -> Iterator[Callable[[Any], tuple[ss.RestoreError, np.ndarray, Any]]]:
    """Restore a saved state into a plain array (part 'a', written first) and the writer under test
    (part 'b'); returns the error, the array and the writer."""
    layout = ss.Layout(rows={"a": ss.Rows("uint8", (ROW,)), "b": ss.Rows("uint8", (ROW,))})
    s = _open(tmp_path / "s", layout=layout)
    kv = _state(10)
    r = s.save(list(range(N)), {"a": kv, "b": kv})

    def run(writer: Any) -> tuple[ss.RestoreError, np.ndarray, Any]:
        first = np.full_like(kv, 7)
        with pytest.raises(ss.RestoreError) as e:
            s.restore(r, {"a": first, "b": writer})
        return e.value, first, writer
    yield run
    s.close()


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_writer_memory_that_is_not_a_writable_buffer_is_a_destination_error(
        tmp_path: Any, kind: str, restore_of_two_writers: Callable[[Any], tuple[ss.RestoreError, np.ndarray, Any]],
) -> None:
    hook, make = REFUSED[kind]
    err, first, writer = restore_of_two_writers(WRITERS[hook](N * ROW, make))
    assert isinstance(err, ss.DestinationError), repr(err)
    assert hook.split("_")[0] in str(err)
    assert err.touched == bool((first != 7).any())  # touched exactly when part 'a' had been written
    if hook == "buffer_for":
        assert writer.discarded == 1 and not writer.lent  # the refused lent buffer was handed back


def test_a_refusal_before_anything_was_written_says_untouched(tmp_path: Any) -> None:
    kv = _state(11)
    with _open(tmp_path / "s") as s:
        r = s.save(list(range(N)), {"kv": kv})
        dest = _ReturnsViews(N * ROW, lambda mv: 7)
        with pytest.raises(ss.DestinationError) as e:
            s.restore(r, {"kv": dest})
        assert e.value.touched is False and bytes(dest.buf) == b"\x07" * (N * ROW)
        assert s.stats().quarantined == 0
