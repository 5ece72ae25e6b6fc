"""Chunk files on disk: their format, crash-safe publishing, direct I/O, the staging buffer and the store directory.

Internal: the public API is what :mod:`snapstore` exports."""
