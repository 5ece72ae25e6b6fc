-- snapstore schema v9: the part layout of every snapshot. See docs/format.md (snapshots.layout_key).
-- 16 bytes naming the specs of the parts the snapshot saves (name, kind, dtype, shape or row shape,
-- tokens per row; _layout_fit.layout_key). match() passes over a candidate whose parts cannot restore
-- into the matching store's layout (another dtype or shape of a part it needs, a required part
-- missing), decided once per key and remembered: one identity may hold snapshots of two layouts, and
-- each layout is served only what it can restore. NULL: a snapshot saved before this migration (or
-- fetched from a shared tier): its parts are read and checked instead.
ALTER TABLE snapshots ADD COLUMN layout_key BLOB;
