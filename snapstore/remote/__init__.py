"""The shared tier: S3-compatible object storage behind the local tier, optional (nothing below it imports it).

Internal: the public API is what :mod:`snapstore` exports."""
