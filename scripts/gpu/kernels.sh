#!/usr/bin/env bash
# Kernel micro-benchmarks: the paged prefill attention kernel by launch choice (the default, query-
# head pairs interleaved, against a program a head and stacked heads, and torch's flash SDPA for
# scale; every choice checked against the default's output), then the paged decode kernel against
# the torch gather path (K/V bytes over time). ~2-4 min. $OUT/prefill_attn.json, $OUT/*.log.
source "$(dirname "$0")/env.sh"
step prefill_attn 300 python3 scripts/gpu/bench_prefill_attn.py --packed 1,2 --block-n 64 --warps 4 \
    --stages 2 --interleave 0,1 --out "$OUT/prefill_attn.json"
step decode_attn 120 python3 scripts/gpu/bench_decode_attn.py
exit $((FAILED > 0))
