#!/usr/bin/env bash
# Run the test suite (sets up .venv first). Extra arguments go to pytest: with none that names a
# path (options only, e.g. `-m "not slow" -n auto`) every tier runs (tests/ and fuzz/); an argument
# that names a file or folder (`tests/store`, `tests/store/test_x.py::test_y`) runs only what it names.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/bootstrap.sh
# Cache bytecode in the (gitignored) __pycache__ folders even where the environment sets
# PYTHONDONTWRITEBYTECODE: without the cache every pytest-xdist worker rewrites and compiles every
# test module again at collection (about 6 s of CPU each) and every child process compiles snapstore.
unset PYTHONDONTWRITEBYTECODE
where=(tests fuzz)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then  # a path (an option's value names none)
    where=()
    break
  fi
done
exec .venv/bin/python -m pytest -q -p no:cacheprovider ${where[@]+"${where[@]}"} "$@"
