#!/usr/bin/env bash
# Device runs: benchmarks and GPU tests, each capped, the whole under BUDGET seconds (560).
# Usage on the lent H200 (after the wheel install prefix): PART=1 bash scripts/gpu/final.sh
#   PART=1  the nano-vllm workload: every engine mode and the HF transformers peer
#   PART=2  lifecycle (20 open/close cycles), GPU tests, roofline, speculative, SIGTERM
#   PART=3  the HF continuous-batching peer alone, then the engine modes in 2 interleaved rounds
#   PART=4  the engine modes alone, 2 interleaved rounds
#   PART=5  decode-step profile (phases, kernels per step), roofline, engine modes (1 round),
#           prefix caching on/off, sleep/wake identity (5 cycles)
#   PART=6  fused kernels: GPU tests, kernels per step, decode profile, roofline, the bare
#           loop with the fused path and with ENGINECORE_FUSED=0 (all logs in one file)
#   PART=7  GPU tests, decode profile, roofline, engine modes in 2 interleaved rounds
#           (qwen3-0.6b), one round on llama-3.2-1b, prefix caching on/off
#   PART=8  sleep/wake (5 cycles), lifecycle (20 cycles), logprobs 20, structured outputs
#   PART=10 structured outputs and TP on one GPU (GPU tests), engine modes with roof %,
#           logprobs 20 against none, structured-output throughput, lifecycle (20 cycles),
#           an eager step's host time by op
#           (needs xgrammar and apache-tvm-ffi wheels in .whl, pydantic's in .whl/pyd)
#   PART=11 all GPU tests, logprobs 20 against none, engine modes (1 round), structured outputs
#   PART=12 structured outputs' host cost (issue 23): GPU tests (structured, overlap, release),
#           xgrammar's cost a step by thread count (bench.xgrammar_costs), bench.structured
#           overlapped and synchronous (needs the xgrammar wheels, as PART=10)
#   PART=13 every GPU test, structured outputs, engine modes (1 round), roofline (session 10)
#   PART=14 prefix caching on/off, release/overlap/decode/sleep GPU tests (session 10), eager
#           steps' host time by where (Triton's launcher, torch, the engine; session 12)
#   PART=15 graphed prompt steps (ENGINECORE_MIXED_GRAPHS=1): their GPU tests, prefix caching
#           on/off and the engine modes with them (session 12)
#   PART=16 GPU tests (overlap, structured, release), structured outputs, the engine modes with
#           timelines, in-process without step bursts, prefix caching with mixed graphs on and off
#           (session 13)
#   PART=17 the defaults at session 13's end: GPU tests (structured, release), structured outputs
#           with the late step's split, the engine modes in 2 interleaved rounds, prefix caching
#   PART=18 PART=17's structured outputs and engine modes first, then its GPU tests
#   PART=19 session 14, issue 15: the prefill kernel's launch choices (sweep; bench.prefix with the
#           default and with the best on the cached shape; the step timeline of later turns;
#           the mixed-graph and fused GPU tests with the best), GPU tests (fused, release)
#   PART=20 session 14, issue 23: structured outputs with the split, without and with
#           ENGINECORE_GRAMMAR_OVERLAP=1 (also with ENGINECORE_GRAMMAR_SWITCH_US=200); a late
#           step's device waits (sync_check); GPU tests
#           (structured and overlap with it, structured and release without)
#   PART=21 session 15, issues 15 and 23 in one call: PART=19's sweep (qwen3-0.6b first) and
#           bench.prefix with the default and the best choice, PART=20's structured outputs
#           without and with ENGINECORE_GRAMMAR_OVERLAP=1, the prefix timeline, the graphed
#           prompt steps' GPU tests with the best choice
#   PART=22 session 15, issue 15: blocks shared inside one step (seal_ahead): its GPU test,
#           bench.prefix twice, the timeline with the first turn, the release and mixed-graph
#           engine GPU tests
#   (PART=20/21's ENGINECORE_GRAMMAR_SWITCH_US and Python helper are gone since session 16: with
#   ENGINECORE_GRAMMAR_OVERLAP=1, the default now, those runs measure the C++ grammar worker)
#   PART=23 session 16, issues 15 and 23 in one call: PART=22's GPU test and bench.prefix twice,
#           then structured outputs without and with the grammar worker
#           (ENGINECORE_GRAMMAR_OVERLAP=1), the structured/overlap/release GPU tests with it
#   PART=24 session 16: structured outputs with the grammar worker (the default) and without it,
#           bench.prefix twice, the overlap GPU tests
#   PART=25 session 16's last run: bench.prefix with an 8,192-token step budget (vLLM's default on
#           H100/H200-class GPUs) and with the default 2,048, structured outputs with the worker
#   PART=26 the next session's first call: PART=25, then structured outputs split by part with the
#           grammar worker, as the engine delivers and with --deliver-after-step (a diagnostic)
#   PART=27 session 17: structured outputs (a late step lets the loop in at its end) twice,
#           bench.prefix, its timeline, a py-spy profile of the caching-on run, GPU tests
#   PART=28 session 17: bench.structured in 3 interleaved rounds; bench.prefix and bench.structured
#           with a 0.5 ms GIL switch interval against the default (a diagnostic)
#   PART=29 PART=28 with ENGINECORE_LATE_DELIVERY=end / between interleaved (2 rounds each, twice;
#           that switch was removed after this run: no gain)
#   PART=30 the acceptance runs of issues 15 and 23 in interleaved rounds (bench.prefix --rounds 3,
#           bench.structured --rounds 3), then the prefix and release GPU tests, and the step
#           thread's CUDA calls in bench.prefix's caching-on run (scripts/gpu/profile_prefix.py)
#   PART=31 session 18, issue 23: bench.structured with the grammar job started after the forward's
#           launch (the default) and without (with_switch.py --set), 3 interleaved pairs; py-spy
#           of the default; the structured and overlap GPU tests; bench.prefix --rounds 2
#   PART=32 session 18, issue 23: bench.structured with the defaults, with xgrammar's public mask
#           function (TokenBitmask.direct_kernel=false) and with the late let-in after the sampling
#           (EngineCore.late_let_in_after_sampling=true), 2 interleaved triples; GPU tests
#           (structured, overlap, release); on an H200 first bench.prefix --rounds 3 (issue 15)
#   PART=33 session 18's last call, issue 23: bench.structured --fractions 0,0.5,1 --rounds 5; py-spy
#           --gil of --fractions 1 and of --fractions 0 (whose Python holds the GIL; read them with
#           scripts/gpu/spy_summary.py --thread enginecore-step|MainThread); on an H200 first
#           bench.prefix --rounds 3 (issue 15)
#   PART=34 session 19, issue 23: bench.structured --fractions 0,1 --rounds 2 of this tree against
#           ab/base (an older tree's engine/ and bench/, made by `mkdir -p ab/base && git archive
#           REV engine bench | tar -x -C ab/base`; ignored by git: carry it with .whl; AB_BASE) and with
#           EngineCore.grammar_job_in_forward=false, 2 interleaved triples of processes; then the acceptance run (--fractions 0,0.5,1
#           --rounds 5), the structured and overlap GPU tests; on an H200 first bench.prefix
#           --rounds 3 (issue 15)
#   PART=35 session 19's last budget (~170 s): on an H200 bench.prefix --rounds 2 and
#           bench.structured --fractions 0,0.5,1 --rounds 3; elsewhere bench.structured --fractions
#           0,1 --rounds 2 of this tree and of ab/base, then the same acceptance run
#   PART=36 session 20: bench.prefix --rounds 3 and the acceptance bench.structured (--fractions
#           0,0.5,1 --rounds 5) on any card, then bench.structured --fractions 0,1 --rounds 2 of this
#           tree and of ab/base (`git archive REV engine bench states ipc`) interleaved twice
#   PART=37 session 20, after the H200's run 2: bench.structured's acceptance run (--fractions
#           0,0.5,1 --rounds 5), bench.prefix --rounds 3, then bench.structured --fractions 0,1
#           --rounds 2 with gc_young_threshold 0 (CPython's 700) against the default, interleaved
#           twice, once without the grammar worker (ENGINECORE_GRAMMAR_OVERLAP=0), and py-spy
#           --gil profiles of --fractions 1 and 0 (read them with
#           spy_summary.py --thread enginecore-step --within EngineCore.step)
#   PART=38 session 21: bench.structured's acceptance run (--fractions 0,0.5,1 --rounds 5
#           --phases) on any card, bench.prefix --rounds 3 on an H200, scripts/gpu/h2d_cost.py
#           (the CPU cost of the grammar masks' copy), then --fractions 0,1 --rounds 3 with the
#           sampler reading the masks (the default) against TokenBitmask.fuse_with_sampler=false,
#           interleaved twice
#   PART=39 session 22: bench.structured --fractions 0,1 --rounds 3 --phases with the constrained
#           step's parts split finer (--phase-targets), twice; bench.prefix --rounds 2 and
#           bench.prefix_timeline on any card
#   PART=40 session 22: bench.structured --fractions 0,1 --rounds 3 with the 0 % baseline's tokens
#           text (the default, bench.structured.printable_head) against --no-text-head, twice
#           interleaved; then the acceptance runs of issues 23 and 15 on any card
#   PART=41 session 22: the acceptance run of issue 23 with the greedy one-pass sampler, its GPU
#           tests, bench.prefix --rounds 3, the acceptance run again, the structured GPU tests
#   PART=42 session 22: bench.prefix --rounds 2 with the next step launched before first tokens'
#           consumers run (the default) against AsyncEngine.consumers_before_launch=true, twice
#           interleaved; then issue 23's acceptance run
#   PART=43 session 23: the prefill kernel's unmasked key tiles (split) against all masked: the
#           kernel sweep, its GPU tests and the graphed prompt steps', bench.prefix A/B (2 x 2)
#   PART=44 session 23: the split prefill kernel by pipeline stages, bench.prefix with the fastest
#           (if not the default), then both issues' acceptance runs
#   PART=45 session 23's last call: both acceptance runs, then tests/gpu/test_gpu_prefix.py
#   PART=46 session 23's last call: the prefill kernel's hand prefetch by warps and stages (the
#           fastest kept for the call if >= 8 % faster), GPU tests, both acceptance runs (the
#           prefetch choice was slower and is gone: the sweep's --prefetch needs tree faf2608)
#   PART=47 session 24's first call: issue 15's acceptance run, the cached burst's kernels by
#           device time (bench.prefix_host, core, torch profiler), the later turns' timeline
#   PART=48 session 24: the prefill kernel's interleaved packed heads and lazy maximum (sweep),
#           its GPU test, bench.prefix with the fastest choice and the default (interleaved
#           pairs of processes), the prefix GPU test with the fastest, the cached burst's host
#           time by function (cProfile, core)
#   PART=49 session 24's last call: the default prefill kernel (interleaved pairs) against a
#           dense reference on the device, the graphed prompt steps' GPU tests, issue 15's
#           acceptance run, the prefix GPU test
#   PART=9  overlapped scheduling: GPU tests, engine modes in 2 interleaved rounds, the bare
#           loop without overlap, llama-3.2-1b, prefix caching, sleep/wake (5 cycles)
export PYTHONUNBUFFERED=1
E=$((SECONDS + ${BUDGET:-560}))
step() {  # step NAME CAP CMD...
  local n=$1 c=$2; shift 2
  local r=$((E - SECONDS)); ((r > c)) && r=$c
  ((r < 15)) && { echo "== $n skipped: no time left"; return; }
  echo "== $n (limit ${r}s) at ${SECONDS}s"
  local f="$OUT/$n.log"; [[ -n ${ONE_LOG:-} ]] && f="$OUT/$ONE_LOG"
  echo "== $n" >> "$f"
  timeout -k 10 $r "$@" >> "$f" 2>&1  # stdout+stderr in one file: 8 files come back at most
  echo "== $n rc=$? at ${SECONDS}s"; tail -n ${TAIL:-25} "$f"
}
structured_pair() {  # structured_pair I BASE: bench.structured --fractions 0,1 --rounds 2 of
  # this tree, then of BASE's (an older tree's engine/ bench/ states/ ipc/, if there), as
  # structured_new_I / structured_base_I (run from inside BASE: python -m puts it first on the path)
  step "structured_new_$1" 45 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,1 --rounds 2 --out "$OUT/structured_new_$1.json"
  [[ -d $2 ]] && step "structured_base_$1" 45 bash -c "cd $2 && PYTHONPATH=/tmp/site:\$PWD \
    exec python3 -m bench.structured --device cuda --no-progress --no-plain --fractions 0,1 \
    --rounds 2 --out $OUT/structured_base_$1.json"
}
prefill_sweep() {  # prefill_sweep CAP [SWEEP ARGS]: the prefill kernel's launch choices; BEST = the
  # fastest on qwen3-0.6b's cached shape, as ENGINECORE_PREFILL_KERNEL takes it (empty if none ran)
  local cap=$1; shift
  step prefill_attn "$cap" python3 scripts/gpu/bench_prefill_attn.py "$@" --out "$OUT/prefill_attn.json"
  BEST=$(python3 -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['rows'] if x['model']=='qwen3-0.6b' and x['shape']=='cached']; b=min(r,key=lambda x:x['ms']); print(f\"packed={b['packed']},block_n={b['block_n']},warps={b['warps']},stages={b['stages']},split={b.get('split', 0)},interleave={b.get('interleave', 0)},lazy={b.get('lazy', 0)}\")" "$OUT/prefill_attn.json" 2>/dev/null)
  echo "best prefill choice: ${BEST:-none}"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
git rev-parse HEAD 2>/dev/null || true  # (may be stale: the device copies the work tree, not always .git)
# the tree's own identity: compare with the same command run here on a commit
echo "tree sha1 (engine/ bench/ *.py): $(find engine bench -name '*.py' -print0 | sort -z | xargs -0 cat | sha1sum | cut -c1-12)"
if [[ ${PART:-1} == 1 ]]; then
  step throughput 560 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --modes bare,inproc,ipc,hf-generate,hf-cb --out "$OUT/throughput.json"
elif [[ $PART == 3 ]]; then
  step throughput_hf_cb 330 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --modes hf-cb --out "$OUT/throughput_hf_cb.json"
  step throughput_engine 220 python3 -m bench.throughput --device cuda --no-progress --repeat 2 --interleave \
    --modes bare,inproc,ipc --out "$OUT/throughput_engine.json"
elif [[ $PART == 4 ]]; then
  step throughput_engine 560 python3 -m bench.throughput --device cuda --no-progress --repeat 2 --interleave \
    --modes bare,inproc,ipc --out "$OUT/throughput_engine.json"
elif [[ $PART == 5 ]]; then
  step profile 90 python3 scripts/gpu/profile_decode.py --batches 1 64 256 --out "$OUT/profile.json"
  ENGINECORE_CUDA_GRAPHS=0 step kernels 60 python3 scripts/gpu/profile_decode.py --batches 1 256 --steps 5 --kernels --table
  step roofline 45 python3 -m bench.roofline --device cuda --no-progress --out "$OUT/roofline.json"
  step throughput 200 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --modes bare,inproc,ipc --out "$OUT/throughput.json"
  step prefix 100 python3 -m bench.prefix --device cuda --out "$OUT/prefix.json"
  step sleep 90 python3 -m bench.sleep --device cuda --cycles 5 --out "$OUT/sleep.json"
elif [[ $PART == 6 ]]; then
  export ONE_LOG=run.log TAIL=12
  step gpu_tests 170 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py \
    tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_release.py
  ENGINECORE_CUDA_GRAPHS=0 step kernels 60 python3 scripts/gpu/profile_decode.py --batches 1 256 --steps 5 --kernels
  step profile 70 python3 scripts/gpu/profile_decode.py --batches 1 64 256 --out "$OUT/profile.json"
  step roofline 45 python3 -m bench.roofline --device cuda --no-progress --out "$OUT/roofline.json"
  step bare_fused 70 python3 -m bench.throughput --device cuda --no-progress --repeat 1 --modes bare --out "$OUT/thr_fused.json"
  ENGINECORE_FUSED=0 step bare_plain 70 python3 -m bench.throughput --device cuda --no-progress --repeat 1 --modes bare --out "$OUT/thr_plain.json"
elif [[ $PART == 7 ]]; then
  export ONE_LOG=run.log TAIL=12
  step gpu_tests 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py \
    tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_release.py tests/gpu/test_gpu_sleep.py
  step profile 40 python3 scripts/gpu/profile_decode.py --batches 1 64 256 --out "$OUT/profile.json"
  step roofline 40 python3 -m bench.roofline --device cuda --no-progress --out "$OUT/roofline.json"
  step throughput 230 python3 -m bench.throughput --device cuda --no-progress --repeat 2 --interleave \
    --modes bare,inproc,ipc --out "$OUT/throughput.json"
  step prefix 90 python3 -m bench.prefix --device cuda --out "$OUT/prefix.json"
  step llama 110 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --model random:llama-3.2-1b --modes bare,inproc,ipc --out "$OUT/throughput_llama.json"
elif [[ $PART == 9 ]]; then
  export ONE_LOG=run.log TAIL=12
  step gpu_tests 130 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_overlap.py \
    tests/gpu/test_gpu_fused.py tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_release.py tests/gpu/test_gpu_sleep.py
  step throughput 200 python3 -m bench.throughput --device cuda --no-progress --repeat 2 --interleave \
    --modes bare,inproc,ipc --out "$OUT/throughput.json"
  step bare_sync 45 python3 -m bench.throughput --device cuda --no-progress --repeat 1 --modes bare \
    --engine-config '{"overlap_scheduling": false}' --out "$OUT/throughput_sync.json"
  step llama 100 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --model random:llama-3.2-1b --modes bare,inproc,ipc --out "$OUT/throughput_llama.json"
  step prefix 60 python3 -m bench.prefix --device cuda --out "$OUT/prefix.json"
  step sleep 70 python3 -m bench.sleep --device cuda --cycles 5 --out "$OUT/sleep.json"
elif [[ $PART == 10 ]]; then
  export ONE_LOG=run.log TAIL=14
  step gpu_tests 80 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py \
    tests/gpu/test_gpu_tp.py
  step throughput 95 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --modes bare,inproc,ipc --out "$OUT/throughput.json"
  step structured 65 python3 -m bench.structured --device cuda --out "$OUT/structured.json"
  step logprobs 70 python3 -m bench.throughput --device cuda --no-progress --modes bare --repeat 1 \
    --logprobs-compare 20 --out "$OUT/lp20.json"
  step lifecycle 50 python3 -m bench.lifecycle --device cuda --no-progress --cycles 20 --out "$OUT/lifecycle.json"
  ENGINECORE_CUDA_GRAPHS=0 step cpu_table 30 python3 scripts/gpu/profile_decode.py --batches 256 --steps 3 --kernels --cpu-table
elif [[ $PART == 13 ]]; then  # session 10: every GPU test, structured outputs, engine modes, roofline
  export ONE_LOG=run.log TAIL=18
  step gpu_tests 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu \
    --ignore=tests/gpu/test_gpu_mixed_graphs.py  # (PART=15 runs those)
  step structured 170 python3 -m bench.structured --device cuda --no-progress --out "$OUT/structured.json"
  step throughput 150 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --modes bare,inproc,ipc --timeline --out "$OUT/throughput.json"
  step roofline 70 python3 -m bench.roofline --device cuda --no-progress --out "$OUT/roofline.json"
elif [[ $PART == 14 ]]; then  # session 10: prefix caching on/off, the GPU tests of the CPU-side merges
  export ONE_LOG=run.log TAIL=18
  step prefix 170 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  step gpu_tests 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_release.py \
    tests/gpu/test_gpu_overlap.py tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_sleep.py
  step profile_eager 60 python3 scripts/gpu/profile_eager.py  # session 12: an eager step's host time by where
elif [[ $PART == 15 ]]; then  # session 12: graphed prompt steps (ENGINECORE_MIXED_GRAPHS=1)
  export ONE_LOG=run.log TAIL=18
  step gpu_tests 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_mixed_graphs.py
  ENGINECORE_MIXED_GRAPHS=1 step prefix 170 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix_mixed.json"
  ENGINECORE_MIXED_GRAPHS=1 step throughput 150 python3 -m bench.throughput --device cuda --no-progress \
    --repeat 1 --modes bare,inproc,ipc --timeline --out "$OUT/throughput_mixed.json"
elif [[ $PART == 16 ]]; then  # session 13: xgrammar keeps the GIL, step bursts, mixed graphs on/off
  export ONE_LOG=run.log TAIL=22
  step gpu_tests 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_overlap.py \
    tests/gpu/test_gpu_structured.py tests/gpu/test_gpu_release.py
  step structured 80 python3 -m bench.structured --device cuda --no-progress --out "$OUT/structured.json"
  step throughput 110 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --modes bare,inproc,ipc --timeline --out "$OUT/throughput.json"
  step inproc_noburst 50 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --modes inproc --timeline --engine-config '{"step_burst_ms": 0}' --out "$OUT/throughput_noburst.json"
  ENGINECORE_MIXED_GRAPHS=1 step prefix_mixed 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix_mixed.json"
  ENGINECORE_MIXED_GRAPHS=0 step prefix_eager 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix_eager.json"
elif [[ $PART == 17 ]]; then  # session 13's closing run: defaults (mixed graphs, bursts, fill threads)
  export ONE_LOG=run.log TAIL=24
  step gpu_tests 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py \
    tests/gpu/test_gpu_release.py
  step structured 70 python3 scripts/gpu/structured_split.py -- --device cuda --no-progress \
    --out "$OUT/structured.json"
  step throughput 200 python3 -m bench.throughput --device cuda --no-progress --repeat 2 --interleave \
    --modes bare,inproc,ipc --timeline --out "$OUT/throughput.json"
  step prefix 50 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
elif [[ $PART == 18 ]]; then  # PART=17's measurements first, the GPU tests with what time is left
  export ONE_LOG=run.log TAIL=24
  step structured 70 python3 scripts/gpu/structured_split.py -- --device cuda --no-progress \
    --out "$OUT/structured.json"
  step throughput 160 python3 -m bench.throughput --device cuda --no-progress --repeat 2 --interleave \
    --modes bare,inproc,ipc --timeline --out "$OUT/throughput.json"
  step gpu_tests 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py \
    tests/gpu/test_gpu_release.py
elif [[ $PART == 19 ]]; then  # session 14 (no device then), issue 15: the prefill kernel's choices
  export ONE_LOG=run.log TAIL=30
  prefill_sweep 120
  step prefix 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  [[ -n $BEST ]] && ENGINECORE_PREFILL_KERNEL=$BEST step prefix_best 60 python3 -m bench.prefix \
    --device cuda --no-progress --out "$OUT/prefix_best.json"
  # where a later turn's TTFT goes, with the loop's lateness and own time between steps
  step prefix_timeline 45 python3 -m bench.prefix_timeline --device cuda
  # what making the best the default needs: the graphed prompt steps' tests with it
  [[ -n $BEST ]] && ENGINECORE_PREFILL_KERNEL=$BEST step gpu_tests_best 150 python3 -m pytest -q -s \
    -m gpu -p no:cacheprovider tests/gpu/test_gpu_mixed_graphs.py tests/gpu/test_gpu_fused.py
  step gpu_tests 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py \
    tests/gpu/test_gpu_release.py
elif [[ $PART == 21 ]]; then  # session 15: the decisive runs of PART=19 and PART=20 in one call
  export ONE_LOG=run.log TAIL=30
  prefill_sweep 110
  step prefix 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  [[ -n $BEST ]] && ENGINECORE_PREFILL_KERNEL=$BEST step prefix_best 60 python3 -m bench.prefix \
    --device cuda --no-progress --out "$OUT/prefix_best.json"
  step structured 70 python3 scripts/gpu/structured_split.py -- --device cuda --no-progress \
    --out "$OUT/structured.json"
  ENGINECORE_GRAMMAR_OVERLAP=1 step structured_beside 70 python3 scripts/gpu/structured_split.py -- \
    --device cuda --no-progress --out "$OUT/structured_beside.json"
  step prefix_timeline 45 python3 -m bench.prefix_timeline --device cuda
  [[ -n $BEST ]] && ENGINECORE_PREFILL_KERNEL=$BEST step gpu_tests_best 120 python3 -m pytest -q -s \
    -m gpu -p no:cacheprovider tests/gpu/test_gpu_mixed_graphs.py tests/gpu/test_gpu_fused.py
elif [[ $PART == 22 ]]; then  # session 15: one step's blocks shared (issue 15)
  export ONE_LOG=run.log TAIL=14
  step gpu_prefix 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_prefix.py
  step prefix 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  step prefix_again 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix_again.json"
  TAIL=60 step prefix_timeline 45 python3 -m bench.prefix_timeline --device cuda --first-turn
  step gpu_tests 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_release.py \
    tests/gpu/test_gpu_mixed_graphs.py::test_engine_outputs_with_mixed_graphs
elif [[ $PART == 23 ]]; then  # session 16: issue 15's last point, issue 23's grammar worker
  export ONE_LOG=run.log TAIL=14
  step gpu_prefix 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_prefix.py
  step prefix 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  step prefix_again 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix_again.json"
  step grammar_worker 60 python3 -m engine.structured.native
  ENGINECORE_GRAMMAR_OVERLAP=0 TAIL=30 step structured 70 python3 scripts/gpu/structured_split.py -- \
    --device cuda --no-progress --out "$OUT/structured.json"
  ENGINECORE_GRAMMAR_OVERLAP=1 TAIL=30 step structured_worker 70 python3 scripts/gpu/structured_split.py \
    -- --device cuda --no-progress --out "$OUT/structured_worker.json"
  ENGINECORE_GRAMMAR_OVERLAP=1 step gpu_tests_worker 110 python3 -m pytest -q -s -m gpu \
    -p no:cacheprovider tests/gpu/test_gpu_structured.py tests/gpu/test_gpu_overlap.py tests/gpu/test_gpu_release.py
elif [[ $PART == 24 ]]; then  # session 16: the grammar worker's second cut, bench.prefix again
  export ONE_LOG=run.log TAIL=12
  step grammar_worker 60 python3 -m engine.structured.native
  for v in 1 0; do
    ENGINECORE_GRAMMAR_OVERLAP=$v TAIL=20 step structured_$v 70 python3 scripts/gpu/structured_split.py \
      -- --device cuda --no-progress --no-plain --out "$OUT/structured_$v.json"
  done
  step prefix 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  step prefix_again 60 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix_again.json"
  step gpu_tests 80 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_overlap.py
elif [[ $PART == 25 || $PART == 26 ]]; then  # session 16: the step budget on prefix; the worker
  export ONE_LOG=run.log TAIL=12
  step prefix_8192 80 python3 -m bench.prefix --device cuda --no-progress \
    --engine-config '{"max_num_batched_tokens": 8192}' --out "$OUT/prefix_8192.json"
  step prefix 50 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  TAIL=20 step structured 60 python3 scripts/gpu/structured_split.py -- --device cuda --no-progress \
    --no-plain --fractions 0,1 --out "$OUT/structured.json"
  if [[ $PART == 26 ]]; then
    TAIL=20 step structured_after_step 60 python3 scripts/gpu/structured_split.py --deliver-after-step \
      -- --device cuda --no-progress --no-plain --fractions 0,1 --out "$OUT/structured_after_step.json"
    TAIL=60 step profile_structured 90 python3 scripts/gpu/profile_structured.py --max-tokens 64
  fi
elif [[ $PART == 27 ]]; then  # session 17: a late step lets the loop in at its end; prefix TTFT
  export ONE_LOG=run.log TAIL=12
  TAIL=20 step structured 60 python3 scripts/gpu/structured_split.py -- --device cuda --no-progress \
    --no-plain --fractions 0,0.5,1 --out "$OUT/structured.json"
  TAIL=20 step structured_again 50 python3 scripts/gpu/structured_split.py -- --device cuda --no-progress \
    --no-plain --fractions 0,1 --out "$OUT/structured_again.json"
  step prefix 50 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  TAIL=45 step prefix_timeline 50 python3 -m bench.prefix_timeline --device cuda
  if [[ -x .whl/py-spy ]]; then  # (carried: the development box's static py-spy)
    step prefix_pyspy 60 .whl/py-spy record -r 250 -f raw -o "$OUT/prefix_on.raw" --threads -- \
      python3 -m bench.prefix --device cuda --no-progress --modes on --out "$OUT/prefix_spy.json"
  fi
  step gpu_tests 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py \
    tests/gpu/test_gpu_overlap.py
elif [[ $PART == 28 || $PART == 29 ]]; then  # session 17: issue 23 in interleaved rounds; the GIL's switch interval
  export ONE_LOG=run.log TAIL=8
  if [[ $PART == 29 ]]; then  # the late step's delivery, at its end (the default) against between its halves
    for d in end between end between; do
      ENGINECORE_LATE_DELIVERY=$d TAIL=6 step "structured_$d" 45 python3 -m bench.structured --device cuda \
        --no-progress --no-plain --fractions 0,1 --rounds 2 --out "$OUT/structured_$d.json"
    done
  else
    step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,0.5,1 --rounds 3 --out "$OUT/structured.json"
  fi
  step prefix 45 python3 -m bench.prefix --device cuda --no-progress --out "$OUT/prefix.json"
  step prefix_si 45 python3 scripts/gpu/with_switch.py 0.0005 bench.prefix --device cuda --no-progress \
    --out "$OUT/prefix_si.json"
  if [[ $PART == 29 ]]; then  # host_arrays.block_table's rows on CUDA (decode and mixed graphs)
    TAIL=6 step gpu_tests 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_prefix.py \
      tests/gpu/test_gpu_mixed_graphs.py tests/gpu/test_gpu_overlap.py
  else
    TAIL=6 step structured_si 50 python3 scripts/gpu/with_switch.py 0.0005 bench.structured --device cuda \
      --no-progress --no-plain --fractions 0,1 --rounds 2 --out "$OUT/structured_si.json"
  fi
elif [[ $PART == 30 ]]; then  # the next session: issues 15 and 23 in interleaved rounds (~330 s)
  export ONE_LOG=run.log TAIL=12
  step prefix 150 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  TAIL=10 step structured 90 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 3 --out "$OUT/structured.json"
  TAIL=6 step gpu_tests 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_prefix.py \
    tests/gpu/test_gpu_release.py
  TAIL=40 step profile_prefix 60 python3 scripts/gpu/profile_prefix.py --out "$OUT/profile_prefix.json"
elif [[ $PART == 31 ]]; then  # session 18, issue 23: the job after the forward's launch, A/B
  export ONE_LOG=run.log TAIL=8
  for r in 1 2 3; do
    step "structured_after_$r" 40 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 2 --out "$OUT/structured_after_$r.json"
    step "structured_before_$r" 40 python3 scripts/gpu/with_switch.py \
      --set engine.core.engine_core:EngineCore.grammar_job_after_launch=false - bench.structured --device cuda \
      --no-progress --no-plain --fractions 0,1 --rounds 2 --out "$OUT/structured_before_$r.json"
  done
  step structured_pyspy 60 .whl/py-spy record -r 250 -f raw -o "$OUT/structured_100.raw" --threads -- \
    python3 -m bench.structured --device cuda --no-progress --no-plain --fractions 0,1 --rounds 2 \
    --out "$OUT/structured_spy.json"
  TAIL=6 step gpu_tests 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py \
    tests/gpu/test_gpu_overlap.py
  step prefix 100 python3 -m bench.prefix --device cuda --no-progress --rounds 2 --out "$OUT/prefix.json"
elif [[ $PART == 32 ]]; then  # session 18, issue 23: the packed mask kernel and the late let-in, A/B
  export ONE_LOG=run.log TAIL=8
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then  # issue 15's acceptance
    step prefix 150 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  fi
  TAIL=10 step structured 60 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 3 --out "$OUT/structured.json"
  for r in 1 2; do
    step "structured_default_$r" 40 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 2 --out "$OUT/structured_default_$r.json"
    step "structured_public_$r" 40 python3 scripts/gpu/with_switch.py \
      --set engine.structured.bitmask:TokenBitmask.direct_kernel=false - bench.structured --device cuda \
      --no-progress --no-plain --fractions 0,1 --rounds 2 --out "$OUT/structured_public_$r.json"
    step "structured_letin_$r" 40 python3 scripts/gpu/with_switch.py \
      --set engine.core.engine_core:EngineCore.late_let_in_after_sampling=true - bench.structured --device cuda \
      --no-progress --no-plain --fractions 0,1 --rounds 2 --out "$OUT/structured_letin_$r.json"
  done
  TAIL=6 step gpu_tests 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py \
    tests/gpu/test_gpu_overlap.py
  TAIL=6 step gpu_release 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_release.py
  step structured_si 40 python3 scripts/gpu/with_switch.py 0.0005 bench.structured --device cuda \
    --no-progress --no-plain --fractions 0,1 --rounds 2 --out "$OUT/structured_si.json"
  TAIL=60 step profile_structured 60 python3 scripts/gpu/profile_structured.py --max-tokens 64
elif [[ $PART == 33 ]]; then  # session 18's last call, issue 23: 5 interleaved rounds; whose GIL time
  export ONE_LOG=run.log TAIL=12
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then  # issue 15's acceptance
    step prefix 150 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  fi
  step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
  for f in 1 0; do  # py-spy --gil: the threads' samples while they hold the GIL, by fraction
    step "gil_$f" 45 .whl/py-spy record --gil --nonblocking -r 500 -f raw -o "$OUT/gil_$f.raw" --threads -- \
      python3 -m bench.structured --device cuda --no-progress --no-plain --fractions "$f" --rounds 3 \
      --out "$OUT/gil_$f.json"
  done
  TAIL=6 step gpu_overlap 45 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_overlap.py
elif [[ $PART == 35 ]]; then  # session 19's last budget: the acceptance runs first where they count
  export ONE_LOG=run.log TAIL=12
  base=${AB_BASE:-ab/base}
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    step prefix 100 python3 -m bench.prefix --device cuda --no-progress --rounds 2 --out "$OUT/prefix.json"
  else
    step structured_new 40 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 2 --out "$OUT/structured_new.json"
    [[ -d $base ]] && step structured_base 40 bash -c "cd $base && PYTHONPATH=/tmp/site:\$PWD \
      exec python3 -m bench.structured --device cuda --no-progress --no-plain --fractions 0,1 \
      --rounds 2 --out $OUT/structured_base.json"
  fi
  step structured 70 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 3 --out "$OUT/structured.json"
elif [[ $PART == 38 ]]; then  # session 21: the acceptance runs, the fused mask's A/B, the copy's cost
  export ONE_LOG=run.log TAIL=14
  step structured 90 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --phases --out "$OUT/structured.json"
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    step prefix 150 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  fi
  step h2d 40 python3 scripts/gpu/h2d_cost.py --out "$OUT/h2d.json"
  for i in 1 2; do
    step "structured_fused_$i" 50 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 3 --phases --out "$OUT/structured_fused_$i.json"
    step "structured_masked_$i" 50 python3 scripts/gpu/with_switch.py \
      --set engine.structured.bitmask:TokenBitmask.fuse_with_sampler=false - bench.structured \
      --device cuda --no-progress --no-plain --fractions 0,1 --rounds 3 --phases \
      --out "$OUT/structured_masked_$i.json"
  done
elif [[ $PART == 49 ]]; then  # session 24's last call, on the final tree
  export ONE_LOG=run.log TAIL=10
  step prefix 100 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  TAIL=8 step gpu_prefix 80 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_prefix.py
  TAIL=6 step gpu_prefill 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py -k prefill
  TAIL=6 step gpu_mixed 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_mixed_graphs.py
elif [[ $PART == 48 ]]; then  # session 24: interleaved packed heads, lazy maximum
  export ONE_LOG=run.log TAIL=16
  prefill_sweep 130 --packed 1,2,4 --block-n 64 --warps 4 --stages 2 --split 1 --interleave 0,1 --lazy 0,1
  [[ -n $BEST ]] && export ENGINECORE_PREFILL_KERNEL=$BEST
  TAIL=6 step gpu_prefill 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py -k prefill
  for i in 1 2; do
    TAIL=8 step "prefix_best_$i" 60 python3 -m bench.prefix --device cuda --no-progress --rounds 2 \
      --out "$OUT/prefix_best_$i.json"
    TAIL=8 step "prefix_default_$i" 60 env -u ENGINECORE_PREFILL_KERNEL python3 -m bench.prefix \
      --device cuda --no-progress --rounds 2 --out "$OUT/prefix_default_$i.json"
  done
  TAIL=8 step gpu_prefix 80 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_prefix.py
  TAIL=70 step burst_host 60 python3 -m bench.prefix_host --device cuda --model random:qwen3-0.6b \
    --mode core --rounds 1 --profile 45
elif [[ $PART == 47 ]]; then  # session 24's first call: where a cached burst's device time goes
  export ONE_LOG=run.log TAIL=14
  step prefix 100 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  TAIL=60 step burst_kernels 70 python3 -m bench.prefix_host --device cuda --model random:qwen3-0.6b \
    --mode core --rounds 1 --torch-profile 40
  TAIL=40 step timeline 90 python3 -m bench.prefix_timeline --device cuda
elif [[ $PART == 46 ]]; then  # session 23's last call: the split prefill kernel with its next tile
  # loaded by hand (prefetch 1: keys, 2: keys and values) by warps and stages; the fastest on the
  # cached shape is used for the rest of the call if it beats the default by 8 % or more (KERNEL),
  # then the prefill GPU tests, the prefix-sharing GPU test and both issues' acceptance runs
  export ONE_LOG=run.log TAIL=22
  prefill_sweep 80 --packed 1 --block-n 64 --warps 4,8 --stages 1,2,3 --split 1 --prefetch 0,1,2
  KERNEL=$(python3 -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['rows'] if x['model']=='qwen3-0.6b' and x['shape']=='cached']; d=[x for x in r if (x['warps'],x['stages'],x['prefetch'])==(4,2,0)][0]; b=min(r,key=lambda x:x['ms']); print(f\"packed=1,block_n=64,warps={b['warps']},stages={b['stages']},split=1,prefetch={b['prefetch']}\" if b['ms'] <= 0.92*d['ms'] else '')" "$OUT/prefill_attn.json" 2>/dev/null)
  echo "kernel for the rest of the call: ${KERNEL:-the default}"
  [[ -n $KERNEL ]] && export ENGINECORE_PREFILL_KERNEL=$KERNEL
  TAIL=6 step gpu_prefill 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py
  TAIL=8 step gpu_prefix 80 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_prefix.py
  TAIL=12 step prefix 100 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  TAIL=12 step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
elif [[ $PART == 45 ]]; then  # session 23's last call: both issues' acceptance runs on the final
  # tree, then the prefix-sharing GPU test (outputs equal uncached, hits, 0 B) with the split kernel
  export ONE_LOG=run.log TAIL=12
  step prefix 100 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
  TAIL=8 step gpu_prefix 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_prefix.py
elif [[ $PART == 44 ]]; then  # session 23: the split prefill kernel's pipeline stages (its sweep, then
  # bench.prefix with the fastest choice if it is not the default), both issues' acceptance runs
  export ONE_LOG=run.log TAIL=14
  prefill_sweep 90 --packed 1,2 --block-n 64 --warps 4,8 --stages 2,3,4 --split 1
  TAIL=12 step prefix 100 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  if [[ -n $BEST && $BEST != "packed=1,block_n=64,warps=4,stages=2,split=1" ]]; then
    TAIL=8 step prefix_best 60 env ENGINECORE_PREFILL_KERNEL="$BEST" python3 -m bench.prefix --device cuda \
      --no-progress --rounds 2 --out "$OUT/prefix_best.json"
    TAIL=8 step prefix_default 60 python3 -m bench.prefix --device cuda --no-progress --rounds 2 \
      --out "$OUT/prefix_default.json"
  fi
  step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
elif [[ $PART == 43 ]]; then  # session 23: the prefill kernel runs the key tiles every query sees
  # unmasked first (KernelChoice.split); its sweep against the all-masked kernel, the GPU tests of
  # the prefill kernel and the graphed prompt steps, then bench.prefix with each, interleaved
  export ONE_LOG=run.log TAIL=16
  step prefill_attn 150 python3 scripts/gpu/bench_prefill_attn.py --packed 1,2 --block-n 64,128 \
    --warps 4,8 --split 0,1 --out "$OUT/prefill_attn.json"
  TAIL=6 step gpu_prefill 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_gpu_fused.py tests/gpu/test_gpu_mixed_graphs.py
  for i in 1 2; do
    TAIL=8 step "prefix_split_$i" 60 python3 -m bench.prefix --device cuda --no-progress --rounds 2 \
      --out "$OUT/prefix_split_$i.json"
    TAIL=8 step "prefix_masked_$i" 60 env ENGINECORE_PREFILL_KERNEL=split=0 python3 -m bench.prefix \
      --device cuda --no-progress --rounds 2 --out "$OUT/prefix_masked_$i.json"
  done
elif [[ $PART == 42 ]]; then  # session 22: the next step launched before first tokens' consumers run
  # (the default now) against AsyncEngine.consumers_before_launch=true, on bench.prefix; then
  # both issues' acceptance runs
  export ONE_LOG=run.log TAIL=10
  for i in 1 2; do
    step "prefix_new_$i" 60 python3 -m bench.prefix --device cuda --no-progress --rounds 2 \
      --out "$OUT/prefix_new_$i.json"
    step "prefix_before_$i" 60 python3 scripts/gpu/with_switch.py \
      --set engine.serving.async_engine:AsyncEngine.consumers_before_launch=true - bench.prefix --device cuda \
      --no-progress --rounds 2 --out "$OUT/prefix_before_$i.json"
  done
  TAIL=14 step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
elif [[ $PART == 41 ]]; then  # session 22: the greedy one-pass sampler (no noise, one program a row)
  export ONE_LOG=run.log TAIL=14
  step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --phases --out "$OUT/structured.json"
  TAIL=8 step gpu_fused 60 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py \
    -k "one_pass or greedy"
  TAIL=12 step prefix 120 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  step structured_2 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured_2.json"
  TAIL=8 step gpu_structured 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py
elif [[ $PART == 40 ]]; then  # session 22: the 0 % baseline with text (printable_head) against without,
  # then both issues' acceptance runs on any card
  export ONE_LOG=run.log TAIL=8
  for i in 1 2; do
    step "structured_text_$i" 45 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 3 --out "$OUT/structured_text_$i.json"
    step "structured_notext_$i" 45 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 3 --no-text-head --out "$OUT/structured_notext_$i.json"
  done
  TAIL=14 step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
  TAIL=12 step prefix 120 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
elif [[ $PART == 39 ]]; then  # session 22: the constrained step's extra split finer; issue 15 on any card
  export ONE_LOG=run.log TAIL=40
  parts=engine.core.late_step:LateStep._fed,engine.runner.model_runner:ModelRunner.accept_then_fill
  parts+=,engine.runner.model_runner:_constrained,engine.structured.bitmask:TokenBitmask.accept_then_fill
  parts+=,engine.structured.native:GrammarWorker.submit,engine.core.late_step:LateStep._grammar_done
  parts+=,engine.structured.bitmask:TokenBitmask.grammar_rows,engine.runner.model_runner:sample
  parts+=,engine.ops.triton.fused_sample:sample,engine.runner.model_runner:build_sampling_batch,engine.runner.model_runner:process
  parts+=,engine.serving.intake:IntakeAPI._deliver
  # (per-step calls only; the second run also counts the consumers' wake-ups, ~256 calls a
  # step whose timing wrappers add to the loop's time)
  for i in 1 2; do
    ((i == 2)) && parts+=,engine.serving.mailbox:Mailbox._wake
    step "structured_parts_$i" 50 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 3 --phases --phase-targets "$parts" --out "$OUT/structured_parts_$i.json"
  done
  TAIL=12 step prefix 110 python3 -m bench.prefix --device cuda --no-progress --rounds 2 --out "$OUT/prefix.json"
  TAIL=60 step prefix_timeline 60 python3 -m bench.prefix_timeline --device cuda --no-progress
elif [[ $PART == 37 ]]; then  # session 20: the collector's young threshold, the acceptance runs
  export ONE_LOG=run.log TAIL=12
  lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\)|CPU max|NUMA node|Hypervisor)" | tee -a "$OUT/run.log"
  lscpu -e=CPU,CORE,SOCKET,MAXMHZ 2>/dev/null | head -20 | tee -a "$OUT/run.log"  # SMT siblings: one CORE
  gil() {  # gil FRACTION: py-spy --gil of bench.structured, summarized for the step thread
    step "gil_$1" 40 .whl/py-spy record --gil --nonblocking -r 500 -f raw -o "$OUT/gil_$1.raw" --threads -- \
      python3 -m bench.structured --device cuda --no-progress --no-plain --fractions "$1" --rounds 2 \
      --out "$OUT/gil_$1.json"
    python3 scripts/gpu/spy_summary.py "$OUT/gil_$1.raw" --thread enginecore-step \
      --within EngineCore.step --top 40 > "$OUT/gil_${1}_step.txt" 2>&1
  }
  ab() {  # ab I: gc_young_threshold 0 (CPython's 700) against the default
    step "structured_gc700_$1" 45 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 2 --engine-config '{"gc_young_threshold": 0}' \
      --out "$OUT/structured_gc700_$1.json"
    step "structured_new_$1" 45 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,1 --rounds 2 --out "$OUT/structured_new_$1.json"
  }
  step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
  if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    ab 1  # (an H100: the A/B alone, the budget kept for an H200)
    exit 0
  fi
  step prefix 150 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  ab 1
  gil 1
  ab 2
  ENGINECORE_GRAMMAR_OVERLAP=0 step structured_noworker 45 python3 -m bench.structured --device cuda \
    --no-progress --no-plain --fractions 0,1 --rounds 2 --out "$OUT/structured_noworker.json"
  gil 0
elif [[ $PART == 36 ]]; then  # session 20: issues 15 and 23's acceptance on whatever card, then the A/B
  export ONE_LOG=run.log TAIL=12
  base=${AB_BASE:-ab/base}
  step prefix 150 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
  step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
    --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
  for i in 1 2; do structured_pair $i "$base"; done
elif [[ $PART == 34 ]]; then  # session 19, issue 23: this tree against ab/base, and acceptance
  export ONE_LOG=run.log TAIL=12
  base=${AB_BASE:-ab/base}
  accept() {
    step structured 80 python3 -m bench.structured --device cuda --no-progress --no-plain \
      --fractions 0,0.5,1 --rounds 5 --out "$OUT/structured.json"
  }
  h200=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c H200)
  if ((h200)); then  # issues 15 and 23's acceptance first
    step prefix 150 python3 -m bench.prefix --device cuda --no-progress --rounds 3 --out "$OUT/prefix.json"
    accept
  fi
  for i in 1 2; do
    structured_pair $i "$base"
    step "structured_noinside_$i" 45 python3 scripts/gpu/with_switch.py \
      --set engine.core.engine_core:EngineCore.grammar_job_in_forward=false - bench.structured --device cuda \
      --no-progress --no-plain --fractions 0,1 --rounds 2 --out "$OUT/structured_noinside_$i.json"
  done
  ((h200)) || accept
  TAIL=6 step gpu_tests 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/gpu/test_gpu_structured.py tests/gpu/test_gpu_overlap.py
  for f in 1 0; do  # as PART=33, with what time is left
    step "gil_$f" 40 .whl/py-spy record --gil --nonblocking -r 500 -f raw -o "$OUT/gil_$f.raw" --threads -- \
      python3 -m bench.structured --device cuda --no-progress --no-plain --fractions "$f" --rounds 2 \
      --out "$OUT/gil_$f.json"
  done
elif [[ $PART == 20 ]]; then  # session 14 (no device then), issue 23: grammar work beside the forward
  export ONE_LOG=run.log TAIL=30
  step structured 70 python3 scripts/gpu/structured_split.py -- --device cuda --no-progress \
    --out "$OUT/structured.json"
  ENGINECORE_GRAMMAR_OVERLAP=1 step structured_beside 70 python3 scripts/gpu/structured_split.py -- \
    --device cuda --no-progress --out "$OUT/structured_beside.json"
  ENGINECORE_GRAMMAR_OVERLAP=1 ENGINECORE_GRAMMAR_SWITCH_US=200 step structured_beside_200us 70 \
    python3 scripts/gpu/structured_split.py -- --device cuda --no-progress \
    --out "$OUT/structured_beside_200us.json"
  step sync_check 60 python3 scripts/gpu/sync_check.py -- bench.structured --device cuda \
    --no-progress --fractions 0,1 --no-plain --out "$OUT/structured_sync_check.json"
  ENGINECORE_GRAMMAR_OVERLAP=1 step gpu_tests_beside 100 python3 -m pytest -q -s -m gpu \
    -p no:cacheprovider tests/gpu/test_gpu_structured.py tests/gpu/test_gpu_overlap.py
  step gpu_tests 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/gpu/test_gpu_structured.py tests/gpu/test_gpu_release.py
elif [[ $PART == 12 ]]; then  # issue 23: structured outputs' host cost
  export ONE_LOG=run.log TAIL=16
  step gpu_tests 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py \
    tests/gpu/test_gpu_overlap.py tests/gpu/test_gpu_release.py
  step xgrammar_costs 150 python3 -m bench.xgrammar_costs --fill-threads 1,4,8,14 --setups engine,padded \
    --schemas bench --out "$OUT/xgrammar_costs.json"
  step structured 150 python3 -m bench.structured --device cuda --no-progress --out "$OUT/structured.json"
  step structured_sync 120 python3 -m bench.structured --device cuda --no-progress --fractions 0,1 --no-plain \
    --engine-config '{"overlap_scheduling": false}' --out "$OUT/structured_sync.json"
elif [[ $PART == 11 ]]; then
  export ONE_LOG=run.log TAIL=14
  step gpu_tests 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu
  step logprobs 80 python3 -m bench.throughput --device cuda --no-progress --modes bare --repeat 1 \
    --logprobs-compare 20 --out "$OUT/lp20.json"
  step throughput 130 python3 -m bench.throughput --device cuda --no-progress --repeat 1 \
    --modes bare,inproc,ipc --out "$OUT/throughput.json"
  step structured 65 python3 -m bench.structured --device cuda --out "$OUT/structured.json"
else
  step lifecycle 150 python3 -m bench.lifecycle --device cuda --no-progress --cycles 20 --out "$OUT/lifecycle.json"
  step gpu_tests 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu tests/test_speculative.py
  step roofline 30 python3 -m bench.roofline --device cuda --no-progress --out "$OUT/roofline.json"
  step speculative 70 python3 -m bench.speculative --device cuda --no-progress --num-requests 32 --out "$OUT/speculative.json"
  step sigterm 120 python3 -m bench.sigterm --device cuda --no-progress --runs 3 --out "$OUT/sigterm.json"
fi
