-- snapstore schema v11: restore or recompute (issue 32, part 1). See docs/format.md ("Restore rates").
-- restore_rates: what this store measured its restores to cost, per tier ('ram': the RAM tier,
-- 'warm': chunk files in the page cache, 'cold': chunk files read from the device, 'remote': the
-- shared tier), as exponentially decayed sums over its restores: w (the weight of the samples),
-- sx (chunk bytes read), sy (seconds), sxx and sxy (for a least-squares line seconds = a + b * bytes).
-- samples: restores seen in all; updated: Unix seconds. Written rarely (throttled, and at close),
-- by whichever process last had something new: last writer wins, as for a cache of a figure.
CREATE TABLE restore_rates (
    tier TEXT PRIMARY KEY,
    w REAL NOT NULL,
    sx REAL NOT NULL,
    sy REAL NOT NULL,
    sxx REAL NOT NULL,
    sxy REAL NOT NULL,
    samples INTEGER NOT NULL,
    updated REAL NOT NULL
);
