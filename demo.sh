#!/usr/bin/env bash
# snapstore main job: a hybrid model reads a long prompt once; a NEW process restores and continues.
#   ./demo.sh            (uses $SNAPSTORE_DIR if set, else the per-user cache directory)
set -euo pipefail
cd "$(dirname "$0")"
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
echo "== installing snapstore with the hf extra (torch 2.13.0 first: the CPU wheel, pinned)"
"$PY" -m pip install --quiet --disable-pip-version-check torch==2.13.0
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[hf]"
echo
echo "== run 1 (process A): prefill and save"
"$PY" examples/demo.py --phase save
echo
echo "== run 2 (process B, a new process): match, restore, continue"
"$PY" examples/demo.py --phase restore
