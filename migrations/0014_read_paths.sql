-- snapstore schema v14: the cold-read path chosen by measurement (issue 48). See docs/format.md ("Read paths").
-- read_paths: how this store reads chunk files that are not in the page cache, as measured on its
-- storage, one row per storage it has been on: storage (the device and file system of the store
-- directory, "<st_dev>:<f_fsid>" in hex, so a store moved or copied to another device measures
-- again), method ('buffered': reads through the page cache with its read-ahead; 'direct': O_DIRECT
-- reads, `threads` in flight of `piece` bytes each), figures (JSON: each method tried -> its median
-- bytes per second), reason (one line: why this method), cold_rate (the store's measured cold
-- restore rate when the choice was made, bytes per second, scaled from the method its restores used to
-- the one chosen: what drift is judged against; 0: none yet), measured (Unix seconds).
-- Written by whichever process measured last (last writer wins); a reader ignores a method it does not know.
CREATE TABLE read_paths (
    storage TEXT PRIMARY KEY,
    method TEXT NOT NULL,
    threads INTEGER NOT NULL,
    piece INTEGER NOT NULL,
    figures TEXT NOT NULL,
    reason TEXT NOT NULL,
    cold_rate REAL NOT NULL,
    measured REAL NOT NULL
) STRICT;
