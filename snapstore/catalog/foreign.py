"""Another program's SQLite database where a store's catalog would be (``snapstore.db``): recognised
before anything is written to it or created beside it, and refused (a store opened in the wrong
directory must not migrate, switch to WAL or litter someone else's database)."""

from __future__ import annotations

import os
from typing import Any

from snapstore._errors import StoreFormatError

__all__ = ["foreign_connection", "foreign_error", "foreign_file"]


def foreign_connection(c: Any, application_id: int) -> bool:
    """Whether another program made ``c``'s database (a schema, or a user_version, without snapstore's
    ``application_id``); not a snapstore catalog, nor an empty file a new store fills."""
    if c.pragma("application_id") == application_id:
        return False
    return bool(c.pragma("user_version") or c.execute("SELECT 1 FROM sqlite_schema LIMIT 1").fetchone())


def foreign_file(path: str, application_id: int) -> bool:
    """:func:`foreign_connection` from the file's 100-byte SQLite header, before a store creates anything
    beside it (no connection, nothing written). False when unsure: a header not yet checkpointed from
    its WAL is judged by the connection's own check."""
    try:  # not through a link, never blocking on a FIFO (check_tree refused both a moment before)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        head = os.pread(fd, 100, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(head) < 100 or not head.startswith(b"SQLite format 3\x00"):
        return False  # missing, empty, or not SQLite at all: the connection reports it
    app, version, schema_cookie = (int.from_bytes(head[i:i + 4], "big") for i in (68, 60, 40))
    return app != application_id and bool(version or schema_cookie)


def foreign_error(path: str) -> StoreFormatError:
    """The refusal of another program's SQLite database where a store's catalog would be."""
    return StoreFormatError(f"{path} is another program's SQLite database, not a snapstore catalog; nothing was "
                            "changed: open the store in a directory of its own")
