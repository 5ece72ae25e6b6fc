-- snapstore schema v11: snapshots imported under an identity override (issue 32, part 3). See
-- docs/format.md ("snapshots.imported_from") and docs/api.md ("Export and import").
-- imported_from: NULL for a snapshot this store's identity computed (saved, fetched, or imported
-- from a file of the same identity). The identity key of the export file's identity when
-- Store.import_file(..., accept_identity=KEY) took state computed under another identity into
-- this one; a snapshot saved over such a snapshot inherits its parent's value. Such a snapshot is
-- restored only when asked for by id or by name: match() and parent="auto" pass over it (it is
-- never an exact match of its own), and `snapstore inspect` shows it.
ALTER TABLE snapshots ADD COLUMN imported_from TEXT;
