"""What this process holds open: the targets of /proc/self/fd, for tests that check descriptors."""

from __future__ import annotations

import os


def open_targets() -> list[str]:
    """The path each open descriptor of this process names (a removed file ends in " (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
    return out
