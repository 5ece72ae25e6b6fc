"""Data-path hardening (issue 9, items 2, 3, 4, 8 and part of 11), each forced through real threads.

* a buffer mutated during a save spoils only that save (address, checksum and bytes: one read);
* dedup covers dtype and shape: a layout differing only there never lands on an unrestorable snapshot;
* writers of different codecs on one directory never replace a file a committed row describes;
* a restore that finds damage quarantines the chunk; the next save of the right bytes heals it;
* a retried save leaves no uncounted orphans; many small chunks need few descriptors and leave
  RLIMIT_NOFILE alone; zstd save/restore stay within the staging buffer plus a constant.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from support import LAYOUT, make_state, store_factory
from support.catalogs import UNDO_FIND_KEYS

import snapstore as ss
from snapstore.catalog.db import migrations_dir
from snapstore.check.verify import verify as repo_verify
from snapstore.chunks.chunkfile import checksum, chunk_id, copy_addressed
from snapstore.chunks.repo import Repo
from snapstore.save import chunker as _chunker

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's root
HERE_DIR = os.path.dirname(os.path.abspath(__file__))  # this module's folder: a child process imports it by name
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helper modules live there

open_store = store_factory(budget=ss.Budget(reserve_bytes=0, ram_bytes=0))  # no RAM tier: every read hits disk


def disk_bytes(store: ss.Store) -> int:
    """Bytes of every chunk file under blobs/."""
    return sum(os.stat(p).st_size for _, p in store._repo.blob_files())


def restore_exact(store: ss.Store, ref: Any, state: dict[str, np.ndarray]) -> None:
    into = {k: np.full_like(v, 0x5A) for k, v in state.items()}
    store.restore(ref, into)
    for k, v in state.items():
        assert into[k].tobytes() == v.tobytes(), f"part {k} differs"


def chunk_ids(store: ss.Store, sid: int) -> list[bytes]:
    def run(c: Any) -> list[bytes]:
        return [ch.id for p in c.parts(sid) for ch in c.part_chunks(sid, p.name)
                if ch is not None]
    return store._repo.db.read(run)


@pytest.fixture
def hook() -> Iterator[Callable[[Callable[[str, Any, bytes], None]], None]]:
    """Install a _chunker._TEST_HOOK for one test."""
    def install(fn: Callable[[str, Any, bytes], None]) -> None:
        _chunker._TEST_HOOK = fn
    yield install
    _chunker._TEST_HOOK = None


# -- item 2: one read of the source --------------------------------------------------------------

BIG = 64 << 20
BIG_LAYOUT = ss.Layout(fixed={"big": ss.Fixed("uint8", (BIG,))})


def test_buffer_mutated_during_save_spoils_only_its_own_snapshot(store_dir: str) -> None:
    """A real thread flips bytes while a 64 MiB zero-copy save runs; later well-behaved saves of
    either version of those bytes deduplicate onto nothing wrong and restore exact."""
    x = np.random.default_rng(1).integers(0, 256, BIG, dtype=np.uint8)
    y = x.copy()
    y[4095::4096] ^= 1  # the other version: one byte of every page differs
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # let the flipper in between the stages of the old, three-read save
    try:
        with open_store(store_dir, layout=BIG_LAYOUT, chunk_bytes=1 << 20, staging_bytes=4 << 20) as s:
            buf = x.copy()
            for k in range(3):
                stop = threading.Event()

                def flipper() -> None:
                    v = buf[4095::4096]
                    while not stop.is_set():
                        v ^= 1

                t = threading.Thread(target=flipper)
                t.start()
                try:
                    assert s.save([100 + k], {"big": buf}, parent=None).ok
                finally:
                    stop.set()
                    t.join()
            for toks, want in (([1, 2], x), ([3, 4], y)):
                assert s.save(toks, {"big": want.copy()}, parent=None).ok
            for toks, want in (([1, 2], x), ([3, 4], y)):
                m = s.match(toks)
                assert m is not None
                restore_exact(s, m, {"big": want})
            assert s.verify(deep=True).ok
    finally:
        sys.setswitchinterval(old)


@settings(max_examples=40)
@given(n=hst.integers(0, 3 << 20), seed=hst.integers(0, 2**32 - 1), key=hst.binary(min_size=32, max_size=32))
def test_one_pass_copy_gives_the_same_address_checksum_and_bytes(n: int, seed: int, key: bytes) -> None:
    """The save's fused copy + hashes (pieces of 256 KiB, any tail) equals a copy and the two
    whole-buffer hashes: chunk ids and checksums stay what every stored chunk already carries."""
    src = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    out = np.full(n, 0xA5, dtype=np.uint8)
    got = copy_addressed(memoryview(src), memoryview(out), key)
    assert got == (chunk_id(src, key), checksum(src))
    assert np.array_equal(out, src)


# -- item 3: dedup covers dtype and shape -------------------------------------------------------

@pytest.mark.parametrize("change", ["fixed-dtype", "fixed-shape", "row-dtype", "row-shape"])
def test_layout_differing_only_in_dtype_or_shape_never_dedups(store_dir: str, change: str) -> None:
    toks = list(range(50))
    state = make_state(LAYOUT, 50, 3)
    with open_store(store_dir) as a:
        ra = a.save(toks, state)
        assert ra.ok
        ids_a = set(chunk_ids(a, ra.snapshot_id))
    fixed = dict(LAYOUT.fixed)
    rows = dict(LAYOUT.rows)
    other = dict(state)
    if change == "fixed-dtype":
        fixed["rec.state"] = ss.Fixed("int32", (3, 5))
        other["rec.state"] = state["rec.state"].view(np.int32)
    elif change == "fixed-shape":
        fixed["rec.state"] = ss.Fixed("float32", (5, 3))
        other["rec.state"] = state["rec.state"].reshape(5, 3)
    elif change == "row-dtype":
        rows["attn.kv"] = ss.Rows("int16", (2, 4, 8))
        other["attn.kv"] = state["attn.kv"].view(np.int16)
    else:
        rows["attn.kv"] = ss.Rows("float16", (4, 2, 8))
        other["attn.kv"] = state["attn.kv"].reshape(50, 4, 2, 8)
    layout2 = ss.Layout(fixed=fixed, rows=rows)
    with open_store(store_dir, layout=layout2) as b:
        rb = b.save(toks, other)
        assert rb.ok and rb.snapshot_id != ra.snapshot_id and rb.stored_bytes > 0
        changed = "rec.state" if change.startswith("fixed") else "attn.kv"
        ids_b = {ch for ch in chunk_ids(b, rb.snapshot_id)}
        def part_ids(store: ss.Store, sid: int, name: str) -> set[bytes]:
            return store._repo.db.read(lambda c: {ch.id for ch in c.part_chunks(sid, name)
                                                  if ch is not None})
        assert part_ids(b, rb.snapshot_id, changed).isdisjoint(ids_a)  # no chunk dedup across layouts
        assert ids_b & ids_a  # the unchanged parts still deduplicate
        m = b.match(toks)
        assert m is not None and m.snapshot_id == rb.snapshot_id
        restore_exact(b, m, other)
    with open_store(store_dir) as a:  # and the first layout still restores its own
        restore_exact(a, ra, state)


# -- item 4: writers of different codecs on one directory ----------------------------------------

def _compressible(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in LAYOUT.fixed.items():
        out[name] = rng.integers(0, 4, spec.nbytes, dtype=np.uint8).view(spec.dtype).reshape(spec.shape)
    for name, spec in LAYOUT.rows.items():
        out[name] = rng.integers(0, 4, n * spec.row_bytes, dtype=np.uint8).view(spec.dtype).reshape(
            (n, *spec.row_shape))
    return out


def _check_clean(path: str, stores: list[ss.Store]) -> None:
    """Deep verify clean, stored bytes equal the bytes on disk, repair removes nothing."""
    for s in stores:
        rep = s.verify(deep=True)
        assert rep.ok, rep.problems
        assert not rep.orphan_files
        assert s.stats().stored_bytes == disk_bytes(s)
    rep = repo_verify(Repo.open(path), deep=True, repair=True, grace=0.0)
    assert rep.ok and not rep.removed_snapshots and not rep.removed_files, rep.problems


@pytest.mark.parametrize("first", ["raw", "zstd"])
def test_mixed_codec_writers_never_replace_a_committed_file(store_dir: str, hook: Any, first: str) -> None:
    """Writer B finds the chunk absent, then waits (forced) while writer A of the other codec saves
    and commits the same bytes; B must then deduplicate onto A's file, not replace it."""
    second = "zstd" if first == "raw" else "raw"
    state = _compressible(300, 5)
    toks = list(range(300))
    with open_store(store_dir, codec=first) as a, open_store(store_dir, codec=second) as b:
        gate = threading.Event()
        reached = threading.Event()

        def pause(stage: str, chunker: Any, cid: bytes) -> None:
            if stage == "publish" and chunker is b._chunker:
                reached.set()
                assert gate.wait(30)

        hook(pause)
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.setdefault("b", b.save(toks, state)))
        t.start()
        assert reached.wait(30)
        ra = a.save(toks, state)  # commits while B holds its "absent" answer
        assert ra.ok and ra.stored_bytes > 0
        gate.set()
        t.join()
        rb = out["b"]
        assert rb.ok and rb.snapshot_id == ra.snapshot_id  # same content: deduplicated
        for s in (a, b):
            restore_exact(s, s.match(toks), state)
        _check_clean(store_dir, [a, b])
        # and the other way round with a new state: b first, a racing
        state2 = _compressible(200, 6)
        r1 = b.save(list(range(1000, 1200)), state2)
        r2 = a.save(list(range(2000, 2200)), state2)  # other tokens, same bytes: chunk-level dedup
        assert r1.ok and r2.ok and r2.stored_bytes < r1.stored_bytes
        restore_exact(a, r1, state2)
        restore_exact(b, r2, state2)
        _check_clean(store_dir, [a, b])


@pytest.mark.slow  # two writer processes
def test_mixed_codec_writers_in_two_processes(store_dir: str) -> None:
    """Two processes of different codecs save the same states at once, many times."""
    import subprocess
    here = TESTS_DIR
    script = (
        "import os, sys; sys.path[:0] = sys.argv[3].split(os.pathsep)\n"
        "import numpy as np, snapstore as ss\n"
        "from test_datapath import open_store, _compressible\n"
        "s = open_store(sys.argv[1], codec=sys.argv[2])\n"
        "for i in range(40):\n"
        "    n = 64 + 16 * (i % 8)\n"
        "    r = s.save(list(range(i % 8, i % 8 + n)), _compressible(n, i % 8), parent=None)\n"
        "    assert r.ok, r\n"
        "s.close()\n")
    open_store(store_dir).close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    paths = os.pathsep.join([here, HERE_DIR])
    procs = [subprocess.Popen([sys.executable, "-c", script, store_dir, codec, paths], env=env,
                              stderr=subprocess.PIPE, text=True) for codec in ("raw", "zstd", "zstd-shuffle2")]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    with open_store(store_dir) as s:
        for k in range(8):
            n = 64 + 16 * k
            m = s.match(list(range(k, k + n)))
            assert m is not None and m.n_tokens == n
            restore_exact(s, m, _compressible(n, k))
        _check_clean(store_dir, [s])


# -- item 8: quarantine and heal -----------------------------------------------------------------

def _damage_one(store: ss.Store, sid: int, how: str = "flip") -> bytes:
    cid = chunk_ids(store, sid)[0]
    path = store._repo.blob_path(cid)
    if how == "delete":
        os.unlink(path)
        return cid
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01
    open(path, "wb").write(bytes(data))
    return cid


@pytest.mark.parametrize("how", ["flip", "delete"])
def test_restore_quarantines_damage_and_a_save_heals_it(store_dir: str, how: str) -> None:
    toks = list(range(400))
    state = make_state(LAYOUT, 400, 9)
    with open_store(store_dir) as s:
        short = s.save(toks[:100], make_state(LAYOUT, 100, 8))
        r = s.save(toks, state, parent=None)
        assert short.ok and r.ok
        _damage_one(s, r.snapshot_id, how)
        m = s.match(toks)
        assert m is not None and m.snapshot_id == r.snapshot_id
        with pytest.raises((ss.CorruptChunkError, ss.SnapshotUnavailableError)) as e:
            s.restore(m, {k: np.zeros_like(v) for k, v in state.items()})
        assert e.value.touched is (how == "flip")  # a payload flip shows only once the bytes landed
        st = s.stats()
        assert st.quarantined == 1
        m2 = s.match(toks)  # the damaged snapshot stops matching; the shorter prefix still serves
        assert m2 is not None and m2.snapshot_id == short.snapshot_id
        with pytest.raises(ss.CorruptChunkError):  # asked for by id: refused before a byte is written
            s.restore(r.snapshot_id, {k: np.zeros_like(v) for k, v in state.items()})
        # a save of the right bytes republishes the chunk: the old snapshot is whole again
        again = s.save(toks, state, parent=None)
        assert again.ok
        st = s.stats()
        assert st.quarantined == 0 and st.healed == 1
        m3 = s.match(toks)
        assert m3 is not None and m3.n_tokens == 400
        restore_exact(s, m3, state)
        restore_exact(s, r.snapshot_id, state)
        rep = s.verify(deep=True)
        assert rep.ok and not rep.orphan_files, rep.problems
        assert s.stats().stored_bytes == disk_bytes(s)


def test_damaged_chunk_does_not_poison_a_save_of_the_same_bytes(store_dir: str) -> None:
    """Other tokens, same bytes: after the restore found the damage, the save must republish, not
    deduplicate onto the damaged file."""
    state = make_state(LAYOUT, 300, 4)
    with open_store(store_dir) as s:
        r = s.save(list(range(300)), state)
        _damage_one(s, r.snapshot_id)
        with pytest.raises(ss.CorruptChunkError):
            s.restore(r, {k: np.zeros_like(v) for k, v in state.items()})
        r2 = s.save(list(range(1, 301)), state)
        assert r2.ok
        restore_exact(s, r2, state)
        restore_exact(s, r, state)  # healed: the first snapshot restores too
        assert s.stats().quarantined == 0


def test_ram_tier_never_serves_a_quarantined_chunk(store_dir: str) -> None:
    state = make_state(LAYOUT, 300, 6)
    toks = list(range(300))
    ram = ss.Budget(ram_bytes=1 << 20, reserve_bytes=0)
    with open_store(store_dir, budget=ram) as hot, open_store(store_dir) as cold:
        r = hot.save(toks, state)
        restore_exact(hot, r, state)
        restore_exact(hot, r, state)  # admitted to hot's RAM tier (in the background)
        assert hot._ram is not None and hot._ram.drain(10)
        assert hot.stats().ram_bytes > 0
        _damage_one(hot, r.snapshot_id)
        with pytest.raises(ss.CorruptChunkError):  # another process reads the file and finds the damage
            cold.restore(r, {k: np.zeros_like(v) for k, v in state.items()})
        assert hot.match(toks) is None
        dest = {k: np.full_like(v, 7) for k, v in state.items()}
        with pytest.raises(ss.CorruptChunkError) as e:
            hot.restore(r, dest)
        assert e.value.touched is False and all((v == 7).all() for v in dest.values())


def test_quarantine_skips_a_file_healed_since_the_restore_read_it(store_dir: str) -> None:
    """quarantine() re-checks each chunk's current bytes: a file intact now (healed, republished) stays."""
    from snapstore.restore.fail import quarantine
    state = make_state(LAYOUT, 100, 2)
    with open_store(store_dir) as s:
        r = s.save(list(range(100)), state)
        cid = chunk_ids(s, r.snapshot_id)[0]
        path = s._repo.blob_path(cid)
        data = open(path, "rb").read()
        with open(path + ".new", "wb") as f:
            f.write(data)
        os.replace(path + ".new", path)  # another inode now, the same bytes: as if a save had republished it
        assert quarantine(s._repo.db, s._repo.blob_path, [cid]) == 0
        assert s.stats().quarantined == 0
        _damage_one(s, r.snapshot_id)  # damaged now: condemned
        assert quarantine(s._repo.db, s._repo.blob_path, [cid]) == 1


# -- item 11: retried saves, file descriptors, zstd memory ----------------------------------------

@pytest.mark.parametrize("parent", ["explicit", "auto"])
def test_retried_save_leaves_no_uncounted_orphans(store_dir: str, hook: Any, parent: str) -> None:
    """The parent vanishes (forced) after the chunk files are published, before the catalog commit."""
    toks = list(range(500))
    state = make_state(LAYOUT, 500, 11)
    with open_store(store_dir) as s:
        head = {k: (v[:200] if k in LAYOUT.rows else v) for k, v in state.items()}
        p = s.save(toks[:200], head, commit=parent != "explicit")
        assert p.ok
        fired = []

        def vanish(stage: str, chunker: Any, cid: bytes) -> None:
            if stage == "stored" and not fired:
                fired.append(1)
                if parent == "explicit":
                    s.abandon(p)
                else:
                    # as an eviction by another process would: rows first, files after the commit
                    s._repo.write(lambda t: t.delete_snapshot(p.snapshot_id))

        hook(vanish)
        if parent == "explicit":
            with pytest.raises(ss.NotFoundError):
                s.save(toks, state, parent=p.snapshot_id, commit=False)
        else:
            r = s.save(toks, state)
            assert r.ok
            restore_exact(s, r, state)
        assert fired
        rep = s.verify(deep=True)
        assert rep.ok and not rep.orphan_files, rep.orphan_files[:3]
        assert s.stats().stored_bytes == disk_bytes(s)


def test_save_never_adopts_a_published_file_whose_payload_was_cut(store_dir: str, hook: Any) -> None:
    """A chunk file cut short between its publish and the save's commit (header intact, payload
    shorter than the header says) fails the save's header check as it fails restore's: the save
    republishes it rather than committing a snapshot that cannot restore (review of issue 10's
    one header check: the save path passed no file size, so it was weaker than restore's)."""
    from snapstore.chunks.chunkfile import HEADER_SIZE

    toks = list(range(300))
    state = make_state(LAYOUT, 300, 12)
    with open_store(store_dir) as s:
        cut: list[str] = []

        def damage(stage: str, chunker: Any, cid: bytes) -> None:
            if stage != "stored" or cut:
                return
            known = s._repo.db.read(lambda c: {ch.id for ch in c.all_chunks()})
            for fid, path in s._repo.blob_files():
                size = os.path.getsize(path)
                if fid not in known and size > HEADER_SIZE + 1:
                    os.truncate(path, size - 1)  # what a torn or damaged file looks like to a stat
                    cut.append(path)
                    return

        hook(damage)
        r = s.save(toks, state)
        assert cut and r.ok
        restore_exact(s, r, state)
        assert s.stats().quarantined == 0
        assert s.verify(deep=True).ok


def test_restore_of_many_small_chunks_keeps_few_descriptors(store_dir: str) -> None:
    big = ss.Layout(fixed={"a": ss.Fixed("uint8", (4 << 20,))}, rows={"kv": ss.Rows("uint8", (64,))})
    rng = np.random.default_rng(3)
    state = {"a": rng.integers(0, 256, 4 << 20, dtype=np.uint8),
             "kv": rng.integers(0, 256, (3000, 64), dtype=np.uint8)}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with open_store(store_dir, layout=big) as s:
        r = s.save(list(range(3000)), state)  # ~1050 chunk files of 4 KiB
        assert len(chunk_ids(s, r.snapshot_id)) > 1000
        in_use = len(os.listdir("/proc/self/fd"))
        tight = in_use + 100  # far fewer descriptors than the plan has chunks
        resource.setrlimit(resource.RLIMIT_NOFILE, (tight, hard))
        try:
            restore_exact(s, r, state)
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (tight, hard)  # never raised behind our back
            # damage late in the plan is still found before a byte is written
            cid = chunk_ids(s, r.snapshot_id)[-1]
            path = s._repo.blob_path(cid)
            data = bytearray(open(path, "rb").read())
            data[20] ^= 0xFF  # header: raw_len
            open(path, "wb").write(bytes(data))
            dest = {k: np.full_like(v, 9) for k, v in state.items()}
            with pytest.raises(ss.CorruptChunkError) as e:
                s.restore(r, dest)
            assert e.value.touched is False and all((v == 9).all() for v in dest.values())
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("codec", ["zstd", "zstd-shuffle2"])
def test_zstd_paths_stay_within_staging_plus_a_constant(store_dir: str, codec: str) -> None:
    chunk, staging = 16 << 20, 32 << 20
    n = 64 << 20
    lay = ss.Layout(fixed={"s": ss.Fixed("uint8", (n,))})
    data = np.random.default_rng(5).integers(0, 4, n, dtype=np.uint8)  # compresses well
    dest = np.zeros(n, np.uint8)
    bound = 6 << 20
    with open_store(store_dir, layout=lay, codec=codec, chunk_bytes=chunk, staging_bytes=staging,
                    check_rows=False) as s:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            r = s.save([1, 2, 3], {"s": data})
            save_peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            s.restore(r, {"s": dest})
            restore_peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert r.ok and r.stored_bytes < n // 2
        assert np.array_equal(dest, data)
    print(f"zstd peaks over baseline: save {save_peak / 2**20:.1f} MiB (staging {staging >> 20}), "
          f"restore {restore_peak / 2**20:.1f} MiB")
    assert save_peak <= staging + bound, f"save peak {save_peak >> 20} MiB"
    assert restore_peak <= bound, f"restore peak {restore_peak >> 20} MiB"


# -- schema v3 beside stores of an older version --------------------------------------------------

def test_catalog_of_an_older_version_reads_read_only_and_migrates_on_open(store_dir: str) -> None:
    """A v1 catalog (no chunks.quarantined): the read-only CLI reads it without migrating it (and
    without failing on the missing column); a read-write open migrates it and then quarantines."""
    import subprocess

    import apsw
    state = make_state(LAYOUT, 100, 1)
    with open_store(store_dir) as s:
        r = s.save(list(range(100)), state)
    db = os.path.join(store_dir, "snapstore.db")
    c = apsw.Connection(db)
    c.execute(UNDO_FIND_KEYS + "DROP TABLE row_prefixes; DROP INDEX chunks_quarantined; "
              "ALTER TABLE chunks DROP COLUMN quarantined; DROP TABLE owners; "
              "ALTER TABLE snapshots DROP COLUMN shared; ALTER TABLE parts DROP COLUMN tokens_per_row; "
              "PRAGMA user_version = 1")
    c.close()
    env = dict(os.environ, PYTHONPATH=REPO_DIR)
    for cmd in (["verify", "--deep", "--json"], ["stats", "--json"], ["inspect", "--json"]):
        out = subprocess.run([sys.executable, "-m", "snapstore", "--dir", store_dir, *cmd], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, (cmd, out.stderr[-2000:])
    c = apsw.Connection(db)
    assert c.pragma("user_version") == 1  # read-only: nothing migrated
    c.close()
    with open_store(store_dir) as s:
        restore_exact(s, r, state)
        _damage_one(s, r.snapshot_id)
        with pytest.raises(ss.CorruptChunkError):
            s.restore(r, {k: np.zeros_like(v) for k, v in state.items()})
        assert s.stats().quarantined == 1
    c = apsw.Connection(db)
    assert c.pragma("user_version") == migrations_dir()[-1][0]  # every migration since
    c.close()
