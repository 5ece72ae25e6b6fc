-- snapstore schema v11: restore or recompute (issue 32, part 1). See docs/format.md ("Restore rates").
-- restore_rates: what this store measured its restores to cost, per tier ('ram': the RAM tier,
-- 'warm': chunk files in the page cache, 'cold': chunk files read from the device, 'remote': the
-- shared tier), as exponentially decayed sums over its restores (each earlier one weighs 0.9 at
-- every new one): w (the weight of the samples), and with u = 1 / bytes and v = seconds / bytes of
-- each restore: su, sv, suu (u*u), suv (u*v) — the least-relative-error line seconds = a + b * bytes
-- is v = b + a * u. samples: restores seen in all; updated: Unix seconds. Written rarely (at most
-- every 30 s, and at close) by whichever process last had something new: last writer wins.
CREATE TABLE restore_rates (
    tier TEXT PRIMARY KEY,
    w REAL NOT NULL,
    su REAL NOT NULL,
    sv REAL NOT NULL,
    suu REAL NOT NULL,
    suv REAL NOT NULL,
    samples INTEGER NOT NULL,
    updated REAL NOT NULL
);
