"""Cold restores with O_DIRECT reads in flight (issue 12 item 2, restore side): chunks whose pages
are not cached are read with O_DIRECT through aligned bounce pieces and checked as always; cached
ones stay on the page cache; a file system that refuses O_DIRECT gets the buffered path. Real
files and the kernel's page cache (mincore) tell which path a read took; speed is in benchmarks/."""

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
ROW = 5000  # bytes per row: 1 MiB chunks hold 209 rows = 1,045,000 bytes, not a multiple of 4096
FIXED = MIB + 1000  # one 1 MiB chunk and a 1000-byte one (below the direct-read minimum)
N = 700
LAYOUT = ss.Layout(fixed={"run": ss.Fixed("uint8", (FIXED,))}, rows={"kv": ss.Rows("uint8", (ROW,))})

_open = store_factory(identity=IDENT, layout=LAYOUT, chunk_bytes=MIB, staging_bytes=4 * MIB,
                      budget=ss.Budget(reserve_bytes=0, ram_bytes=0), check_rows=None, direct_reads=True)


@pytest.fixture
def cold_fs(tmp_path: Any) -> str:
    """A directory on a file system whose pages can be dropped and that takes O_DIRECT (not tmpfs)."""
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


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"run": rng.integers(0, 256, FIXED, dtype=np.uint8),
            "kv": rng.integers(0, 256, (N, ROW), dtype=np.uint8)}


def _chunks(store_dir: str) -> list[str]:
    return [os.path.join(root, f) for root, _, files in os.walk(os.path.join(store_dir, "blobs")) for f in files]


def _cool(store_dir: str) -> list[str]:
    files = _chunks(store_dir)
    for f in files:
        drop_cache(f)
    return files


def _big(files: list[str]) -> list[str]:
    return [f for f in files if os.path.getsize(f) > 256 * 1024]


def _bypassed(files: list[str]) -> bool:
    """Did the last restore read these files around the page cache? (the header read caches a few pages)"""
    return all(cached_pages(f) < os.path.getsize(f) // 4096 // 4 for f in _big(files))


@pytest.mark.parametrize("probe", ["cachestat", "mincore"])
def test_probe_tells_a_cold_file_from_a_just_read_one(tmp_path: Any, monkeypatch: Any, probe: str) -> None:
    """Both probes (cachestat where the kernel has it, mincore where not) read nothing and tell a
    dropped file from a just-read one, and a partly read file by its pages."""
    from snapstore.chunks import residency

    lib = residency._libc()
    if lib is None:
        pytest.skip("no libc probe on this platform")
    if probe == "cachestat" and residency.probe_kind() != "cachestat":
        pytest.skip("this kernel has no cachestat(2): mincore is the probe")
    monkeypatch.setattr(lib, "cachestat", probe == "cachestat")
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(os.urandom(4 * MIB + 123))
    drop_cache(path)
    if cached_pages(path):
        pytest.skip("this file system keeps files in memory")
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        assert not residency.resident(fd, size)
        assert not residency.resident(fd, size) and cached_pages(path) == 0  # the probe reads nothing itself
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only the pages read are cached
        os.pread(fd, MIB, 0)  # a quarter: the file is not resident, its first MiB is
        assert not residency.resident(fd, size) and residency.resident(fd, MIB)
        while os.read(fd, MIB):
            pass
        assert residency.resident(fd, size)
        assert lib.cachestat == (probe == "cachestat")  # the probe asked for answered: no silent fallback
    finally:
        os.close(fd)


def test_a_file_the_kernel_will_not_cachestat_leaves_the_probe_on_for_the_rest() -> None:
    """cachestat(2) refuses (EPERM) a file the process neither owns nor may write: that one file is
    probed by mincore, and cachestat stays on for the others (a filter refusing every call would
    turn it off). Run as another user in a forked child, so needs root."""
    from snapstore.chunks import residency

    if os.geteuid() != 0 or residency.probe_kind() != "cachestat":
        pytest.skip("needs root (to run as another user) and a kernel with cachestat(2)")
    import shutil
    import tempfile

    where = tempfile.mkdtemp(dir="/tmp")  # pytest's own tmp_path is not the other user's to enter
    theirs = os.path.join(where, "theirs")
    with open(theirs, "wb") as f:
        f.write(os.urandom(MIB))
    os.chmod(theirs, 0o444)
    os.chmod(where, 0o755)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user, which owns neither file; the parent's modules, no exec
        code = 1
        try:
            os.close(r)
            os.setuid(65534)
            fd = os.open(theirs, os.O_RDONLY)
            os.pread(fd, MIB, 0)
            answers = [residency.resident(fd, MIB), residency.probe_kind()]
            os.write(w, repr(answers).encode())
            code = 0
        except BaseException as e:
            os.write(w, repr(e).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(where)
    assert os.waitstatus_to_exitcode(status) == 0 and got == "[True, 'cachestat']", got


@pytest.mark.parametrize("dest", ["arrays", "rows_from", "paged"])
def test_cold_restore_reads_around_the_page_cache_exactly(cold_fs: str, dest: str) -> None:
    """Chunk sizes that are not multiples of 4096, a restore from a row inside a chunk, and paged
    destinations (scattered blocks): byte-exact, and the chunk files were not read into the cache."""
    state = _state(1)
    with _open(cold_fs, direct_io=False) as s:  # buffered save: the files start cached, then are dropped
        r = s.save(list(range(N)), state)
        files = _cool(cold_fs)
        assert len(_big(files)) >= 4
        run = np.zeros(FIXED, dtype=np.uint8)
        if dest == "paged":
            pool = np.zeros((50, 16, ROW), dtype=np.uint8)
            table = np.random.default_rng(2).permutation(50)[:44]
            s.restore(r, {"run": run, "kv": ss.PagedRows(pool, table)})
            back = np.zeros(44 * 16 * ROW, dtype=np.uint8)
            ss.PagedRows(pool, table).read_into(0, memoryview(back))
            assert np.array_equal(back[:N * ROW], state["kv"].reshape(-1))
        elif dest == "rows_from":
            kv = np.full((N, ROW), 7, dtype=np.uint8)
            s.restore(r, {"run": run, "kv": kv}, rows_from=300)
            assert (kv[:300] == 7).all()  # the engine's rows are not touched
            assert np.array_equal(kv[300:], state["kv"][300:])
        else:
            kv = np.zeros((N, ROW), dtype=np.uint8)
            s.restore(r, {"run": run, "kv": kv})
            assert np.array_equal(kv, state["kv"])
        assert np.array_equal(run, state["run"])
        assert _bypassed(files)


def test_cached_chunks_stay_buffered_and_a_refused_read_falls_back(cold_fs: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook refuses every O_DIRECT read: a warm restore never tries one (its chunks are cached);
    a cold one does, redoes the refused read buffered, and the store reads buffered from then on."""
    monkeypatch.setattr(_direct_io, "_TEST_REFUSE", "read")
    state = _state(2)
    with _open(cold_fs, direct_io=False) as s:
        r = s.save(list(range(N)), state)  # buffered: every chunk is in the page cache
        out = {"run": np.zeros(FIXED, dtype=np.uint8), "kv": np.zeros((N, ROW), dtype=np.uint8)}
        s.restore(r, out)
        assert s._reads.on  # no direct read was tried
        assert all(np.array_equal(out[k], state[k]) for k in state)
        _cool(cold_fs)
        out = {"run": np.zeros(FIXED, dtype=np.uint8), "kv": np.zeros((N, ROW), dtype=np.uint8)}
        s.restore(r, out)
        assert not s._reads.on
        assert all(np.array_equal(out[k], state[k]) for k in state)
        files = _cool(cold_fs)
        s.restore(r, out)
        assert not _bypassed(files)  # buffered now: the files are cached again


def test_file_system_refusing_o_direct_reads_falls_back_cleanly(cold_fs: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_direct_io, "_TEST_REFUSE", "setfl")
    state = _state(3)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
        files = _cool(cold_fs)
        out = {"run": np.zeros(FIXED, dtype=np.uint8), "kv": np.zeros((N, ROW), dtype=np.uint8)}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state)
        assert not s._reads.on and not _bypassed(files)


def test_a_flipped_payload_byte_is_caught_on_the_direct_path(cold_fs: str) -> None:
    state = _state(4)
    with _open(cold_fs) as s:
        r = s.save(list(range(N)), state)
        victim = max(_chunks(cold_fs), key=os.path.getsize)
        with open(victim, "r+b") as f:
            f.seek(600_000)
            b = f.read(1)
            f.seek(600_000)
            f.write(bytes([b[0] ^ 0x01]))
        files = _cool(cold_fs)
        out = {"run": np.zeros(FIXED, dtype=np.uint8), "kv": np.zeros((N, ROW), dtype=np.uint8)}
        with pytest.raises(ss.CorruptChunkError, match="checksum mismatch") as e:
            s.restore(r, out)
        assert e.value.touched
        # found on the O_DIRECT path, not by a buffered retry (the victim itself is read again, buffered,
        # by the quarantine that confirms its damage under the write lock)
        others = [f for f in files if f != victim]
        assert _big(others) and _bypassed(others) and s._reads.on
        with pytest.raises(ss.CorruptChunkError, match="quarantined"):
            s.restore(r, out)


def test_direct_reads_knob(cold_fs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, a store reads buffered until it has measured its storage (issue 48, tests/restore/test_read_path.py;
    these restores are too small to measure): reads that fill the page cache; on with ``direct_reads=True``
    or ``SNAPSTORE_DIRECT_READS=1``."""
    state = _state(5)
    with _open(cold_fs, direct_reads=None) as s:
        assert not s._reads.on
        r = s.save(list(range(N)), state)
        files = _cool(cold_fs)
        out = {"run": np.zeros(FIXED, dtype=np.uint8), "kv": np.zeros((N, ROW), dtype=np.uint8)}
        s.restore(r, out)
        assert all(np.array_equal(out[k], state[k]) for k in state) and not _bypassed(files)
    monkeypatch.setenv("SNAPSTORE_DIRECT_READS", "1")
    with _open(cold_fs, direct_reads=None) as s:
        assert s._reads.on
    with _open(cold_fs, direct_reads=False) as s:  # the keyword wins over the environment
        assert not s._reads.on
    with pytest.raises(ss.ConfigError):
        _open(cold_fs, direct_reads="yes")
    monkeypatch.setenv("SNAPSTORE_DIRECT_READS", "maybe")
    with pytest.raises(ss.ConfigError):
        _open(cold_fs, direct_reads=None)


def test_plans_of_many_windows_and_batches_read_direct_exactly(cold_fs: str) -> None:
    """More chunk files than one window holds open (64), and restore_many's merged plan."""
    lay = ss.Layout(rows={"kv": ss.Rows("uint8", (8192,))})
    n = 70 * 32  # 70 chunks of 256 KiB (32 rows)
    rng = np.random.default_rng(6)
    kv = rng.integers(0, 256, (n, 8192), dtype=np.uint8)
    with _open(cold_fs, layout=lay, chunk_bytes=256 * 1024, staging_bytes=MIB) as s:
        r = s.save(list(range(n)), {"kv": kv})
        kv2 = rng.integers(0, 256, (64, 8192), dtype=np.uint8)  # shares no chunk (a shared one fans out buffered)
        r2 = s.save(list(range(n, n + 64)), {"kv": kv2})
        files = _cool(cold_fs)
        assert len(_big(files)) >= 70
        out = np.zeros_like(kv)
        s.restore(r, {"kv": out})
        assert np.array_equal(out, kv) and _bypassed(files)
        files = _cool(cold_fs)
        outs = [np.zeros_like(kv), np.zeros_like(kv2)]
        s.restore_many([(r, {"kv": outs[0]}), (r2, {"kv": outs[1]})])
        assert np.array_equal(outs[0], kv) and np.array_equal(outs[1], kv2) and _bypassed(files)
