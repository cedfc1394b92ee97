#!/usr/bin/env bash
# One device run: benchmarks and GPU tests, each capped, the whole under BUDGET seconds (480).
# Usage on the lent H200 (after the wheel install prefix): bash scripts/gpu/final.sh
export PYTHONUNBUFFERED=1
E=$((SECONDS + ${BUDGET:-480}))
step() {  # step NAME CAP CMD...
  local n=$1 c=$2; shift 2
  local r=$((E - SECONDS)); ((r > c)) && r=$c
  ((r < 15)) && { echo "== $n skipped: no time left"; return; }
  echo "== $n (limit ${r}s) at ${SECONDS}s"
  timeout -k 10 $r "$@" > "$OUT/$n.log" 2>&1  # stdout+stderr in one file: 8 files come back at most
  echo "== $n rc=$? at ${SECONDS}s"; tail -n 25 "$OUT/$n.log"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
git rev-parse HEAD 2>/dev/null || true
step throughput 200 python3 -m bench.throughput --device cuda --no-progress --num-requests 128 --repeat 1 --modes bare,inproc,hf-generate --out "$OUT/throughput.json"
step gpu_tests 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu tests/test_speculative.py
step roofline 30 python3 -m bench.roofline --device cuda --no-progress --out "$OUT/roofline.json"
step speculative 40 python3 -m bench.speculative --device cuda --no-progress --num-requests 32 --out "$OUT/speculative.json"
