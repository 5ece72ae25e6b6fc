"""The catalog's schema as shipped: the migrations (read from the package once per process) and, for
a read-only connection to an older catalog it may not migrate, the TEMP views that stand in for the
columns and tables the newer migrations add. :class:`snapstore.catalog.db.Database` applies both.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import apsw

__all__ = ["compat_views", "migrations_dir"]


def migrations_dir() -> list[tuple[int, str, str]]:
    """The shipped migrations as (number, name, sql), in order: read from the package once per
    process, so that a process which drops privileges after importing snapstore (a service that
    starts as root, a forked child under another user) still opens stores when it can no longer
    read the package's directory."""
    return list(_MIGRATIONS or _read_migrations())


_MIGRATIONS: list[tuple[int, str, str]] = []


def _read_migrations() -> list[tuple[int, str, str]]:
    found: list[tuple[int, str, str]] = []
    try:
        root: Any = resources.files("snapstore.migrations")
        entries = [(p.name, p.read_text()) for p in root.iterdir() if p.name.endswith(".sql")]
    except (ModuleNotFoundError, FileNotFoundError):
        src = Path(__file__).resolve().parent.parent / "migrations"
        entries = [(p.name, p.read_text()) for p in src.glob("*.sql")]
    for name, sql in entries:
        found.append((int(name.split("_", 1)[0]), name, sql))
    found.sort()
    _MIGRATIONS[:] = found
    return found



# A read-only connection cannot migrate a catalog written by an older version; these TEMP views
# (which shadow the main tables for unqualified names) give its queries the columns the newer
# migrations add, with their defaults, keyed by the migration that adds them. Those of ``snapshots``
# share one view (two cannot share its name); a v<8 catalog has no find keys: nothing read-only matches.
_COMPAT_VIEWS: dict[int, list[str]] = {
    2: ["CREATE TEMP TABLE owners(id TEXT PRIMARY KEY, kernel TEXT NOT NULL, host TEXT NOT NULL, "
        "pid INTEGER NOT NULL, lease REAL NOT NULL, renewed REAL NOT NULL, created REAL NOT NULL)"],
    3: ["CREATE TEMP VIEW chunks AS SELECT *, NULL AS quarantined FROM main.chunks"],
    5: ["CREATE TEMP TABLE row_prefixes(snapshot_id INTEGER NOT NULL, n_tokens INTEGER NOT NULL, "
        "key BLOB NOT NULL, PRIMARY KEY (snapshot_id, n_tokens))"],
    7: ["CREATE TEMP VIEW parts AS SELECT *, NULL AS tokens_per_row FROM main.parts"],
    10: ["CREATE TEMP TABLE names(identity_id INTEGER NOT NULL, namespace TEXT NOT NULL, name TEXT NOT NULL, "
         "snapshot_id INTEGER NOT NULL, created REAL NOT NULL, expires REAL, "
         "PRIMARY KEY (identity_id, namespace, name))"],  # no names before schema 10
    12: ["CREATE TEMP TABLE restore_rates(tier TEXT PRIMARY KEY, w REAL NOT NULL, su REAL NOT NULL, "
         "sv REAL NOT NULL, suu REAL NOT NULL, suv REAL NOT NULL, samples INTEGER NOT NULL, "
         "updated REAL NOT NULL)"],  # nothing measured before schema 12
}
_COMPAT_SNAPSHOT_COLS: dict[int, str] = {4: "0 AS shared", 8: "NULL AS find_key", 9: "NULL AS layout_key",
                                          11: "NULL AS imported_from"}


def compat_views(c: apsw.Connection) -> None:
    """On a read-only connection to an older catalog: the TEMP views and tables its queries need."""
    ver = int(str(c.pragma("user_version")))
    for num, stmts in sorted(_COMPAT_VIEWS.items()):
        if 0 < ver < num:
            for sql in stmts:
                c.execute(sql)
    cols = [col for num, col in sorted(_COMPAT_SNAPSHOT_COLS.items()) if 0 < ver < num]
    if cols:
        c.execute(f"CREATE TEMP VIEW snapshots AS SELECT *, {', '.join(cols)} FROM main.snapshots")
