#!/usr/bin/env bash
# snapstore main job: a hybrid model answers a long system prompt; a NEW process restores it for a new question.
#   ./demo.sh            (uses $SNAPSTORE_DIR if set, else the per-user cache directory)
set -euo pipefail
cd "$(dirname "$0")"
PY=.venv/bin/python
echo "== setting up .venv (snapstore with the hf extra; torch pinned to the 2.13.0 CPU wheel)"
./scripts/bootstrap.sh
echo
echo "== run 1 (process A): PrefixCache(model).generate(system prompt + question 1)"
"$PY" examples/demo.py --phase first
echo
echo "== run 2 (process B, a new process): PrefixCache(model).generate(system prompt + question 2)"
"$PY" examples/demo.py --phase second
