"""The SQL statements a store's catalog connection runs, for tests that count what a call reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import snapstore as ss


@contextmanager
def statements(s: ss.Store) -> Iterator[list[str]]:
    """The SQL statements this thread's catalog connection runs inside (apsw's profile hook)."""
    seen: list[str] = []
    conn = s._repo.db.conn()
    conn.set_profile(lambda sql, _ns: seen.append(sql))
    try:
        yield seen
    finally:
        conn.set_profile(None)
