-- snapstore schema v7: the row granularity of every saved row-stream segment. See docs/format.md
-- (parts.tokens_per_row). A segment saved from now on records the tokens per row of the layout that
-- saved it (1: one row per token, a layout without tokens_per_row); a restore under a layout of
-- another granularity is refused (DestinationError) where the part's dtype and row shape are checked.
-- NULL: a fixed part, or a segment saved before this migration (not recorded: read as the restoring
-- layout says, as before). Shared-tier manifests carry it per part.
ALTER TABLE parts ADD COLUMN tokens_per_row INTEGER CHECK (tokens_per_row IS NULL OR tokens_per_row >= 1);
