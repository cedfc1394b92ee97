#!/usr/bin/env bash
# The GPU figures of the serving, rollout and deterministic features (bench/RESULTS.md):
# bench.serve on the nano-vllm burst with the default flags (HTTP against in-process, the two
# ratios; with BEFORE=DIR also the server of an older tree, e.g. `git archive COMMIT engine
# bench states ipc entrypoints | tar -x -C ab/base`), bench.first_request (the first request
# after ready against warm ones, in process and over HTTP), bench.weight_sync (in-process
# tensors and CUDA IPC from a trainer process, qwen3-0.6b and llama-3.2-1b shapes) and
# deterministic mode's cost (bench.throughput --deterministic-compare on a smaller workload).
# Needs the serving stack's wheels in .whl (../shared/gpu/README.md). ~8 min.
source "$(dirname "$0")/env.sh"
step serve 170 python3 -m bench.serve --device cuda --no-progress --out "$OUT/serve.json"
if [ -n "${BEFORE:-}" ]; then
    step serve_before 110 python3 -m bench.serve --device cuda --no-progress --no-inproc \
        --server-root "$BEFORE" --out "$OUT/serve_before.json"
fi
if [ -f bench/first_request.py ]; then
    step first_request 90 python3 -m bench.first_request --device cuda --warmup on,off --out "$OUT/first_request.json"
fi
step weight_sync 110 python3 -m bench.weight_sync --device cuda --no-progress --rounds 3 \
    --paths tensors,distributed,ipc,ipc-bucket --out "$OUT/weight_sync.json"
step deterministic 90 python3 -m bench.throughput --device cuda --no-progress --modes inproc \
    --repeat 1 --num-requests 64 --max-output 256 --deterministic-compare --out "$OUT/deterministic.json"
exit $((FAILED > 0))
