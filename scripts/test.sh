#!/usr/bin/env bash
# Set up (or reuse) .venv, then run the whole CPU test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest-xdist workers: CI's two cores. A test that asserts wall-clock bounds is marked
# ``alone`` and runs with no other test beside it (tests/conftest.py).
exec .venv/bin/python -m pytest -q -n 2 "$@"
