# Sourced by the suites in this folder (not run on its own). On the lent GPU machine: the recipe
# of ../shared/gpu/README.md (the wheels carried in .whl, installed once into /tmp/site),
# PYTHONPATH, the output folder ($OUT: the device tool's; /tmp/enginecore-gpu elsewhere) and
# `step`, which runs one command under the suite's deadline.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
if [ -d .whl ] && [ ! -e /tmp/site/.enginecore-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.enginecore-wheels
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/enginecore-gpu}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${BUDGET:-540}))  # the whole suite; the device tool stops a call at 600 s
FAILED=0

# step NAME CAP COMMAND...: COMMAND with min(CAP, time left) seconds, its output in $OUT/NAME.log
# (the tail echoed); a command stopped by timeout unwinds on SIGTERM and keeps what it wrote.
step() {
    local name=$1 cap=$2 left rc
    shift 2
    left=$((DEADLINE - SECONDS))
    if ((left < 15)); then
        echo "== $name skipped: no time left"
        FAILED=$((FAILED + 1))
        return
    fi
    ((left < cap)) && cap=$left
    echo "== $name (limit ${cap}s): $*"
    timeout -k 20 "$cap" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "== $name rc=$rc at ${SECONDS}s"
    ((rc == 0)) || FAILED=$((FAILED + 1))
}
