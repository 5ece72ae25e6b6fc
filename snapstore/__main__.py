"""``python -m snapstore``: the same command as the ``snapstore`` console script."""

from __future__ import annotations

import sys

from snapstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
