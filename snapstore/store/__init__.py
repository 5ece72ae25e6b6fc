"""The Store and its parts: ``store.Store`` (save, match, restore) and its calls beyond those —
batches, turns, lookups, names, reports, export/import, warm-up, the call gate.

Internal: the public API is what :mod:`snapstore` exports.
"""
