-- snapstore schema v2: owners of pending captures (liveness across hosts and PID namespaces).
-- See docs/format.md §"Owners and liveness". One row per open Store that can own pending captures;
-- the owner holds an flock on owners/<id>.lock while it lives and renews `renewed` every lease/4.
CREATE TABLE owners(
  id      TEXT PRIMARY KEY CHECK (length(id) = 32 AND id NOT GLOB '*[^0-9a-f]*'),
  kernel  TEXT NOT NULL,
  host    TEXT NOT NULL,
  pid     INTEGER NOT NULL,
  lease   REAL NOT NULL CHECK (lease > 0),
  renewed REAL NOT NULL,
  created REAL NOT NULL
) STRICT, WITHOUT ROWID;
