"""Checking and inspecting a store: verify (and repair), and what a store holds, described once.

Internal: the public API is what :mod:`snapstore` exports."""
