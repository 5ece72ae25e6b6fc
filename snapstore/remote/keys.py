"""The shared tier's object layout and timing rules: key names, the lease TTL, the gc delete window.

Object layout below ``s3://BUCKET/PREFIX/`` (docs/format.md "Shared tier"), ``S`` = the scope
(BLAKE3 key of identity + namespace, 64 hex), so nothing crosses an identity or a tenant::

    snapstore-v1/c/S/<chunk id>                          chunk: the local chunk file's bytes
    snapstore-v1/m/S/<anchor>/<n:012d>-<prefix>-<content> manifest of one chain link
    snapstore-v1/u/S/<manifest name>                     last use of a manifest (LRU for the budget)
    snapstore-v1/l/<writer>-<nonce>                      lease: chunks a live upload may reference

Uploaders (``remote.upload_chain``), readers (``remote.find_chain``, ``remote.fetch``) and maintenance
(``remote.maint``) all name objects through this module only.
"""

from __future__ import annotations

import os
import time

from snapstore._config import env_seconds

__all__ = ["LAYOUT", "LEASE_TTL", "chunk_key", "gc_window", "lease_key", "manifest_key", "pause_point", "use_key"]

LAYOUT = "snapstore-v1"
LEASE_TTL = 3600.0  # a lease older than this (by the server's clock) protects nothing


def gc_window() -> float:
    """Seconds a ``gc --remote`` may go on deleting after it listed the leases (``SNAPSTORE_REMOTE_GC_WINDOW_S``).

    An upload that relies on a chunk that was already in the bucket waits twice this long after
    writing its lease and then checks the chunk again (see ``remote.upload_chain``).
    """
    return env_seconds("SNAPSTORE_REMOTE_GC_WINDOW_S", 2.0)


def chunk_key(scope: str, cid: bytes) -> str:
    """The object key of a chunk in a scope."""
    return f"{LAYOUT}/c/{scope}/{cid.hex()}"


def manifest_key(scope: str, name: str) -> str:
    """The object key of a manifest in a scope."""
    return f"{LAYOUT}/m/{scope}/{name}"


def use_key(scope: str, name: str) -> str:
    """The object key of a manifest's last-use marker."""
    return f"{LAYOUT}/u/{scope}/{name}"


def lease_key(writer: str, nonce: str) -> str:
    """The object key of one upload's lease."""
    return f"{LAYOUT}/l/{writer}-{nonce}"


def pause_point(point: str) -> None:
    """Test hook: ``SNAPSTORE_TEST_REMOTE_PAUSE=point:seconds`` sleeps there (forces race windows)."""
    spec = os.environ.get("SNAPSTORE_TEST_REMOTE_PAUSE", "")
    if spec.startswith(point + ":"):
        time.sleep(float(spec.split(":", 1)[1]))
