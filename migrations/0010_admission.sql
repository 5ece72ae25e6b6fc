-- snapstore schema v10: write admission. See docs/format.md ("Write admission").
-- sightings: prefixes a save under Store.open(admit="second_hit") has seen once and not yet
-- written. key: the first 8 bytes of BLAKE2b(identity key, namespace, the prefix's key) as a
-- signed integer (the rowid itself: about 20 bytes a row with its index); seen_at: Unix seconds.
-- A row goes when its prefix is seen again (the save is admitted), when it is older than the
-- window, or when the table holds more than the bound (oldest first).
CREATE TABLE sightings (
    key INTEGER PRIMARY KEY,
    seen_at REAL NOT NULL
);
CREATE INDEX sightings_age ON sightings(seen_at);
-- write_bucket: the token bucket of Budget(write_bytes_per_hour=N), shared by every process of
-- the store (one row, id 1). level: bytes of credit at time ``at`` (Unix seconds); it may be
-- negative (a debt: the last admitted save wrote more than the credit left).
CREATE TABLE write_bucket (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    level REAL NOT NULL,
    at REAL NOT NULL
);
-- names (issue 32, part 3): Store.name(ref, name, ttl_s=) pins a committed snapshot (and so its
-- chain) under a name, per identity and namespace. A named snapshot is never evicted, expired by
-- the store's TTL or retired by supersede (it is detached from its session instead) while the
-- name lives; expires: Unix seconds after which the name no longer protects it and is removed
-- (NULL: never). Deleting the snapshot (Store.delete, a stale identity's drop) removes its names.
CREATE TABLE names (
    identity_id INTEGER NOT NULL REFERENCES identities(id) ON DELETE CASCADE,
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    snapshot_id INTEGER NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
    created REAL NOT NULL,
    expires REAL,
    PRIMARY KEY (identity_id, namespace, name)
);
CREATE INDEX names_snapshot ON names(snapshot_id);
CREATE INDEX names_expiry ON names(expires) WHERE expires IS NOT NULL;
