"""Engine buffers as byte ranges: what a save reads (part sources) and a restore writes (destinations),
paged rows among them.

Internal: the public API is what :mod:`snapstore` exports."""
