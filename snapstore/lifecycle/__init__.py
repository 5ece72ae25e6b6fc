"""Lifecycle and ownership: who may read or change a snapshot, owners of pending captures, budgets, eviction and gc.

Internal: the public API is what :mod:`snapstore` exports."""
