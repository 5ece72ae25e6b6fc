#!/usr/bin/env bash
# Run the whole test suite (sets up .venv first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests fuzz "$@"
