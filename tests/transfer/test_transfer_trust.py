"""Export/import never serves foreign or wrong state as exact (issue 46, items 1, 5, 6, 7, 9).

- the "imported under an identity override" mark travels with the state: an export of a marked
  chain (or of a snapshot saved over one) carries it, and importing that file anywhere requires
  the override again (item 1);
- a native save is never deduplicated onto an override import (item 5);
- an import heals a chunk whose file was lost or whose row was quarantined, as a save does (item 6);
- a chain that would be matched and never restore is refused before the commit (item 7);
- one validation of namespaces, names and tokens for the API and the file decoder: a file's
  300-character namespace or negative token is ExportFileError with nothing published (item 9).

Real stores and files; malformed files are written from the format model (support/export_model.py)
with correct checksums, so only the fields are wrong.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np
import pytest
from support.export_model import ModelFile, ModelLink, ModelPart, encode

import snapstore as ss

IDENT = ss.Identity(build="eng-1.0", pack="sha256:aa-q8", kv="f16")
OTHER = ss.Identity(build="eng-1.0", pack="sha256:aa-q4", kv="f16")  # another quant of the model
LAY = ss.Layout(fixed={"rec": ss.Fixed("float32", (4, 8))}, rows={"kv": ss.Rows("uint8", (64,))})
TOKENS = [7 + i for i in range(300)]
MORE = TOKENS + [9000 + i for i in range(50)]
RNG = np.random.default_rng(46)
KV = RNG.integers(0, 256, (350, 64), dtype=np.uint8)
REC1, REC2, REC3 = [RNG.standard_normal((4, 8)).astype(np.float32) for _ in range(3)]


def open_store(path: Any, identity: ss.Identity = IDENT, layout: ss.Layout = LAY, **kw: Any) -> ss.Store:
    return ss.Store.open(str(path), identity=identity, layout=layout, chunk_bytes=4096, staging_bytes=64 * 1024, **kw)


def chain_file(tmp_path: Any, identity: ss.Identity, name: str = "chain.snapx") -> str:
    """A two-link chain (100 tokens, then 300) saved by ``identity``, exported to a file; its path."""
    src, out = tmp_path / f"src-{identity.key}", str(tmp_path / name)
    with open_store(src, identity) as s:
        s.save(TOKENS[:100], {"rec": REC1, "kv": KV[:100]})
        leaf = s.save(TOKENS, {"rec": REC2, "kv": KV[:300]})
        s.export(leaf, out)
    return out


def exact(s: ss.Store, ref: Any, n: int = 300, rec: np.ndarray = REC2) -> bool:
    out = {"rec": np.zeros((4, 8), np.float32), "kv": np.zeros((n, 64), np.uint8)}
    r = s.restore(ref, out)
    return r.n_tokens == n and out["rec"].tobytes() == rec.tobytes() and out["kv"].tobytes() == KV[:n].tobytes()


def marks(s: ss.Store) -> dict[int, str | None]:
    return {i.snapshot_id: i.imported_from for i in s.snapshots()}


def state_of(path: Any) -> tuple[list[tuple[str, int]], list[str]]:
    """What a refused import must leave as it was: every chunk file (name, size) and tmp/'s entries."""
    files = []
    for sub, _dirs, names in os.walk(os.path.join(str(path), "blobs")):
        files += [(n, os.path.getsize(os.path.join(sub, n))) for n in names]
    return sorted(files), sorted(os.listdir(os.path.join(str(path), "tmp")))


# -- item 1: the override mark travels with the state ----------------------------------------------------
def test_an_export_of_an_override_import_is_marked_and_needs_the_override_again(tmp_path: Any) -> None:
    q4 = chain_file(tmp_path, OTHER)
    again = str(tmp_path / "again.snapx")
    with open_store(tmp_path / "q8") as s:
        r = s.import_file(q4, accept_identity=OTHER.key)
        assert r.imported_from == OTHER.key
        e = s.export(r.snapshot_id, again)
        assert e.imported_from == OTHER.key and e.identity_key == IDENT.key
    data = open(again, "rb").read()
    assert struct.unpack_from("<H", data, 10)[0] == 1  # preamble flag bit 0: a reader that ignores it refuses it
    with open_store(tmp_path / "fresh-q8") as s:
        before = state_of(tmp_path / "fresh-q8")
        # the file's identity is this store's, but the state is q4's: no exact import
        with pytest.raises(ss.IdentityError, match=OTHER.key):
            s.import_file(again)
        with pytest.raises(ss.IdentityError, match="computed"):
            s.import_file(again, accept_identity=IDENT.key)  # naming the exporting identity is not enough
        assert s.snapshots() == [] and state_of(tmp_path / "fresh-q8") == before
        r2 = s.import_file(again, accept_identity=OTHER.key)
        assert r2.imported_from == OTHER.key and set(marks(s).values()) == {OTHER.key}
        assert s.match(TOKENS) is None  # never an exact hit
        assert exact(s, r2.snapshot_id)  # restored by id
    with open_store(tmp_path / "fresh-q4", OTHER) as s:  # back where it was computed: still marked
        with pytest.raises(ss.IdentityError):
            s.import_file(again)


def test_a_snapshot_saved_over_an_override_import_is_exported_marked(tmp_path: Any) -> None:
    q4 = chain_file(tmp_path, OTHER)
    out = str(tmp_path / "child.snapx")
    with open_store(tmp_path / "q8") as s:
        r = s.import_file(q4, accept_identity=OTHER.key)
        child = s.save(MORE, {"rec": REC3, "kv": KV}, parent=r.snapshot_id)  # a delta over foreign state
        assert child.snapshot_id is not None
        assert marks(s)[child.snapshot_id] == OTHER.key  # inherits the mark: never laundered
        assert s.match(MORE) is None
        assert s.export(child, out).imported_from == OTHER.key
    with open_store(tmp_path / "dst") as s:
        with pytest.raises(ss.IdentityError):
            s.import_file(out)
        r2 = s.import_file(out, accept_identity=OTHER.key)
        assert s.match(MORE) is None and exact(s, r2.snapshot_id, 350, REC3)


@pytest.mark.parametrize("flags,mark", [(0, OTHER.key), (1, None)])
def test_a_file_whose_flag_and_mark_disagree_is_refused(tmp_path: Any, flags: int, mark: str | None) -> None:
    m = ModelFile(IDENT, [ModelPart("kv", "rows", (8,))], [ModelLink([1, 2, 3], {"kv": (0, 3, bytes(24))})],
                  imported_from=mark, flags=flags)
    f = tmp_path / "x.snapx"
    f.write_bytes(encode(m))
    with open_store(tmp_path / "s", layout=m.layout()) as s:
        with pytest.raises(ss.ExportFileError, match="flags and the header disagree"):
            s.import_file(str(f), accept_identity=OTHER.key)
        assert s.snapshots() == []


# -- item 5: a native save is stored as native -------------------------------------------------------------
def test_a_native_save_is_never_deduplicated_onto_an_override_import(tmp_path: Any) -> None:
    q4 = chain_file(tmp_path, OTHER)
    with open_store(tmp_path / "q8") as s:
        r = s.import_file(q4, accept_identity=OTHER.key)
        # the engine computes the same bytes itself (this model's q4 and q8 caches agree here)
        root = s.save(TOKENS[:100], {"rec": REC1, "kv": KV[:100]})
        assert root.snapshot_id is not None and marks(s)[root.snapshot_id] is None  # not the import's root
        hit = s.match(TOKENS[:100])
        assert hit is not None and hit.snapshot_id == root.snapshot_id  # the engine's own save is a hit
        leaf = s.save(TOKENS, {"rec": REC2, "kv": KV[:300]})
        assert leaf.snapshot_id is not None and leaf.snapshot_id != r.snapshot_id and leaf.parent_id == root.snapshot_id
        assert marks(s)[leaf.snapshot_id] is None and marks(s)[r.snapshot_id] == OTHER.key
        m = s.match(TOKENS)
        assert m is not None and m.snapshot_id == leaf.snapshot_id and exact(s, m)
        child = s.save(MORE, {"rec": REC3, "kv": KV}, parent=leaf)  # over the native one: native
        assert marks(s)[child.snapshot_id] is None  # type: ignore[index]
        hit = s.match(MORE)
        assert hit is not None and hit.snapshot_id == child.snapshot_id and exact(s, hit, 350, REC3)
        assert s.verify(deep=True).ok


# -- item 6: an import heals as a save does --------------------------------------------------------------
def _chunk_files(path: Any) -> list[str]:
    return sorted(os.path.join(sub, n) for sub, _d, names in os.walk(os.path.join(str(path), "blobs")) for n in names)


def test_importing_a_backup_restores_a_lost_chunk_file(tmp_path: Any) -> None:
    f = chain_file(tmp_path, IDENT)
    with open_store(tmp_path / "s") as s:
        r = s.import_file(f)
        lost = _chunk_files(tmp_path / "s")
        for p in lost[:2]:
            os.unlink(p)
        with pytest.raises(ss.SnapshotUnavailableError):
            exact(s, r.snapshot_id)
        r2 = s.import_file(f)  # the backup
        assert r2.snapshot_id == r.snapshot_id and r2.chunks_written >= 2
        assert all(os.path.exists(p) for p in lost)
        assert exact(s, r.snapshot_id) and exact(s, s.match(TOKENS))
        assert s.verify(deep=True).ok


def test_importing_a_backup_lifts_the_quarantine_of_a_damaged_chunk(tmp_path: Any) -> None:
    f = chain_file(tmp_path, IDENT)
    with open_store(tmp_path / "s") as s:
        r = s.import_file(f)
        victim = _chunk_files(tmp_path / "s")[0]
        with open(victim, "r+b") as fh:  # flip a payload byte: the header still parses
            fh.seek(100)
            b = fh.read(1)
            fh.seek(100)
            fh.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(ss.RestoreError):
            exact(s, r.snapshot_id)
        assert s.stats().quarantined >= 1
        os.unlink(victim)  # a quarantined chunk whose file is gone too: the import must still heal the row
        s.import_file(f)
        assert s.stats().quarantined == 0
        assert exact(s, r.snapshot_id) and s.verify(deep=True).ok


def test_a_second_import_over_a_quarantined_chunk_with_its_damaged_file(tmp_path: Any) -> None:
    f = chain_file(tmp_path, IDENT)
    with open_store(tmp_path / "s") as s:
        r = s.import_file(f)
        victim = _chunk_files(tmp_path / "s")[-1]
        with open(victim, "r+b") as fh:
            fh.seek(80)
            b = fh.read(1)
            fh.seek(80)
            fh.write(bytes([b[0] ^ 0x55]))
        with pytest.raises(ss.RestoreError):
            exact(s, r.snapshot_id)
        s.import_file(f)
        assert s.stats().quarantined == 0 and exact(s, r.snapshot_id) and s.verify(deep=True).ok


# -- item 7: a chain that would never restore is refused -------------------------------------------------
TWO = [ModelPart("kv", "rows", (8,)), ModelPart("rec", "fixed", (16,))]


def _leaf_continues_a_stream_its_ancestor_lacks() -> ModelFile:
    """Root: 4 tokens and its fixed part but no kv rows; leaf: 4 more tokens and kv rows [0, 8)."""
    return ModelFile(IDENT, TWO, [
        ModelLink([1, 2, 3, 4], {"rec": (0, 0, bytes(range(16)))}),
        ModelLink([5, 6, 7, 8], {"kv": (0, 8, bytes(range(64))), "rec": (0, 0, bytes(range(16, 32)))})])


def test_a_leaf_continuing_a_stream_its_ancestor_lacks_is_refused(tmp_path: Any) -> None:
    m = _leaf_continues_a_stream_its_ancestor_lacks()
    f = tmp_path / "bad.snapx"
    f.write_bytes(encode(m))
    with open_store(tmp_path / "s", layout=m.layout()) as s:
        before = state_of(tmp_path / "s")
        with pytest.raises(ss.ExportFileError, match="does not restore"):
            s.import_file(str(f))
        assert s.snapshots() == [] and s.match(m.tokens()) is None
        assert state_of(tmp_path / "s") == before
        # parent="auto" finds nothing to delta over
        res = s.save(m.tokens(), {"kv": np.zeros((8, 8), np.uint8), "rec": np.zeros(16, np.uint8)})
        assert res.parent_id is None


def test_a_link_match_passes_over_is_imported_and_never_served(tmp_path: Any) -> None:
    """The root lacks the fixed part (a chain link only): match() never serves it (it does not fit the
    layout), so it is no reason to refuse the chain; the leaf restores byte-exact."""
    m = ModelFile(IDENT, TWO, [
        ModelLink([1, 2, 3, 4], {"kv": (0, 4, bytes(32))}),
        ModelLink([5, 6, 7, 8], {"kv": (4, 8, bytes(range(32))), "rec": (0, 0, bytes(range(16)))})])
    f = tmp_path / "ok.snapx"
    f.write_bytes(encode(m))
    with open_store(tmp_path / "s", layout=m.layout()) as s:
        r = s.import_file(str(f))
        assert s.match([1, 2, 3, 4]) is None
        hit = s.match(m.tokens())
        assert hit is not None and hit.snapshot_id == r.snapshot_id
        out = {"kv": np.zeros((8, 8), np.uint8), "rec": np.zeros(16, np.uint8)}
        s.restore(hit, out)
        exp = m.expected()
        assert out["kv"].tobytes() == exp["kv"] and out["rec"].tobytes() == exp["rec"]


def test_a_leaf_missing_a_part_of_this_stores_layout_is_a_layout_error(tmp_path: Any) -> None:
    """A well-formed file of parts {kv}; this store's layout also needs {rec}: LayoutError, nothing imported."""
    m = ModelFile(IDENT, [ModelPart("kv", "rows", (8,))], [ModelLink([1, 2, 3], {"kv": (0, 3, bytes(24))})])
    f = tmp_path / "x.snapx"
    f.write_bytes(encode(m))
    with open_store(tmp_path / "s", layout=ss.Layout(fixed={"rec": ss.Fixed("uint8", (16,))},
                                                   rows={"kv": ss.Rows("uint8", (8,))})) as s:
        with pytest.raises(ss.LayoutError, match="does not restore into this store's layout"):
            s.import_file(str(f))
        assert s.snapshots() == []


# -- item 9: one validation of namespaces, names and tokens ----------------------------------------------
ONE = [ModelPart("kv", "rows", (8,))]


@pytest.mark.parametrize("field,value,why", [
    ("namespace", "n" * 300, "namespace"),
    ("namespace", "n" * 257, "namespace"),
    ("name", "x" * 300, "name"),
    ("name", "tab\there", "name"),
])
def test_a_namespace_or_name_no_call_could_reach_is_refused(tmp_path: Any, field: str, value: str, why: str) -> None:
    m = ModelFile(IDENT, ONE, [ModelLink([1, 2, 3], {"kv": (0, 3, bytes(24))})])
    setattr(m, field, value)
    f = tmp_path / "x.snapx"
    f.write_bytes(encode(m))
    with open_store(tmp_path / "s", layout=m.layout()) as s:
        before = state_of(tmp_path / "s")
        with pytest.raises(ss.ExportFileError, match=why):
            s.import_file(str(f))
        assert s.snapshots() == [] and state_of(tmp_path / "s") == before
    # and the API refuses the same values
    with open_store(tmp_path / "s", layout=m.layout()) as s, pytest.raises(ss.InvalidInputError):
        if field == "namespace":
            s.match([1, 2, 3], namespace=value)
        else:
            s.named(value)


def test_the_longest_namespace_the_api_takes_round_trips(tmp_path: Any) -> None:
    ns = "n" * 256
    m = ModelFile(IDENT, ONE, [ModelLink([1, 2, 3], {"kv": (0, 3, bytes(range(24)))})], namespace=ns, name="keep")
    f = tmp_path / "x.snapx"
    f.write_bytes(encode(m))
    with open_store(tmp_path / "s", layout=m.layout()) as s:
        r = s.import_file(str(f))
        hit = s.named("keep", namespace=ns)
        assert hit is not None and hit.snapshot_id == r.snapshot_id
        out = {"kv": np.zeros((3, 8), np.uint8)}
        s.restore(s.match([1, 2, 3], namespace=ns), out)  # type: ignore[arg-type]
        assert out["kv"].tobytes() == bytes(range(24))


@pytest.mark.parametrize("width", [4, 8])
def test_a_negative_token_is_the_files_fault_and_nothing_is_published(tmp_path: Any, width: int) -> None:
    m = ModelFile(IDENT, ONE, [ModelLink([1, 2], {"kv": (0, 2, bytes(16))}),
                               ModelLink([3, -5], {"kv": (2, 4, bytes(range(16)))})], token_width=width)
    f = tmp_path / "x.snapx"
    f.write_bytes(encode(m))
    with open_store(tmp_path / "s", layout=m.layout()) as s:
        before = state_of(tmp_path / "s")
        with pytest.raises(ss.ExportFileError, match=r"tokens.*out of range") as err:
            s.import_file(str(f))
        assert "verify" not in str(err.value)  # not reported as store damage
        assert s.snapshots() == [] and state_of(tmp_path / "s") == before


# -- item 6, the shared tier: missing() looks at the file, not only the row ------------------------------
def test_the_shared_tiers_missing_check_counts_a_lost_or_quarantined_chunk(tmp_path: Any) -> None:
    """Fetcher.missing() decides which chunks of a shared-tier chain are fetched: a chunk whose row is
    here but whose file is lost, or whose row is quarantined, must be fetched (and settled) again.
    The chain's manifests are built from this store's own chain as a Publisher builds them; the
    bucket client is never used by missing()."""
    from concurrent.futures import ThreadPoolExecutor

    from snapstore.remote.fetch import Fetcher
    from snapstore.remote.find_chain import RemoteHit
    from snapstore.remote.upload_chain import Publisher

    with open_store(tmp_path / "s") as s, ThreadPoolExecutor(1) as pool:
        res = s.save(TOKENS[:100], {"rec": REC1, "kv": KV[:100]})
        repo = s._repo  # noqa: SLF001 - the store's own repository, as the shared tier uses it
        sid = res.snapshot_id
        links = repo.db.read(lambda c: [(link, [(p, c.part_chunks(link.id, p.name)) for p in c.parts(link.id)])
                                        for link in c.chain(sid)])
        pub = Publisher(None, repo, IDENT, "test", lambda ns: "scope", lambda *_: None, pool)  # type: ignore[arg-type]
        manifests, parent = [], None
        for link, parts in links:
            manifests.append(pub._manifest_of("", link, parts, parent))  # noqa: SLF001
            parent = manifests[-1].name
        hit = RemoteHit("scope", "", tuple(manifests))
        fetcher = Fetcher(None, repo, IDENT, lambda *_: None, pool)  # type: ignore[arg-type]
        assert fetcher.missing(hit) == []
        ids = [ch.id for m in manifests for p in m.parts for ch in p.chunks]
        path = repo.blob_path(ids[-1])  # damaged, then quarantined by the restore that meets it
        with open(path, "r+b") as fh:
            fh.seek(70)
            b = fh.read(1)
            fh.seek(70)
            fh.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(ss.RestoreError):
            exact(s, sid, 100, REC1)
        assert s.stats().quarantined == 1
        assert [e.id for e in fetcher.missing(hit)] == [ids[-1]]
        os.unlink(repo.blob_path(ids[0]))  # lost (its row healthy)
        assert {e.id for e in fetcher.missing(hit)} == {ids[0], ids[-1]}
