"""docs/format.md §13's test vectors: recomputed from the spec's definitions with hashlib, blake3 and
xxhash alone (never snapstore's own functions), and reproduced byte for byte by a real save."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import apsw
import blake3
import numpy as np
import pytest
import xxhash

import snapstore as ss

FORMAT_MD = Path(__file__).resolve().parents[2] / "docs" / "format.md"
IDENTITY = {"build": "eng-1.4.2", "pack": "sha256:abc", "kv": "f16", "mtp": True, "extra": {"flash_attn": "1"}}
RAW = bytes(range(256))  # the fixed part `rec`, float32 [64]
_ROW = re.compile(r"^\| `(\w+)` \|.*\| `((?:id-)?[0-9a-f]+)` \|$")


def documented() -> dict[str, str]:
    """The vector table of format.md §13: name -> value."""
    text = FORMAT_MD.read_text(encoding="utf-8")
    section = text.split("## 13. Test vectors", 1)[1]
    return {m[1]: m[2] for line in section.splitlines() if (m := _ROW.match(line))}


# -- the spec's definitions, written out independently of snapstore ------------------------------

def identity_key() -> str:
    canon = json.dumps(IDENTITY, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "id-" + hashlib.sha256(canon.encode("utf-8")).hexdigest()[:32]


def scope(dtype: str | None, shape: list[int] | None) -> bytes:
    if dtype is None:  # the v1 scope of older stores
        return blake3.blake3(f"snapstore scope v1\0{identity_key()}\0".encode()).digest()
    return blake3.blake3(f"snapstore scope v2\0{identity_key()}\0\0{dtype}\0{json.dumps(shape)}".encode()).digest()


def chain(tokens: list[int]) -> list[bytes]:
    raw = b"".join(struct.pack("<Q", t) for t in tokens)
    out = [blake3.blake3(b"snapstore tokens v1").digest(length=16)]
    for i in range(len(tokens) // 256):
        out.append(blake3.blake3(out[-1] + raw[i * 2048:(i + 1) * 2048]).digest(length=16))
    return out


def prefix_key(tokens: list[int], n: int) -> bytes:
    k = n // 256
    tail = b"".join(struct.pack("<Q", t) for t in tokens[256 * k:n])
    return blake3.blake3(chain(tokens)[k] + tail + struct.pack("<Q", n)).digest(length=16)


def find_key(tokens: list[int], n: int) -> int:
    """§4.4: the find key of the prefix of n tokens (unsigned)."""
    raw = b"".join(struct.pack("<Q", t) for t in tokens)
    key = 0x736E617073746F72
    for i in range(n // 256):
        key = xxhash.xxh3_64_intdigest(raw[i * 2048:(i + 1) * 2048], seed=key)
    return key


def header(raw: bytes) -> bytes:
    head = struct.pack("<8sHBBIQQ16s", b"SNAPCHK\x00", 1, 0, 0, 64, len(raw), len(raw), xxhash.xxh3_128_digest(raw))
    return head + xxhash.xxh3_64_digest(head) + bytes(8)


def computed() -> dict[str, str]:
    """Every vector of §13 from the definitions of §3.1, §3.4, §4 and §5."""
    cid = blake3.blake3(RAW, key=scope("float32", [64])).digest()
    content = blake3.blake3(b"content v2" + bytes(16) + b"|rec:0:float32:[64]:0:0:" + cid).digest(length=16)
    seq = list(range(300))
    return {
        "identity_key": identity_key(),
        "scope_v2_f16": scope("float16", [2, 8, 128]).hex(),
        "scope_v1": scope(None, None).hex(),
        "scope_rec": scope("float32", [64]).hex(),
        "chunk_id_rec": cid.hex(),
        "checksum_rec": xxhash.xxh3_128_digest(RAW).hex(),
        "header_rec": header(RAW).hex(),
        "content_key_rec": content.hex(),
        "token_seed": chain([])[0].hex(),
        "anchor_300": chain(seq)[1].hex(),
        "prefix_key_300": prefix_key(seq, 300).hex(),
        "prefix_key_3": prefix_key([1, 2, 3], 3).hex(),
        "find_seed": f"{find_key([], 0):016x}",
        "find_key_300": f"{find_key(seq, 300):016x}",
    }


def test_documented_vectors_follow_from_the_definitions() -> None:
    doc = documented()
    assert doc, "format.md has no §13 vector table"
    assert doc == computed()


@pytest.mark.parametrize("codec", ["raw", "zstd"])  # zstd falls back to raw: 256 distinct bytes do not shrink
def test_a_real_save_writes_the_documented_bytes(tmp_path: Path, codec: str) -> None:
    doc = documented()
    ident = ss.Identity(**IDENTITY)  # type: ignore[arg-type]
    layout = ss.Layout(fixed={"rec": ss.Fixed("float32", (64,))}, rows={})
    state = {"rec": np.frombuffer(RAW, dtype=np.float32).copy()}
    root = tmp_path / "store"
    with ss.Store.open(str(root), identity=ident, layout=layout, budget=ss.Budget(reserve_bytes=0),
                       chunk_bytes=4096, staging_bytes=65536, codec=codec) as s:
        assert ident.key == doc["identity_key"]
        short = s.save([1, 2, 3], state).snapshot_id
        long_ = s.save(list(range(300)), state).snapshot_id
    db = apsw.Connection(str(root / "snapstore.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        rows = {sid: (bytes(a), bytes(p), bytes(c)) for sid, a, p, c in db.execute(
            "SELECT id, anchor, prefix_key, content_key FROM snapshots")}
        finds = {sid: f"{k & (2**64 - 1):016x}" for sid, k in db.execute("SELECT id, find_key FROM snapshots")}
        chunks = [(bytes(i), bytes(c), bytes(k)) for i, c, k in db.execute("SELECT id, checksum, scope FROM chunks")]
    finally:
        db.close()
    assert rows[short] == (bytes.fromhex(doc["token_seed"]), bytes.fromhex(doc["prefix_key_3"]),
                           bytes.fromhex(doc["content_key_rec"]))
    assert rows[long_] == (bytes.fromhex(doc["anchor_300"]), bytes.fromhex(doc["prefix_key_300"]),
                           bytes.fromhex(doc["content_key_rec"]))
    assert finds == {short: doc["find_seed"], long_: doc["find_key_300"]}  # stored signed, the same 64 bits
    assert chunks == [(bytes.fromhex(doc["chunk_id_rec"]), bytes.fromhex(doc["checksum_rec"]),
                       bytes.fromhex(doc["scope_rec"]))]  # one chunk: the second save deduplicates
    cid = doc["chunk_id_rec"]
    data = (root / "blobs" / cid[:2] / cid).read_bytes()
    assert data[:64].hex() == doc["header_rec"] and data[64:] == RAW
    assert os.path.getsize(root / "blobs" / cid[:2] / cid) == 64 + len(RAW)
