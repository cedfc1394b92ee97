#!/usr/bin/env bash
# The GPU tests: every test marked `gpu` (tests/gpu and the speculative decoding tests), among them
# device memory back to 0 B after every shutdown. ~3-4 min. Extra arguments go to pytest
# (e.g. `-k release`). Log: $OUT/gpu_tests.log.
source "$(dirname "$0")/env.sh"
step gpu_tests 500 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:benchmark tests/gpu tests/test_speculative.py "$@"
nvidia-smi --query-gpu=name,memory.used --format=csv
exit $((FAILED > 0))
