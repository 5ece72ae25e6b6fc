-- snapstore schema v5: block-granular prefix index. See docs/format.md (row_prefixes).
-- For layouts that declare `tokens_per_row` (row streams only, no fixed parts), a save records one
-- row per index step it adds: `key` names tokens [0, n_tokens) of the snapshot exactly (a chained
-- BLAKE3 over steps), for every multiple n_tokens of the step in (base_tokens, snapshot n_tokens].
-- match() finds the longest common prefix of a prompt with any stored snapshot by probing it.
CREATE TABLE row_prefixes(
  snapshot_id INTEGER NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
  n_tokens    INTEGER NOT NULL CHECK (n_tokens > 0),
  key         BLOB NOT NULL,
  PRIMARY KEY (snapshot_id, n_tokens)
) STRICT, WITHOUT ROWID;
CREATE INDEX row_prefixes_key ON row_prefixes(key);
