"""Shared fixtures (a fresh store directory, a store, an isolated environment) and, for the tests that
import them from here, the names of the support package (tests/support/).

tests/ mirrors the code: a folder per package (tests/README.md). A few test modules share helpers with
another folder's (``from test_plan_memo import _chain``); so every folder holding tests is on the
import path before any is collected, whatever the order (pytest refuses two test modules of one name).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted({d for d, _, files in os.walk(_TESTS) if "__pycache__" not in d
                       and any(f.startswith("test_") and f.endswith(".py") for f in files)}):
    if _folder not in sys.path:
        sys.path.append(_folder)

from support import IDENT, LAYOUT, empty_like_state, make_state, open_store, part_hashes, sha  # noqa: E402

__all__ = ["IDENT", "LAYOUT", "empty_like_state", "make_state", "part_hashes", "sha"]

LIBRARY_ENV = ("SNAPSTORE_DISK_MIB", "SNAPSTORE_RAM_MIB", "SNAPSTORE_MAX_ENTRIES", "SNAPSTORE_TTL",
               "SNAPSTORE_RESERVE_MIB", "SNAPSTORE_CHUNK_MIB", "SNAPSTORE_STAGING_MIB", "SNAPSTORE_CODEC",
               "SNAPSTORE_CHECK_ROWS", "SNAPSTORE_PENDING_LEASE_S", "SNAPSTORE_DIRECT_IO",
               "SNAPSTORE_ASYNC_COPY_MIB")


@pytest.fixture
def store_dir(tmp_path: Any) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def store(store_dir: str) -> Any:
    s = open_store(store_dir)  # support.DEFAULTS: 4 KiB chunks, 64 KiB staging, no reserve, check_rows
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _isolate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Tests never touch the user's real cache dir."""
    monkeypatch.setenv("SNAPSTORE_DIR", str(tmp_path / "default-store"))
    for k in LIBRARY_ENV:  # the library's own knobs only; test knobs (SNAPSTORE_LONG, ...) stay
        monkeypatch.delenv(k, raising=False)
