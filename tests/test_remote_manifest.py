"""Manifests parse as pure data: round trip, and every kind of damage is refused (no server needed)."""

from __future__ import annotations

import json

import pytest

from snapstore import ConfigError, CorruptionError
from snapstore._manifest import ChunkEntry, Manifest, PartEntry, decode, encode, parse_name
from snapstore._s3client import parse_url


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
