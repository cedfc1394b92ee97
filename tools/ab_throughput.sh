#!/usr/bin/env bash
# bench.throughput of this tree against another tree of the project (BASE, e.g. an older commit
# unpacked with `git archive COMMIT engine bench states ipc entrypoints | tar -x -C ab/base`),
# interleaved process by process in one call (ROUNDS rounds of base, then this tree), so both
# see the same machine. On the GPU machine, after scripts/gpu/env.sh's setup:
#     BASE=ab/base ROUNDS=2 bash tools/ab_throughput.sh [bench.throughput args...]
# Writes $OUT/ab_<tree>_<round>.json and prints each run's table (output tok/s by mode).
set -u
source "$(dirname "$0")/../scripts/gpu/env.sh"
BASE=${BASE:?BASE=path of the other tree}
ROUNDS=${ROUNDS:-2}
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--device cuda --no-progress --modes bare,inproc --repeat 1)
here=$PWD
for r in $(seq 1 "$ROUNDS"); do
    for tree in base this; do
        dir=$here; [ $tree = base ] && dir=$(cd "$BASE" && pwd)
        step "ab_${tree}_$r" 200 env PYTHONPATH=/tmp/site:$dir bash -c \
            "cd '$dir' && python3 -m bench.throughput ${args[*]} --out '$OUT/ab_${tree}_$r.json'"
    done
done
exit $((FAILED > 0))
