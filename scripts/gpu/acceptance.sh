#!/usr/bin/env bash
# The acceptance benchmarks of bench/RESULTS.md, with the flags its rows name: the nano-vllm
# workload through the bare loop, in-process and over IPC (2 interleaved rounds: the in-process /
# bare and IPC / in-process ratios, ~3 min), prefix caching on / off (3 rounds, ~1 min) and
# structured outputs at 0 / 50 / 100 % constrained (5 rounds, ~1 min; needs xgrammar's wheels in
# .whl). Each writes $OUT/NAME.json and its table to $OUT/NAME.log.
source "$(dirname "$0")/env.sh"
step throughput 260 python3 -m bench.throughput --device cuda --no-progress --repeat 2 --interleave \
    --modes bare,inproc,ipc --timeline --out "$OUT/throughput.json"
step prefix 150 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
step structured 150 python3 -m bench.structured --device cuda --no-progress --fractions 0,0.5,1 \
    --rounds 5 --out "$OUT/structured.json"
exit $((FAILED > 0))
