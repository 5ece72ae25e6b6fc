"""Manifests parse as pure data: round trip, and every kind of damage is refused (no server needed)."""

from __future__ import annotations

import json
from typing import Any

import blake3
import pytest

import snapstore as ss
from snapstore import ConfigError, CorruptionError
from snapstore._identity import canonical_json
from snapstore.remote.bucket_restore import describe_remote
from snapstore.remote.find_chain import RemoteHit
from snapstore.remote.manifest import ChunkEntry, Manifest, PartEntry, decode, encode, parse_name
from snapstore.remote.s3client import parse_url


def _m(**kw: object) -> Manifest:
    base = dict(identity_key="id-x", identity='{"build":"b"}', namespace="", n_tokens=3, base_tokens=0,
                token_width=4, tokens=b"\x01\x00\x00\x00" * 3, anchor=b"a" * 16, prefix_key=b"p" * 16,
                content_key=b"c" * 16, parent=None, matchable=True, logical_bytes=8, created=1.5, writer="w",
                parts=(PartEntry("kv", 1, "float16", (2,), None, 0, 3, 8,
                                 (ChunkEntry(b"i" * 32, 8, 72, 0, b"s" * 16),)),))
    base.update(kw)
    return Manifest(**base)  # type: ignore[arg-type]


def test_round_trip_and_name() -> None:
    m = _m()
    assert decode(encode(m)) == m
    assert parse_name(m.name) == (m.anchor, 3, m.prefix_key, m.content_key)
    assert parse_name("../../etc/passwd") is None


@pytest.mark.parametrize("mutate", [
    lambda d: d["body"].__setitem__("n_tokens", 4),                      # checksum no longer matches
    lambda d: d.__setitem__("v", 2),                                      # a version this reader does not know
    lambda d: d.__setitem__("format", "pickle"),
])
def test_tampering_is_refused(mutate: object) -> None:
    doc = json.loads(encode(_m()))
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(CorruptionError):
        decode(json.dumps(doc).encode())


@pytest.mark.parametrize("kw", [
    {"tokens": b"\x00" * 5},                               # not n - base tokens
    {"base_tokens": 1},                                    # a non-root without a parent
    {"parent": "not-a-name", "base_tokens": 1, "tokens": b"\x00" * 8},
    {"parts": (PartEntry("kv", 1, "float16", (2,), None, 0, 3, 9, (ChunkEntry(b"i" * 32, 8, 72, 0, b"s" * 16),)),)},
])
def test_inconsistent_bodies_are_refused_even_with_a_valid_checksum(kw: dict[str, object]) -> None:
    with pytest.raises(CorruptionError):
        decode(encode(_m(**kw)))


def test_garbage_and_oversize() -> None:
    for data in (b"", b"\xff\xfe", b"[1,2]", b'{"format":"snapstore-manifest","v":1,"body":{"x":NaN}}'):
        with pytest.raises(CorruptionError):
            decode(data)


def test_remote_urls_are_checked() -> None:
    assert parse_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    for bad in ("http://x/y", "s3://", "s3://B/x", "s3://bkt/../x", "s3://bkt/a b"):
        with pytest.raises(ConfigError):
            parse_url(bad)



def _rows_part(per: int | None, kind: int = 1) -> PartEntry:
    """A segment of 4 float32 (2,) rows, saved at ``per`` tokens per row."""
    return PartEntry("kv", kind, "float32", (2,), None, 0, 4, 32, (ChunkEntry(b"i" * 32, 32, 96, 0, b"s" * 16),), per)


def _link(per: int | None) -> Manifest:
    return _m(n_tokens=64, tokens=b"\x01\x00\x00\x00" * 64, logical_bytes=32, parts=(_rows_part(per),))


def _signed(doc: dict[str, Any]) -> bytes:
    """A forged body with a valid checksum: what a writer that means harm could publish."""
    doc["blake3"] = blake3.blake3(canonical_json(doc["body"]).encode()).hexdigest()
    return json.dumps(doc).encode()


def test_a_part_carries_its_granularity_and_older_manifests_read_and_encode_as_before() -> None:
    """tokens_per_row travels per part; a manifest without it (written before schema v7) decodes to
    None and re-encodes to the same bytes (its checksum unchanged)."""
    assert decode(encode(_link(16))).parts[0].tokens_per_row == 16
    old = _m()
    assert "tokens_per_row" not in json.loads(encode(old))["body"]["parts"][0]
    assert decode(encode(old)).parts[0].tokens_per_row is None and encode(decode(encode(old))) == encode(old)


@pytest.mark.parametrize("per", [0, -1, True, "16", 1.5, 1 << 40])
def test_a_bad_granularity_is_refused(per: object) -> None:
    doc = json.loads(encode(_link(16)))
    doc["body"]["parts"][0]["tokens_per_row"] = per
    with pytest.raises(CorruptionError, match="tokens_per_row"):
        decode(_signed(doc))


def test_a_granularity_on_a_fixed_part_is_refused() -> None:
    doc = json.loads(encode(_m()))
    doc["body"]["parts"][0].update(kind=0, tokens_per_row=4)
    with pytest.raises(CorruptionError, match="tokens_per_row"):
        decode(_signed(doc))


@pytest.mark.parametrize(("saved", "ok"), [(16, True), (None, True), (8, False), (1, False)])
def test_a_shared_tier_chain_of_another_granularity_is_refused_before_a_byte_is_read(
        saved: int | None, ok: bool) -> None:
    """The plan of a streamed restore is built from the manifests: a chain saved at 16 tokens per row
    plans under a 16-token layout (and a manifest from before v7, None, as before); under 8 or 1
    tokens per row it raises DestinationError, before a chunk object is fetched."""
    hit = RemoteHit("scope", "", (decode(encode(_link(saved))),))
    layout = ss.Layout(rows={"kv": ss.Rows("float32", (2,))}, tokens_per_row=16)
    if ok:
        assert describe_remote(hit, layout, set(), 0).rows == {"kv": 4}
    else:
        with pytest.raises(ss.DestinationError, match="tokens per row"):
            describe_remote(hit, layout, set(), 0)
