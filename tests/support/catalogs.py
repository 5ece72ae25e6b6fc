"""Catalogs of older schema versions, made from a new one: what each migration added, taken out
again, so a test can open a store as an older snapstore left it (and the newest version number)."""

from __future__ import annotations

from snapstore.catalog.db import migrations_dir

# Schema v14 (0014_read_paths.sql) taken out: no read_paths.
UNDO_READ_PATHS = "DROP TABLE read_paths; "
# Schema v13 (0013_catalog_gen.sql) taken out too: no catalog_gen, none of its triggers.
UNDO_CATALOG_GEN = UNDO_READ_PATHS + "".join(f"DROP TRIGGER catalog_gen_{t}; " for t in (
    "snapshot_delete", "snapshot_update", "part_delete", "part_update", "part_chunk_delete",
    "part_chunk_update", "chunk_delete", "chunk_update", "identity_delete", "identity_update"))
UNDO_CATALOG_GEN += "DROP TABLE catalog_gen; "
# Schema v12 (0012_restore_rates.sql) taken out too: no restore_rates.
UNDO_RESTORE_RATES = UNDO_CATALOG_GEN + "DROP TABLE restore_rates; "
# Schema v11 (0011_imports.sql) taken out too: no snapshots.imported_from.
UNDO_IMPORTS = UNDO_RESTORE_RATES + "ALTER TABLE snapshots DROP COLUMN imported_from; "
# Schema v10 (0010_admission.sql) taken out too: no sightings, write_bucket or names.
UNDO_ADMISSION = UNDO_IMPORTS + "DROP TABLE sightings; DROP TABLE write_bucket; DROP TABLE names; "
# Schema v9 (0009_layout_keys.sql) taken out too: no snapshots.layout_key.
UNDO_LAYOUT_KEYS = UNDO_ADMISSION + "ALTER TABLE snapshots DROP COLUMN layout_key; "
# Schema v8 (0008_find_keys.sql) taken out too: no snapshots.find_key, the anchor index back.
UNDO_FIND_KEYS = (UNDO_LAYOUT_KEYS + "DROP INDEX snapshots_find; DROP INDEX snapshots_unkeyed; "
                  "ALTER TABLE snapshots DROP COLUMN find_key; "
                  "CREATE INDEX snapshots_match ON snapshots(identity_id, namespace, anchor); ")
LATEST_SCHEMA = migrations_dir()[-1][0]  # the user_version a read-write open migrates to
