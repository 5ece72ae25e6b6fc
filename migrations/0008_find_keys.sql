-- snapstore schema v8: find keys. See docs/format.md (snapshots.find_key).
-- An integer that match() finds its candidates by: a chained XXH3-64 over the whole 256-token
-- blocks of a snapshot's tokens (~0.3 us a block, against ~2 us for the BLAKE3 anchor chain).
-- Not trusted: every candidate it finds is compared token by token. The open that applies this
-- migration fills it for existing snapshots in the same transaction (Txn.backfill_find_keys);
-- every insert derives it from the parent's (Txn.insert_snapshot); a row an older snapstore
-- inserted since (NULL, found through snapshots_unkeyed) is keyed by the next read-write open.
-- snapshots_find replaces snapshots_match: nothing looks snapshots up by anchor any more.
ALTER TABLE snapshots ADD COLUMN find_key INTEGER;
DROP INDEX snapshots_match;
CREATE INDEX snapshots_find ON snapshots(identity_id, namespace, find_key);
CREATE INDEX snapshots_unkeyed ON snapshots(id) WHERE find_key IS NULL;
