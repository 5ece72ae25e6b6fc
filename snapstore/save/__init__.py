"""The save path: validate, cut into chunks, publish, record in one transaction; and saves off the engine's thread.

Internal: the public API is what :mod:`snapstore` exports."""
