#!/usr/bin/env bash
# snapstore main job: a hybrid model reads a long prompt once; a NEW process restores and continues.
#   ./demo.sh            (uses $SNAPSTORE_DIR if set, else the per-user cache directory)
set -euo pipefail
cd "$(dirname "$0")"
PY=.venv/bin/python
echo "== setting up .venv (snapstore with the hf extra; torch pinned to the 2.13.0 CPU wheel)"
./scripts/bootstrap.sh
echo
echo "== run 1 (process A): prefill and save"
"$PY" examples/demo.py --phase save
echo
echo "== run 2 (process B, a new process): match, restore, continue"
"$PY" examples/demo.py --phase restore
