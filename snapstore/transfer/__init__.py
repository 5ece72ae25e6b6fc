"""Export and import: one snapshot chain as a portable, checksummed file (docs/format.md "Export files")."""
