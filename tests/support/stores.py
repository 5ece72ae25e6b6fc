"""One store factory for the tests: ``Store.open`` with small chunks, a small staging buffer and no
disk reserve, so a few KiB of state already spans several chunks. A module with other needs names
them once (``store_factory(layout=..., check_rows=None)``) instead of writing its own opener."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Protocol

import snapstore as ss
from support.model import IDENT, LAYOUT

# The settings every factory starts from; ``check_rows=None`` (or any option set to None) means
# "the library's default", as Store.open reads it.
DEFAULTS: dict[str, Any] = {
    "identity": IDENT, "layout": LAYOUT, "chunk_bytes": 4096, "staging_bytes": 64 * 1024,
    "budget": ss.Budget(reserve_bytes=0), "check_rows": True,
}


class StoreFactory(Protocol):
    """Opens a store at ``path``; keyword options override the factory's settings."""

    def __call__(self, path: str | os.PathLike[str], **options: Any) -> ss.Store: ...


def small_budget(disk: int) -> ss.Budget:
    """A disk budget of ``disk`` bytes, no reserve and no RAM tier (the campaigns' budget)."""
    return ss.Budget(disk_bytes=disk, reserve_bytes=0, ram_bytes=0)


def open_store(path: str | os.PathLike[str], **options: Any) -> ss.Store:
    """Open a store with :data:`DEFAULTS` overridden by ``options``. ``disk=N`` is short for
    ``budget=small_budget(N)``."""
    opts = {**DEFAULTS, **options}
    disk = opts.pop("disk", None)
    if disk is not None:
        opts["budget"] = small_budget(disk)
    return ss.Store.open(os.fspath(path), **opts)


def store_factory(**settings: Any) -> StoreFactory:
    """A store opener whose settings are :data:`DEFAULTS` overridden by ``settings`` (and, per call,
    by that call's options)."""
    def open_(path: str | os.PathLike[str], **options: Any) -> ss.Store:
        return open_store(path, **{**settings, **options})
    return open_


def tree_bytes(root: str) -> dict[str, str]:
    """Every entry under ``root`` with its bytes' digest (a directory: '/'): what a command that
    should write nothing in a store must leave exactly as it was."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = "/"
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(f.read()).hexdigest()
    return out
