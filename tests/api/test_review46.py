"""Issue 46, the review round: where two of its fixes meet, or a fix has a second entry point.

- a layout's ``Rows(lag=)`` is stored nowhere (docs/format.md §6), so an export of a lagging stream
  carries ``lag=0``: importing it back into the very layout that saved it must not be a LayoutError;
- ``snapstore export-slot`` writes at a caller's path too: never inside a store directory (its
  catalog included), by a fresh temp file renamed into place (item 10's rule, not only ``export``'s).

Real stores, files and the real CLI entry point.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import snapstore as ss

IDENT = ss.Identity(build="eng-1.0", pack="sha256:review46", kv="f16")
LAG = ss.Layout(fixed={"rec": ss.Fixed("float32", (4, 8))},
                rows={"kv": ss.Rows("uint8", (64,)), "draft": ss.Rows("uint8", (64,), component="draft", lag=1)})
RNG = np.random.default_rng(4646)
KV = RNG.integers(0, 256, (300, 64), dtype=np.uint8)
DRAFT = RNG.integers(0, 256, (299, 64), dtype=np.uint8)
REC = RNG.standard_normal((4, 8)).astype(np.float32)
TOKENS = [11 + i for i in range(300)]


def _open(path: Any, layout: ss.Layout = LAG) -> ss.Store:
    return ss.Store.open(str(path), identity=IDENT, layout=layout, chunk_bytes=4096, staging_bytes=64 * 1024)


def test_an_export_of_a_lagging_stream_imports_back_into_its_own_layout(tmp_path: Any) -> None:
    out = str(tmp_path / "lag.snapx")
    with _open(tmp_path / "a") as s:
        r = s.save(TOKENS, {"rec": REC, "kv": KV, "draft": DRAFT})  # 299 draft rows: the layout's lag
        s.export(r, out)
    with _open(tmp_path / "b") as s:
        got = s.import_file(out)  # was: LayoutError "part 'draft' is Rows(... lag=0), this store's ... lag=1"
        assert got.imported_from is None and s.match(TOKENS) is not None
        dest = {"rec": np.zeros((4, 8), np.float32), "kv": np.zeros((300, 64), np.uint8),
                "draft": np.zeros((300, 64), np.uint8)}
        res = s.restore(got.snapshot_id, dest)
        assert res.rows == {"kv": 300, "draft": 299}
        assert dest["kv"].tobytes() == KV.tobytes() and dest["draft"][:299].tobytes() == DRAFT.tobytes()
    other = ss.Layout(fixed=LAG.fixed, rows={"kv": LAG.rows["kv"],
                                             "draft": ss.Rows("uint8", (32,), component="draft", lag=1)})
    with _open(tmp_path / "c", other) as s, pytest.raises(ss.LayoutError, match="draft"):
        s.import_file(out)  # a real spec difference is still refused


def test_export_slot_never_writes_into_a_store(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gguf")
    import json

    import helpers_llamacpp as h
    from test_llamacpp_draft import BUILD, slot_file
    from test_llamacpp_draft import TOKENS as SLOT_TOKENS

    from snapstore.cli.main import main

    model = h.write_llama(str(tmp_path / "llama.gguf"))
    src = tmp_path / "a.bin"
    src.write_bytes(slot_file(SLOT_TOKENS, seed=8))
    store = str(tmp_path / "store")
    assert main(["--dir", store, "--json", "import-slot", str(src), "--model", model, "--build", BUILD]) == 0
    sid = str(json.loads(capsys.readouterr()[0])["snapshot_id"])
    catalog = os.path.join(store, "snapstore.db")
    before = open(catalog, "rb").read(100)
    # was: "wrote …/snapstore.db", and every later command: "snapstore.db is not an SQLite database"
    assert main(["--dir", store, "export-slot", sid, catalog]) == 2
    assert "inside the snapstore store" in capsys.readouterr()[1]
    assert main(["--dir", store, "export-slot", sid, os.path.join(store, "blobs", "x.bin")]) == 2
    assert open(catalog, "rb").read(100) == before and main(["--dir", store, "verify"]) == 0
    capsys.readouterr()
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    assert main(["--dir", store, "export-slot", sid, str(out)]) == 0  # a file elsewhere is replaced, as before
    assert out.read_bytes() == src.read_bytes()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".part")]


def test_a_big_endian_paged_pool_is_refused_like_a_big_endian_array(tmp_path: Any) -> None:
    """dtype.name is 'float32' for '>f4' too: the pool's check must see the byte order, as the
    array's does, or a restore lands swapped bytes (and a save stores them) without an error."""
    layout = ss.Layout(rows={"kv": ss.Rows("float32", (8,))})
    kv = RNG.standard_normal((50, 8)).astype(np.float32)
    with _open(tmp_path / "s", layout) as s:
        r = s.save(TOKENS[:50], {"kv": kv})
        pool = np.zeros((4, 16, 8), ">f4")
        with pytest.raises(ss.DestinationError, match="big-endian"):
            s.restore(r, {"kv": ss.PagedRows(pool, [0, 1, 2, 3])})  # was: restored, every value swapped
        assert not pool.any()
        pool.reshape(-1, 8)[:50] = kv
        with pytest.raises(ss.LayoutError, match="big-endian"):
            s.save(TOKENS[100:150], {"kv": ss.PagedRows(pool, [0, 1, 2, 3])}, rows={"kv": 50})
        assert s.match(TOKENS[100:150]) is None
        little = np.zeros((4, 16, 8), "<f4")
        s.restore(r, {"kv": ss.PagedRows(little, [0, 1, 2, 3])})
        assert np.array_equal(little.reshape(-1, 8)[:50], kv)


@pytest.mark.parametrize("argv", [["inspect", "99999999999999999999999"],
                                  ["export", "--id", "99999999999999999999999", "OUT"],
                                  ["export-slot", "99999999999999999999999", "OUT"]])
def test_a_snapshot_id_past_sqlites_range_is_a_usage_error(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                                           argv: list[str]) -> None:
    """Every command's snapshot id is read by one rule, the API's [1, 2**63): was a raw OverflowError
    traceback from SQLite for export and export-slot, and for inspect (which checked only >= 1)."""
    from snapstore.cli.main import main

    with _open(tmp_path / "s") as s:
        s.save(TOKENS, {"rec": REC, "kv": KV, "draft": DRAFT})
    argv = [str(tmp_path / "out.bin") if a == "OUT" else a for a in argv]
    assert main(["--dir", str(tmp_path / "s"), *argv]) == 2
    assert "[1, 2**63)" in capsys.readouterr()[1]
    assert not os.path.exists(tmp_path / "out.bin")


def test_a_named_snapshots_leading_prefix_matches_past_the_ttl_through_its_chain(tmp_path: Any) -> None:
    """Names × TTL × block-granular prefixes: the named leaf's first rows are held by its (unnamed)
    parent, which the TTL would expire but its child keeps; a prompt sharing only those rows must
    still hit, as one sharing rows past the parent does (was: None — the parent's last_used failed
    the TTL test, the name on its child was not consulted)."""
    import time

    layout = ss.Layout(rows={"kv": ss.Rows("uint8", (64,))}, tokens_per_row=16)
    budget = ss.Budget(ttl=0.5, reserve_bytes=0)
    base, more = TOKENS[:128], TOKENS[:128] + [9000 + i for i in range(64)]
    s = ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=layout, budget=budget, chunk_bytes=4096)
    with s:
        s.save(base, {"kv": KV[:8]})
        leaf = s.save(more, {"kv": KV[:12]})
        s.name(leaf, "kept")
    time.sleep(0.8)
    s = ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=layout, budget=budget, chunk_bytes=4096)
    with s:
        assert s.match(more[:160] + [1] * 20) is not None  # past the parent: served by the leaf itself
        hit = s.match(base[:64] + [1] * 20)  # within the parent's rows
        assert hit is not None and hit.n_tokens == 64
        dest = {"kv": np.zeros((4, 64), np.uint8)}
        assert s.restore(hit, dest).rows == {"kv": 4} and dest["kv"].tobytes() == KV[:4].tobytes()
        assert s.lookup(base[:64] + [1] * 20) is not None
        s.unname("kept")
    time.sleep(0.8)
    s = ss.Store.open(str(tmp_path / "s"), identity=IDENT, layout=layout, budget=budget, chunk_bytes=4096)
    with s:  # the name gone, the TTL applies to the whole chain again
        assert s.match(base[:64] + [1] * 20) is None and s.snapshots() == []


def test_a_refused_import_into_a_new_directory_creates_no_store(tmp_path: Any,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Item 12 × item 1: ``import`` creates a store where there is none, but an import it refuses at
    once (a marked file without --accept-identity, a bad --name) leaves nothing behind (was: an
    empty store, created before the refusal)."""
    from snapstore.cli.main import main

    other = ss.Identity(build="eng-1.0", pack="sha256:review46-q4", kv="f16")
    plain, marked = str(tmp_path / "q4.snapx"), str(tmp_path / "marked.snapx")
    layout = ss.Layout(rows={"kv": ss.Rows("uint8", (64,))})
    with ss.Store.open(str(tmp_path / "q4s"), identity=other, layout=layout) as s:
        s.export(s.save(TOKENS, {"kv": KV}), plain)
    with ss.Store.open(str(tmp_path / "q8s"), identity=IDENT, layout=layout) as s:
        s.export(s.import_file(plain, accept_identity=other.key).snapshot_id, marked)
    new = str(tmp_path / "new")
    assert main(["--dir", new, "import", marked]) == 2
    assert "--accept-identity" in capsys.readouterr()[1] and not os.path.exists(new)
    assert main(["--dir", new, "import", plain, "--name", "a\x01b"]) == 2
    assert not os.path.exists(new)
    assert main(["--dir", new, "import", marked, "--accept-identity", other.key]) == 0  # then it is created
    with ss.Store.open(new, identity=IDENT, layout=layout) as s:
        assert s.match(TOKENS) is None and [i.imported_from for i in s.snapshots()] == [other.key]


@pytest.mark.parametrize("path", [None, 5, b"/tmp/x.snapx"])
def test_a_path_that_is_not_a_path_is_a_snapstore_error(tmp_path: Any, path: Any) -> None:
    """export and import_file read their path by the one rule Store.open's follows (a str or an
    os.PathLike of str): was a raw TypeError from os.fspath / str.endswith."""
    with _open(tmp_path / "s") as s:
        r = s.save(TOKENS, {"rec": REC, "kv": KV, "draft": DRAFT})
        with pytest.raises(ss.ConfigError, match="path must be a str"):
            s.export(r, path)
        with pytest.raises(ss.ConfigError, match="path must be a str"):
            s.import_file(path)


def test_export_slot_of_an_override_import_needs_the_override(tmp_path: Any,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Item 1 through another door: a slot file cannot carry the "imported under an override" mark,
    and import-slot of it stores native state. export-slot of a marked snapshot is refused unless
    --accept-identity names the identity that computed it; then it says the file is no exact prefix
    (was: written silently with "exact": true)."""
    pytest.importorskip("gguf")
    import json

    import helpers_llamacpp as h
    from test_llamacpp_draft import BUILD, slot_file
    from test_llamacpp_draft import TOKENS as SLOT_TOKENS

    from snapstore.cli.main import main

    def run(*argv: str) -> tuple[int, Any]:
        code = main(list(argv))
        out = capsys.readouterr()[0]
        return code, (json.loads(out) if code == 0 and out.startswith("{") else None)

    q4, q8 = h.write_llama(str(tmp_path / "q4.gguf")), h.write_llama(str(tmp_path / "q8.gguf"), seed=7)
    a_file, b_file = tmp_path / "a.bin", tmp_path / "b.bin"
    a_file.write_bytes(slot_file(SLOT_TOKENS, seed=9))
    b_file.write_bytes(slot_file(SLOT_TOKENS, seed=8))
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    code, doc = run("--dir", a, "--json", "import-slot", str(a_file), "--model", q4, "--build", BUILD)
    assert code == 0
    assert run("--dir", b, "--json", "import-slot", str(b_file), "--model", q8, "--build", BUILD)[0] == 0
    code, exp = run("--dir", a, "--json", "export", "--id", str(doc["snapshot_id"]), str(tmp_path / "a.snapx"))
    assert code == 0
    code, ins = run("--dir", b, "--json", "inspect")
    key_b = ins["identities"][0]["key"]
    code, imp = run("--dir", b, "--json", "import", str(tmp_path / "a.snapx"), "--identity", key_b,
                    "--accept-identity", exp["identity_key"])
    assert code == 0 and imp["imported_from"] == exp["identity_key"] and imp["links_added"] == 1
    out = str(tmp_path / "out.bin")
    assert main(["--dir", b, "export-slot", str(imp["snapshot_id"]), out]) == 2
    assert f"--accept-identity {exp['identity_key']}" in capsys.readouterr()[1] and not os.path.exists(out)
    code, done = run("--dir", b, "--json", "export-slot", str(imp["snapshot_id"]), out,
                     "--accept-identity", exp["identity_key"])
    assert code == 0 and done["exact"] is False and open(out, "rb").read() == a_file.read_bytes()
    code, own = run("--dir", b, "--json", "export-slot", "1", str(tmp_path / "own.bin"))
    assert code == 0 and own["exact"] is True  # the store's own state: exact, no flag needed


def test_rows_past_a_lag_saved_before_the_layout_declared_it_are_never_served(tmp_path: Any) -> None:
    """Item 4 across an engine upgrade: snapshots saved before the layout said ``Rows(lag=1)`` hold a
    stale last draft row (the engine stored n rows where n-1 were valid). Under the lagging layout
    they restore only the rows their tokens give (was: all of them, the stale row served as exact),
    and a new save never deltas over one (was: a child restoring 199 draft rows, row 99 stale)."""
    plain = ss.Layout(fixed=LAG.fixed, rows={"kv": LAG.rows["kv"], "draft": ss.Rows("uint8", (64,), component="draft")})
    stale = np.concatenate([DRAFT[:99], np.zeros((1, 64), np.uint8)])  # the old engine's row 99: never computed

    def dest(n: int) -> dict[str, np.ndarray]:
        return {"rec": np.zeros((4, 8), np.float32), "kv": np.zeros((n, 64), np.uint8),
                "draft": np.full((n, 64), 7, np.uint8)}

    with _open(tmp_path / "s", plain) as s:
        old = s.save(TOKENS[:100], {"rec": REC, "kv": KV[:100], "draft": stale})
        s.save(TOKENS[100:200], {"rec": REC, "kv": KV[:100], "draft": stale})  # a root of another prompt
        chain = s.save(TOKENS[100:200] + TOKENS[:50], {"rec": REC, "kv": KV[:150],
                                                       "draft": np.concatenate([stale, DRAFT[100:150]])})
        assert chain.parent_id is not None
    with _open(tmp_path / "s") as s:  # the engine now declares the lag
        assert s.lookup(TOKENS[:100]).rows == {"kv": 100, "draft": 99}
        out = dest(100)
        assert s.restore(old, out).rows == {"kv": 100, "draft": 99}
        assert out["draft"][:99].tobytes() == DRAFT[:99].tobytes() and (out["draft"][99] == 7).all()
        out = dest(150)  # the stale row inside a chain: nothing from it on is served
        assert s.restore(chain, out).rows == {"kv": 150, "draft": 99} and (out["draft"][99:] == 7).all()
        child = s.save(TOKENS[:200], {"rec": REC, "kv": np.concatenate([KV[:100], KV[:100]]),
                                      "draft": np.concatenate([DRAFT[:99], DRAFT[:100]])})
        assert child.parent_id is None  # not a delta over the stale row
        with pytest.raises(ss.LayoutError, match="lag"):
            s.save(TOKENS[:200], {"rec": REC, "kv": np.concatenate([KV[:100], KV[:100]]),
                                  "draft": np.concatenate([DRAFT[:99], DRAFT[:100]])}, parent=old)
        out = dest(200)
        assert s.restore(child, out).rows == {"kv": 200, "draft": 199}
        assert out["draft"][:199].tobytes() == np.concatenate([DRAFT[:99], DRAFT[:100]]).tobytes()


@pytest.mark.parametrize("axes", [(0.5, 1), ("a", 1), 5, None])
def test_the_torch_pool_reads_axes_and_block_tables_by_the_numpy_pools_rule(axes: Any) -> None:
    """Item 13's one numeric check, for the torch adapter's TorchPagedRows too: it took axes=(0.5, 1)
    as (0, 1) and raised ValueError / TypeError for ('a', 1), 5, None or a block table of None."""
    torch = pytest.importorskip("torch")
    from snapstore.engine import TorchPagedRows

    pool = torch.zeros((4, 16, 8))
    with pytest.raises(ss.InvalidInputError, match="axes"):
        TorchPagedRows(pool, [0, 1], axes=axes)
    with pytest.raises(ss.InvalidInputError, match="axes"):
        ss.PagedRows(np.zeros((4, 16, 8), np.float32), [0, 1], axes=axes)
    with pytest.raises(ss.InvalidInputError, match="block_table"):
        TorchPagedRows(pool, None)  # type: ignore[arg-type]
    assert TorchPagedRows(pool, [0, 1], axes=(-3, -2)).axes == (0, 1)


def test_an_import_reads_each_links_parts_once_under_the_write_lock(tmp_path: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 7's chain check planned every matchable link over its ancestors, re-reading each
    ancestor's parts and chunk rows per link: quadratic, all under the store's write lock (a
    400-link chain: 81,000 part reads, 17 s). Each link's rows are read once for all the checks."""
    from snapstore.catalog.queries import Txn

    layout = ss.Layout(rows={"kv": ss.Rows("uint8", (64,))})
    links, out = 60, str(tmp_path / "long.snapx")
    kv = RNG.integers(0, 256, (links * 4, 64), dtype=np.uint8)
    toks = [5 + i for i in range(links * 4)]
    with _open(tmp_path / "a", layout) as s:
        for i in range(1, links + 1):
            leaf = s.save(toks[:i * 4], {"kv": kv[:i * 4]})
        s.export(leaf, out)
    reads = {"parts": 0}
    real = Txn.parts

    def counted(self: Txn, sid: int) -> Any:
        reads["parts"] += 1
        return real(self, sid)

    with _open(tmp_path / "b", layout) as s:
        monkeypatch.setattr(Txn, "parts", counted)
        got = s.import_file(out)
        monkeypatch.setattr(Txn, "parts", real)
        assert got.links_added == links and s.match(toks) is not None
        assert reads["parts"] <= 3 * links, reads  # was 1,949 for 60 links (n²/2)
        dest = {"kv": np.zeros((links * 4, 64), np.uint8)}
        assert s.restore(got.snapshot_id, dest).n_tokens == links * 4 and dest["kv"].tobytes() == kv.tobytes()


def test_a_paged_pool_of_the_layouts_own_byte_dtype_is_checked_on_its_row_shape(tmp_path: Any) -> None:
    """Item 3 for a uint8 layout (an fp8 cache kept as bytes): a pool whose rows are the layout's
    bytes permuted ((H, 2, D) for (2, H, D)) was taken as "raw bytes" and saved and restored
    scrambled without an error, while the same array was refused. A byte view of another dtype
    still passes on its row bytes."""
    layout = ss.Layout(rows={"kv": ss.Rows("uint8", (2, 4, 8))})
    kv = RNG.integers(0, 256, (32, 2, 4, 8), dtype=np.uint8)
    with _open(tmp_path / "s", layout) as s:
        r = s.save(TOKENS[:32], {"kv": kv})
        pool = np.zeros((2, 16, 4, 2, 8), np.uint8)
        with pytest.raises(ss.DestinationError, match=r"\(4, 2, 8\) uint8"):
            s.restore(r, {"kv": ss.PagedRows(pool, [0, 1])})
        assert not pool.any()
        with pytest.raises(ss.LayoutError, match=r"\(4, 2, 8\) uint8"):
            s.save(TOKENS[40:72], {"kv": ss.PagedRows(pool, [0, 1])})
        right = np.zeros((2, 16, 2, 4, 8), np.uint8)
        s.restore(r, {"kv": ss.PagedRows(right, [0, 1])})
        assert right.reshape(32, 2, 4, 8).tobytes() == kv.tobytes()
