"""Numbered SQL migrations, applied in order at open (PRAGMA user_version); shipped in the wheel."""
