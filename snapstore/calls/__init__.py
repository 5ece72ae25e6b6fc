"""The Store's calls beyond one save and one restore: batches, turns, lifecycle transactions, reports, the call gate.

Internal: the public API is what :mod:`snapstore` exports."""
