#!/usr/bin/env bash
# One device run: GPU tests, then benchmarks, each capped so the whole fits in ~280 s.
# Usage on the lent H200 (after the wheel install prefix): bash scripts/gpu/final.sh
export PYTHONUNBUFFERED=1
E=$((SECONDS + ${BUDGET:-280}))
step() {  # step NAME CAP CMD...
  local n=$1 c=$2; shift 2
  local r=$((E - SECONDS)); ((r > c)) && r=$c
  ((r < 15)) && { echo "== $n skipped: no time left"; return; }
  echo "== $n (limit ${r}s) at ${SECONDS}s"
  timeout -k 10 $r "$@" > "$OUT/$n.log" 2> "$OUT/$n.err"
  echo "== $n rc=$? at ${SECONDS}s"; tail -n 25 "$OUT/$n.log"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
git rev-parse HEAD 2>/dev/null || true
step gpu_tests 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu tests/test_speculative.py
step roofline 30 python3 -m bench.roofline --device cuda --no-progress --out "$OUT/roofline.json"
step throughput 130 python3 -m bench.throughput --device cuda --no-progress --num-requests 128 --repeat 1 --modes bare,inproc,hf-generate --out "$OUT/throughput.json"
step speculative 40 python3 -m bench.speculative --device cuda --no-progress --num-requests 32 --out "$OUT/speculative.json"
