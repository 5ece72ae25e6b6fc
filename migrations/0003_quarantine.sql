-- snapstore schema v3: chunk quarantine. See docs/format.md (chunks.quarantined, §7.5).
-- NULL: the chunk is healthy. A time: a restore found its file damaged or missing at that time;
-- snapshots using it are not matched until a save of the correct bytes republishes it.
ALTER TABLE chunks ADD COLUMN quarantined REAL;
CREATE INDEX chunks_quarantined ON chunks(id) WHERE quarantined IS NOT NULL;
