#!/usr/bin/env bash
# Set up (or reuse) .venv, then run the whole CPU test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
