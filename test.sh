#!/usr/bin/env bash
# Run the whole test suite (sets up .venv first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/bootstrap.sh
# Cache bytecode in the (gitignored) __pycache__ folders even where the environment sets
# PYTHONDONTWRITEBYTECODE: without the cache every pytest-xdist worker rewrites and compiles every
# test module again at collection (about 6 s of CPU each) and every child process compiles snapstore.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests fuzz "$@"
