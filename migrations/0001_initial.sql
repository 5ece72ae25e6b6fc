-- snapstore schema v1. See docs/format.md for the meaning of every column.
CREATE TABLE meta(
  key   TEXT PRIMARY KEY,
  value TEXT NOT NULL
) STRICT, WITHOUT ROWID;

CREATE TABLE identities(
  id        INTEGER PRIMARY KEY AUTOINCREMENT,
  key       TEXT NOT NULL UNIQUE,
  canonical TEXT NOT NULL,
  created   REAL NOT NULL,
  last_open REAL NOT NULL
) STRICT;

CREATE TABLE snapshots(
  id            INTEGER PRIMARY KEY AUTOINCREMENT,
  identity_id   INTEGER NOT NULL REFERENCES identities(id),
  namespace     TEXT NOT NULL DEFAULT '',
  parent_id     INTEGER REFERENCES snapshots(id),
  depth         INTEGER NOT NULL,
  n_tokens      INTEGER NOT NULL CHECK (n_tokens >= 0),
  base_tokens   INTEGER NOT NULL CHECK (base_tokens >= 0 AND base_tokens <= n_tokens),
  token_width   INTEGER NOT NULL CHECK (token_width IN (4, 8)),
  tokens        BLOB NOT NULL,
  anchor        BLOB NOT NULL,
  prefix_key    BLOB NOT NULL,
  content_key   BLOB NOT NULL,
  session       TEXT,
  state         INTEGER NOT NULL CHECK (state IN (0, 1)),
  owner         TEXT,
  matchable     INTEGER NOT NULL DEFAULT 1,
  created       REAL NOT NULL,
  last_used     REAL NOT NULL,
  hits          INTEGER NOT NULL DEFAULT 0,
  logical_bytes INTEGER NOT NULL
) STRICT;
CREATE INDEX snapshots_match   ON snapshots(identity_id, namespace, anchor);
CREATE INDEX snapshots_parent  ON snapshots(parent_id);
CREATE INDEX snapshots_lru     ON snapshots(last_used);
CREATE INDEX snapshots_session ON snapshots(identity_id, namespace, session) WHERE session IS NOT NULL;
CREATE INDEX snapshots_owner   ON snapshots(owner) WHERE owner IS NOT NULL;

CREATE TABLE parts(
  snapshot_id INTEGER NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
  name        TEXT NOT NULL,
  kind        INTEGER NOT NULL CHECK (kind IN (0, 1)),
  dtype       TEXT NOT NULL,
  shape       TEXT NOT NULL,
  component   TEXT,
  row_start   INTEGER NOT NULL,
  row_end     INTEGER NOT NULL,
  nbytes      INTEGER NOT NULL,
  PRIMARY KEY (snapshot_id, name)
) STRICT, WITHOUT ROWID;

CREATE TABLE chunks(
  id         BLOB PRIMARY KEY,
  raw_len    INTEGER NOT NULL,
  stored_len INTEGER NOT NULL,
  codec      INTEGER NOT NULL,
  checksum   BLOB NOT NULL,
  scope      BLOB NOT NULL,
  refs       INTEGER NOT NULL CHECK (refs >= 0),
  created    REAL NOT NULL
) STRICT, WITHOUT ROWID;

CREATE TABLE part_chunks(
  snapshot_id INTEGER NOT NULL,
  name        TEXT NOT NULL,
  seq         INTEGER NOT NULL,
  chunk_id    BLOB NOT NULL REFERENCES chunks(id),
  PRIMARY KEY (snapshot_id, name, seq),
  FOREIGN KEY (snapshot_id, name) REFERENCES parts(snapshot_id, name) ON DELETE CASCADE
) STRICT, WITHOUT ROWID;
CREATE INDEX part_chunks_chunk ON part_chunks(chunk_id);

CREATE TABLE counters(
  name  TEXT PRIMARY KEY,
  value INTEGER NOT NULL
) STRICT, WITHOUT ROWID;
