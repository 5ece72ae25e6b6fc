#!/usr/bin/env python3
"""Check the import contracts of pyproject.toml ([tool.importlinter]) on the package as it is installed.

The wheel maps ``engine/`` to ``snapstore.engine`` (pyproject's package-dir), but import-linter reads
a package from one directory tree. So this builds that tree as links in a temporary directory
(``snapstore/*`` plus ``snapstore/engine -> engine/``) and runs ``lint-imports`` on it; nothing is
copied and nothing in the checkout changes. Exit status: lint-imports's (non-zero on a broken contract).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_view(into: Path) -> Path:
    """``into/snapstore``: links to every entry of ``snapstore/``, and ``engine`` linked in as ``snapstore/engine``."""
    pkg = into / "snapstore"
    pkg.mkdir()
    for entry in (ROOT / "snapstore").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "engine").symlink_to(ROOT / "engine")
    return into


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="snapstore-imports-") as tmp:
        view = package_view(Path(tmp))
        path = os.pathsep.join([str(view), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, "PYTHONPATH": path}
        exe = Path(sys.executable).with_name("lint-imports")
        return subprocess.call([str(exe), str(ROOT / "pyproject.toml"), "--no-cache"], env=env, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
