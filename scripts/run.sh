#!/usr/bin/env bash
# Set up (or reuse) .venv, then run the main job: `enginecore ARGS...`
# (no args: stream a completion from the embedded default model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- generate "The capital of France is" --max-tokens 24
fi
exec .venv/bin/enginecore "$@"
