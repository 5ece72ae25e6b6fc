"""Shared fixtures: a fresh store directory, an identity and a small layout with every kind of part."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

import snapstore as ss

IDENT = ss.Identity(build="test-1.0+abc", pack="sha256:0123", kv="f16", mtp=True, extra={"flash_attn": "1"})
LAYOUT = ss.Layout(
    fixed={"rec.state": ss.Fixed("float32", (3, 5))},
    rows={"attn.kv": ss.Rows("float16", (2, 4, 8)), "mtp.kv": ss.Rows("float16", (2, 8), component="draft")},
)


def _np_dtype(name: str) -> np.dtype | None:
    try:
        return np.dtype(name)
    except TypeError:
        return None  # bfloat16/float8 without ml_dtypes: hand the core raw bytes


def make_state(layout: ss.Layout, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random parts for ``n`` tokens (row streams hold exactly n rows)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, spec in layout.fixed.items():
        raw = rng.integers(0, 256, spec.nbytes, dtype=np.uint8)
        dt = _np_dtype(spec.dtype)
        out[name] = raw.view(dt).reshape(spec.shape) if dt is not None else raw
    for name, spec in layout.rows.items():
        raw = rng.integers(0, 256, n * spec.row_bytes, dtype=np.uint8)
        dt = _np_dtype(spec.dtype)
        out[name] = raw.view(dt).reshape((n, *spec.row_shape)) if dt is not None else raw.reshape(n, spec.row_bytes)
    return out


def empty_like_state(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Zeroed destinations of the same shapes."""
    return {k: np.zeros_like(v) for k, v in state.items()}


def sha(buf: Any) -> str:
    """SHA-256 of a buffer's bytes."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(buf)).cast("B")).hexdigest()


def part_hashes(layout: ss.Layout, state: dict[str, np.ndarray], rows: dict[str, int]) -> dict[str, str]:
    """SHA-256 of every fixed part and of the valid rows of every stream."""
    out = {}
    for name, arr in state.items():
        if name in layout.rows:
            out[name] = sha(arr.reshape(-1).view(np.uint8)[: rows[name] * layout.rows[name].row_bytes])
        else:
            out[name] = sha(arr)
    return out


LIBRARY_ENV = ("SNAPSTORE_DISK_MIB", "SNAPSTORE_RAM_MIB", "SNAPSTORE_MAX_ENTRIES", "SNAPSTORE_TTL",
               "SNAPSTORE_RESERVE_MIB", "SNAPSTORE_CHUNK_MIB", "SNAPSTORE_STAGING_MIB", "SNAPSTORE_CODEC",
               "SNAPSTORE_CHECK_ROWS", "SNAPSTORE_PENDING_LEASE_S", "SNAPSTORE_DIRECT_IO",
               "SNAPSTORE_ASYNC_COPY_MIB")


@pytest.fixture
def store_dir(tmp_path: Any) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def store(store_dir: str) -> Any:
    s = ss.Store.open(store_dir, identity=IDENT, layout=LAYOUT, budget=ss.Budget(reserve_bytes=0),
                      chunk_bytes=4096, staging_bytes=64 * 1024, check_rows=True)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _isolate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Tests never touch the user's real cache dir."""
    monkeypatch.setenv("SNAPSTORE_DIR", str(tmp_path / "default-store"))
    for k in LIBRARY_ENV:  # the library's own knobs only; test knobs (SNAPSTORE_LONG, ...) stay
        monkeypatch.delenv(k, raising=False)
