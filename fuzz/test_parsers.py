"""Fuzz everything that parses stored bytes: malformed input -> SnapstoreError, never a crash, hang,
huge allocation or a path outside the store.

Targets: chunk headers (parse_header), payloads (decode_payload, zstd bombs included), token blobs
(decode_tokens), and catalog rows reached through the public restore/verify (shape JSON, negative and
huge sizes/rows, bogus chunk ids, broken parent links, token blobs).

Example counts follow the Hypothesis profile (tests/README.md): twice its max_examples (ci: 60; long: 2000).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from typing import Any

import apsw
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import snapstore as ss
from snapstore._tokens import decode_tokens
from snapstore.chunks.chunkfile import (
    CODEC_RAW,
    CODEC_ZSTD,
    CODEC_ZSTD_SHUFFLE2,
    HEADER_SIZE,
    ChunkHeader,
    checksum,
    decode_payload,
    parse_header,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers_proc import IDENT, LAYOUT  # noqa: E402

EXAMPLES = 2 * settings.default.max_examples
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


def _valid_header(codec: int = CODEC_RAW, raw_len: int = 4096, payload_len: int = 4096) -> bytes:
    return ChunkHeader(codec, raw_len, payload_len, bytes(16)).pack()


@FUZZ
@given(st.binary(max_size=200))
def test_parse_header_random(data: bytes) -> None:
    try:
        h = parse_header(data)
    except ss.CorruptionError:
        return
    assert 0 <= h.raw_len <= 1 << 32


@FUZZ
@given(st.integers(0, HEADER_SIZE - 1), st.integers(1, 255),
       st.sampled_from([CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_SHUFFLE2]))
def test_parse_header_bitflips(pos: int, x: int, codec: int) -> None:
    data = bytearray(_valid_header(codec, 4096, 4096 if codec == CODEC_RAW else 100))
    data[pos] ^= x
    try:
        parse_header(bytes(data))
    except ss.CorruptionError:
        return


@FUZZ
@given(st.sampled_from([CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_SHUFFLE2]), st.integers(0, 1 << 16), st.binary(max_size=4096))
def test_decode_payload_garbage(codec: int, raw_len: int, payload: bytes) -> None:
    h = ChunkHeader(codec, raw_len, len(payload), bytes(16))
    out = memoryview(bytearray(raw_len))
    try:
        decode_payload(h, payload, out)
    except ss.CorruptionError:
        return
    assert len(out) == raw_len


@FUZZ
@given(st.integers(1, 1 << 20), st.sampled_from([CODEC_ZSTD, CODEC_ZSTD_SHUFFLE2]))
def test_decode_payload_zstd_bomb(raw_len: int, codec: int) -> None:
    """A tiny payload that expands to 64 MiB must not be inflated past the declared raw length."""
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    h = ChunkHeader(codec, raw_len, len(bomb), bytes(16))
    with pytest.raises(ss.CorruptionError):
        decode_payload(h, bomb, memoryview(bytearray(raw_len)))


@FUZZ
@given(st.binary(max_size=256), st.integers(-4, 12), st.integers(-10, 100))
def test_decode_tokens(blob: bytes, width: int, count: int) -> None:
    try:
        arr = decode_tokens(blob, width, count)
    except ss.SnapstoreError:
        return
    assert len(arr) == count and (arr.size == 0 or int(arr.min()) >= 0)


# -- catalog rows through the public API ------------------------------------------------------------
_TEMPLATE: dict[str, Any] = {}


def _template() -> dict[str, Any]:
    if not _TEMPLATE:
        d = tempfile.mkdtemp(prefix="snapstore-fuzz-")
        path = os.path.join(d, "store")
        s = ss.Store.open(path, identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0),
                          chunk_bytes=4096, staging_bytes=65536)
        rng = np.random.default_rng(0)
        toks = rng.integers(0, 1000, 120)
        rows = {n: rng.integers(0, 256, 120 * sp.row_bytes, dtype=np.uint8).view(sp.dtype).reshape(
            (120, *sp.row_shape)) for n, sp in LAYOUT.rows.items()}
        fixed = {n: rng.integers(0, 256, sp.nbytes, dtype=np.uint8).view(sp.dtype).reshape(sp.shape)
                 for n, sp in LAYOUT.fixed.items()}
        ids = []
        for n in (40, 120):
            r = s.save(toks[:n], {**{k: v[:n] for k, v in rows.items()}, **fixed})
            ids.append(r.snapshot_id)
        s.close()
        _TEMPLATE.update(dir=d, path=path, ids=ids, toks=toks, rows=rows, fixed=fixed)
    return _TEMPLATE


_MUTATIONS = st.one_of(
    st.tuples(st.just("parts.shape"), st.one_of(st.text(max_size=30), st.sampled_from(
        ["[]", "[-1]", "[1e9]", "[99999999999, 99999999999]", "{}", "null", "[2, 8, \"x\"]", "[" * 50]))),
    st.tuples(st.sampled_from(["parts.row_start", "parts.row_end", "parts.nbytes", "chunks.raw_len",
                               "chunks.stored_len", "snapshots.n_tokens", "snapshots.base_tokens",
                               "snapshots.depth", "chunks.codec"]),
              st.one_of(st.integers(-(1 << 40), 1 << 40), st.sampled_from([-1, 0, 1, (1 << 62), 4095, 4097]))),
    st.tuples(st.just("chunks.id"), st.one_of(st.binary(min_size=32, max_size=32),
                                              st.sampled_from([b"/" * 32, b"\x00" * 32,
                                                               b"../../../../../etc/passwd".ljust(32, b"\x00")]))),
    st.tuples(st.just("snapshots.parent_id"), st.sampled_from([None, 0, 1, 2, 999, -5])),
    st.tuples(st.just("snapshots.tokens"), st.binary(max_size=600)),
    st.tuples(st.just("snapshots.token_width"), st.sampled_from([4, 8])),
    st.tuples(st.just("parts.dtype"), st.sampled_from(["", "float16", "float32", "object", "V8", "<U9"])),
    st.tuples(st.just("chunks.checksum"), st.binary(max_size=20)),
)


def _mutate(db: str, mutations: list[tuple[str, Any]], target: int) -> None:
    c = apsw.Connection(db)
    c.pragma("foreign_keys", False)
    for what, value in mutations:
        table, col = what.split(".")
        try:
            if table == "chunks" and col == "id":
                (old,) = c.execute("SELECT chunk_id FROM part_chunks WHERE snapshot_id = ? LIMIT 1",
                                   (target,)).fetchone()
                c.execute("UPDATE chunks SET id = ? WHERE id = ?", (value, old))
                c.execute("UPDATE part_chunks SET chunk_id = ? WHERE chunk_id = ?", (value, old))
            elif table == "snapshots":
                c.execute(f"UPDATE snapshots SET {col} = ? WHERE id = ?", (value, target))
            elif table == "parts":
                c.execute(f"UPDATE parts SET {col} = ? WHERE snapshot_id = ?", (value, target))
            else:
                c.execute(f"UPDATE chunks SET {col} = ? WHERE id IN (SELECT chunk_id FROM part_chunks "
                          "WHERE snapshot_id = ?)", (value, target))
        except apsw.ConstraintError:
            pass  # a CHECK constraint refused it: SQLite itself keeps that shape out
    c.close()


def _with_watchdog(store: ss.Store, fn: Any, seconds: float = 10.0) -> Any:
    """Run fn; interrupt SQLite if it runs too long (a hang becomes a test failure, not a stuck CI)."""
    conn = store._repo.db.conn()
    fired = []
    timer = threading.Timer(seconds, lambda: (fired.append(1), conn.interrupt()))
    timer.start()
    try:
        return fn()
    finally:
        timer.cancel()
        assert not fired, "operation on a corrupt catalog did not finish (hang)"


CATALOG = settings(max_examples=max(10, EXAMPLES // 3), deadline=None, suppress_health_check=list(HealthCheck))


@CATALOG
@given(st.lists(_MUTATIONS, min_size=1, max_size=3), st.sampled_from([0, 1]))
def test_catalog_rows_through_restore_and_verify(mutations: list[tuple[str, Any]], which: int) -> None:
    t = _template()
    work = tempfile.mkdtemp(prefix="snapstore-fuzzw-")
    try:
        path = os.path.join(work, "store")
        shutil.copytree(t["path"], path)
        target = t["ids"][which]
        _mutate(os.path.join(path, "snapstore.db"), mutations, target)
        outside_before = set(os.listdir(work))
        try:
            s = ss.Store.open(path, identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0),
                              chunk_bytes=4096, staging_bytes=65536)
        except ss.SnapstoreError:
            return
        try:
            for sid, n in zip(t["ids"], (40, 120)):
                into = {k: np.zeros_like(v[:n]) for k, v in t["rows"].items()}
                into.update({k: np.zeros_like(v) for k, v in t["fixed"].items()})
                try:
                    _with_watchdog(s, lambda sid=sid, into=into: s.restore(sid, into=into))
                except ss.SnapstoreError:
                    continue
                for k, v in t["rows"].items():
                    assert into[k].tobytes() == v[:n].tobytes(), f"restore of corrupt catalog gave wrong {k}"
                for k, v in t["fixed"].items():
                    assert into[k].tobytes() == v.tobytes()
            try:
                _with_watchdog(s, lambda: s.match(t["toks"]))
                _with_watchdog(s, lambda: s.verify(deep=True))
            except ss.SnapstoreError:
                pass
        finally:
            try:
                s.close()
            except ss.SnapstoreError:
                pass
        assert set(os.listdir(work)) == outside_before, "something was created outside the store"
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("bogus", [b"", b"../../etc/passwd", b"\x01" * 31, b"\x02" * 33],
                         ids=["empty", "path", "short", "long"])
@pytest.mark.parametrize("op", ["restore", "verify"])
def test_bogus_chunk_id_length(bogus: bytes, op: str) -> None:
    t = _template()
    work = tempfile.mkdtemp(prefix="snapstore-fuzzw-")
    try:
        path = os.path.join(work, "store")
        shutil.copytree(t["path"], path)
        _mutate(os.path.join(path, "snapstore.db"), [("chunks.id", bogus)], t["ids"][0])
        s = ss.Store.open(path, identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0),
                          chunk_bytes=4096, staging_bytes=65536)
        try:
            if op == "restore":
                into = {k: np.zeros_like(v[:40]) for k, v in t["rows"].items()}
                into.update({k: np.zeros_like(v) for k, v in t["fixed"].items()})
                with pytest.raises(ss.RestoreError) as ei:
                    s.restore(t["ids"][0], into=into)
                assert not ei.value.touched
            else:
                rep = s.verify(deep=True)
                assert not rep.ok
        finally:
            s.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_checksum_is_stable() -> None:
    assert checksum(b"abc") == checksum(memoryview(b"abc"))


# -- export file headers (docs/format.md §14): a checksummed header may still be hostile ---------------
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False)
                     | st.text(max_size=20), lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=8)


def _export_doc() -> dict[str, Any]:
    import base64
    import json

    from snapstore.transfer.format import ChainLink, ChunkEntry, ExportHeader, LinkPart, encode_header
    lay = ss.Layout(fixed={"rec": ss.Fixed("float32", (4,))}, rows={"kv": ss.Rows("uint8", (8,))})
    h = ExportHeader(IDENT, "", "n", lay, (
        ChainLink(2, 0, 4, base64.b64decode("AQAAAAIAAAA="), 32, (LinkPart("kv", 0, 2, 16, 1, (0,)),
                                                                 LinkPart("rec", 0, 0, 16, None, (1,)))),),
        (ChunkEntry(16, 80, 0, bytes(16), bytes(32), "kv"), ChunkEntry(16, 80, 0, bytes(16), bytes(32), "rec")),
        1, "w", 0.0)
    doc: dict[str, Any] = json.loads(encode_header(h))
    return doc


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, at + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, at + (i,))
    return out


@FUZZ
@given(st.data())
def test_export_header_mutations_raise_only_export_file_error(data: Any) -> None:
    import json

    from snapstore._identity import canonical_json
    from snapstore.transfer.format import decode_header
    doc = _export_doc()
    decode_header(canonical_json(doc).encode())  # the unmutated header parses
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(doc)[1:]))
        node = doc
        for k in path[:-1]:
            node = node[k]
        if data.draw(st.booleans()) and isinstance(node, dict):
            del node[path[-1]]
        else:
            node[path[-1]] = data.draw(_JSON)
    try:
        text = json.dumps(doc, sort_keys=True)
    except (TypeError, ValueError):
        return
    try:
        decode_header(text.encode())
    except ss.ExportFileError:
        pass
