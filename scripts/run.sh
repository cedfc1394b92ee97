#!/usr/bin/env bash
# Set up (or reuse) .venv, then run the main job: `enginecore ARGS...`
# (no args: serve the embedded default model over OpenAI-compatible HTTP on 127.0.0.1:8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- serve --http 127.0.0.1:8000
fi
exec .venv/bin/enginecore "$@"
