"""The restore path: stream a checked plan's chunks into the destination, cold reads, the RAM tier.

Internal: the public API is what :mod:`snapstore` exports."""
