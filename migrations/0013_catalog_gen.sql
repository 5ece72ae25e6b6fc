-- snapstore schema v13: the catalog generation (issue 31). See docs/format.md ("catalog_gen").
-- One counter that every change a restore plan depends on bumps, in the same transaction, by
-- trigger: a committed snapshot's row changed or deleted, a part or chunk reference changed or
-- deleted, a chunk's bytes, codec or quarantine changed or the chunk deleted, an identity deleted
-- or re-keyed. A process may keep the catalog rows it planned a committed snapshot from for as
-- long as the counter it read with them is current. What a save adds (a snapshot row, its parts
-- and references, written in the transaction that inserts the row or while it is pending; chunk
-- rows; reference counts) and the bookkeeping of restores (last_used, hits) do not bump it.
-- Triggers fire for every writer, older versions of snapstore that have the store open included.
-- nonce: 16 random bytes drawn once, so that rows kept from one catalog file are never taken for
-- another's (a store removed and created again at the same path starts its counter at 0 again).
CREATE TABLE catalog_gen (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    nonce BLOB NOT NULL,
    gen INTEGER NOT NULL
) STRICT;
INSERT INTO catalog_gen(id, nonce, gen) VALUES (1, randomblob(16), 0);

CREATE TRIGGER catalog_gen_snapshot_delete AFTER DELETE ON snapshots
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_snapshot_update AFTER UPDATE OF
    identity_id, namespace, parent_id, depth, n_tokens, base_tokens, token_width, tokens, anchor,
    prefix_key, content_key, session, state, owner, matchable, created, logical_bytes, shared,
    layout_key, imported_from ON snapshots WHEN OLD.state = 1
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_part_delete AFTER DELETE ON parts
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_part_update AFTER UPDATE ON parts
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_part_chunk_delete AFTER DELETE ON part_chunks
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_part_chunk_update AFTER UPDATE ON part_chunks
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_chunk_delete AFTER DELETE ON chunks
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_chunk_update AFTER UPDATE OF
    id, raw_len, stored_len, codec, checksum, scope, quarantined ON chunks
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_identity_delete AFTER DELETE ON identities
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;

CREATE TRIGGER catalog_gen_identity_update AFTER UPDATE OF id, key ON identities
BEGIN UPDATE catalog_gen SET gen = gen + 1 WHERE id = 1; END;
