"""Which snapshot a prompt may restore and how: prefix matching, layout fit, and the restore plan
checked before a byte is written.

Internal: the public API is what :mod:`snapstore` exports."""
