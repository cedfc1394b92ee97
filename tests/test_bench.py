"""The benchmarks still run and write what bench/RESULTS.md reports (tiny workloads, CPU)."""

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str, *args: str, timeout: float = 240, package: str = "bench") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"{package}.{name}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_throughput_every_engine_mode_in_its_own_process(tmp_path):
    out = tmp_path / "t.json"
    p = _bench("throughput", "--device", "cpu", "--no-progress", "--num-requests", "6",
               "--min-input", "8", "--max-input", "24", "--min-output", "4", "--max-output", "12",
               "--repeat", "1", "--warmup", "1", "--copy-mib", "16", "--timeline", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["mode"]: r for r in res["modes"]}
    assert set(rows) == {"bare", "inproc", "ipc"}
    for mode in ("bare", "inproc"):  # --timeline: the timed run's steps (bench/step_timeline.py)
        tl = rows[mode]["timeline"]
        assert tl["steps"] >= rows[mode]["steps"] > 0, (mode, tl)
        assert tl["in_steps_s"] + tl["gaps_s"] <= tl["wall_s"] * 1.001, (mode, tl)
        assert sum(k["n"] for k in tl["by_kind"].values()) == tl["steps"]
        assert "prompt" in tl["by_kind"]
    assert "[inproc] timeline" in p.stdout
    expected = res["workload"]["output_tokens"]
    for mode, row in rows.items():
        assert "error" not in row, (mode, row)
        assert row["output_tokens"] == expected and row["requests"] == 6
        assert row["output_tok_s"] > 0 and row["ttft_p50_ms"] is not None and row["itl_p99_ms"] is not None
        # every mode knows its steps (the IPC one from the engine's health) and has a roofline
        assert row["roofline_steps"] == row["steps"] > 0, (mode, row)
        assert row["workload_bytes"] > 0 and row["bandwidth_GBps"] > 0
        assert row["roofline_pct"] == pytest.approx(100 * row["floor_s"] / row["wall_s"])
    assert set(res["ratios"]) >= {"inproc/bare", "ipc/inproc"}
    assert "nano-vllm workload" in p.stdout and "ratios" in p.stdout and "roof %" in p.stdout


def test_workload_bytes_counts_weights_per_step_and_kv_per_token():
    from bench.roofline import workload_bytes, workload_kv_tokens

    # prompt 3, 4 outputs: prompt K/V read 3 + written 3; decode at positions 3, 4, 5 reads
    # 4 + 5 + 6 and writes 3. prompt 2, 1 output: no decode token.
    work = [([0] * 3, 4), ([0] * 2, 1)]
    assert workload_kv_tokens(work) == (3 + 15 + 2, 6 + 2)
    assert workload_bytes(work, steps=5, wbytes=100, kv_tok=10) == {
        "weights": 500, "kv_read": 200, "kv_write": 80, "total": 780}


def test_roofline_runs_both_schedules_and_pipelined_steps_sample_what_synchronous_ones_do(tmp_path):
    """bench.roofline reports a synchronous and a pipelined (overlapped) step per point; the
    pipelined loop launches each step before collecting the one before, and its steps sample
    exactly the tokens the synchronous ``execute`` does (greedy, same batch)."""
    from bench.roofline import decode_batch, pipelined_times
    from engine.config import EngineConfig
    from engine.runner.model_runner import ModelRunner

    out = tmp_path / "r.json"
    p = _bench("roofline", "--device", "cpu", "--model", "random:tiny-llama", "--batches", "1", "3",
               "--contexts", "40", "--iters", "2", "--warmup", "1", "--copy-mib", "16",
               "--no-progress", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    points = json.loads(out.read_text())["points"]
    assert [(r["batch"], r["context"]) for r in points] == [(1, 40), (3, 40)]
    for r in points:
        assert r["pipelined_ms"] > 0 and r["step_ms"] > 0
        assert r["pct_bw_roofline_pipelined"] == pytest.approx(r["mem_floor_ms"] / r["pipelined_ms"] * 100)
    assert "pipelined ms" in p.stdout

    runner = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=16,
                                      max_num_seqs=4, max_model_len=64))
    runner.load()
    try:
        batch = decode_batch(runner, 3, 40)
        want = runner.execute(batch).tokens
        assert len(pipelined_times(runner, batch, warmup=1, iters=3)) == 3
        got = [runner.collect(runner.launch(batch, defer=True)).tokens for _ in range(2)]
        assert got == [want, want]
    finally:
        runner.shutdown()


def test_nano_vllm_workload_floor_is_about_4_s_on_an_h200():
    """The order of magnitude: qwen3-0.6b bf16, 256 requests in/out U[100, 1024], ~1,096
    engine steps, ~4.2 TB/s: the floor is roughly 4 s (no model is run)."""
    import torch

    from bench.common import nano_vllm_workload
    from bench.roofline import float_weight_bytes, workload_bytes
    from engine.model.presets import PRESETS

    cfg = PRESETS["qwen3-0.6b"]
    wbytes = float_weight_bytes(cfg, torch.bfloat16)
    assert 1.1e9 < wbytes < 1.3e9  # ~0.6 B parameters, the tied embedding once
    work = nano_vllm_workload(256, 100, 1024, 100, 1024, cfg.vocab_size, 0)
    need = workload_bytes(work, 1096, wbytes, cfg.kv_bytes_per_token * 2)
    assert 3.0 < need["total"] / 4.2e12 < 4.5, need


def test_codec_msgspec_against_pickle(tmp_path):
    out = tmp_path / "c.json"
    p = _bench("codec", "--sizes", "1", "8", "--min-time", "0.01", "--repeat", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert out.exists() and "pickle" in p.stdout


def test_throughput_hf_peers_on_the_same_weights(tmp_path):
    """Both transformers peers run (here on cpu) and deliver exactly the requested tokens."""
    import pytest

    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    p = _bench("throughput", "--device", "cpu", "--no-progress", "--num-requests", "5",
               "--min-input", "8", "--max-input", "24", "--min-output", "4", "--max-output", "12",
               "--repeat", "1", "--warmup", "1", "--modes", "hf-generate,hf-cb", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["mode"]: r for r in res["modes"]}
    for mode in ("hf-generate", "hf-cb"):
        row = rows[mode]
        if "skipped" in row:  # a transformers without continuous batching
            continue
        assert "error" not in row, (mode, row)
        assert row["output_tokens"] == res["workload"]["output_tokens"] and row["output_tok_s"] > 0


def test_sleep_bench_levels_cycles_and_identical_outputs(tmp_path):
    out = tmp_path / "s.json"
    p = _bench("sleep", "--device", "cpu", "--no-progress", "--cycles", "3", "--batch", "2",
               "--prompt-len", "8", "--max-tokens", "6", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    (model,) = res["models"]
    assert model["model"] == "random:tiny-llama" and set(model["levels"]) == {"1", "2"}
    for level, row in model["levels"].items():
        assert row["outputs_identical"] and row["sleep_s"] > 0 and row["wake_s"] > 0, (level, row)
        assert {"release_s", "offload_s", "empty_cache_s"} <= set(row["sleep_parts"])
        assert "weights_s" in row["wake_parts"] and "kv_cache_s" in row["wake_parts"]
    assert model["levels"]["1"]["host_bytes_kept"] > 0 == model["levels"]["2"]["host_bytes_kept"]
    assert model["cycles"]["n"] == 3 and model["outputs_identical_after_cycles"]
    assert "level 1: sleep" in p.stdout and "3 cycles" in p.stdout


def test_prefix_caching_on_and_off(tmp_path):
    """The chat workload runs with the cache on and off: same greedy answers, hits only when on."""
    out = tmp_path / "p.json"
    p = _bench("prefix", "--device", "cpu", "--no-progress", "--system-len", "40",
               "--conversations", "3", "--turns", "2", "--min-user", "4", "--max-user", "12",
               "--max-tokens", "6", "--rounds", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["mode"]: r for r in res["modes"]}
    assert set(rows) == {"on", "off"}
    for row in rows.values():
        assert row["output_tokens"] == 3 * 2 * 6 and row["ttft_p50_ms"] is not None
        # two interleaved rounds: the row is the lower of the two TTFT p50s (the median rule)
        assert len(row["ttft_p50_ms_by_round"]) == 2
        assert row["ttft_p50_ms"] == min(row["ttft_p50_ms_by_round"])
    assert len(res["ratios"]["ttft_p50 off/on by round"]) == 2
    assert rows["on"]["identical"] is True
    assert rows["on"]["hit_ratio"] > 0.3 and rows["off"]["prefix_cache_hits"] == 0
    assert rows["on"]["computed_prompt_tokens"] < rows["off"]["computed_prompt_tokens"]
    assert "hit ratio" in p.stdout and "ttft_p50 off/on" in p.stdout


def test_structured_outputs_bench(tmp_path):
    out = tmp_path / "s.json"
    p = _bench("structured", "--device", "cpu", "--model", "random:tiny-llama", "--no-progress",
               "--requests", "2", "--max-tokens", "96", "--items", "1", "--out", str(out),
               "--engine-config", '{"overlap_scheduling": true}')
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [m["constrained"] for m in res["modes"]] == ["0 %", "50 %", "100 %", "100 % plain"]
    assert all(m["tok_s"] > 0 for m in res["modes"])
    # constrained requests keep the overlap; their steps are sampled late, timed by part
    last = res["modes"][2]
    assert last["overlapped"] > 0.8 * last["steps"] and last["late"] > 0.8 * last["steps"]
    assert last["late_mask_sample_ms"] >= 0 and res["modes"][0]["late"] == 0
    assert last["valid"] == "2/2"  # random weights: the mask alone makes it JSON
    assert res["modes"][3]["late"] > 0 and res["modes"][3]["output_tokens"] > 0
    assert {c["schema"] for c in res["compile"]} == {"person", "order", "json_object"}


def test_structured_bench_rounds(tmp_path):
    """--rounds: the fractions interleaved; each row the median run, each round's ratio."""
    out = tmp_path / "s.json"
    p = _bench("structured", "--device", "cpu", "--model", "random:tiny-llama", "--no-progress",
               "--requests", "2", "--max-tokens", "8", "--items", "1", "--fractions", "0,1",
               "--rounds", "3", "--no-plain", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    modes = json.loads(out.read_text())["modes"]
    assert [m["constrained"] for m in modes] == ["0 %", "100 %"]
    for m in modes:
        assert len(m["tok_s_by_round"]) == 3
        assert m["tok_s"] == sorted(m["tok_s_by_round"])[1]
    assert modes[0]["vs_unconstrained_by_round"] == [1.0, 1.0, 1.0]
    assert len(modes[1]["vs_unconstrained_by_round"]) == 3
    assert "100 %: vs 0 % by round" in p.stdout


def test_structured_bench_step_parts(tmp_path):
    """--timeline --phases: each mode's steps, its threads' CPU a step and the step's parts
    (calls, wall, CPU a step), the parts timed by the class-level patches the bench installs."""
    out = tmp_path / "s.json"
    p = _bench("structured", "--device", "cpu", "--model", "random:tiny-llama", "--no-progress",
               "--requests", "4", "--max-tokens", "8", "--items", "1", "--fractions", "0,1",
               "--no-plain", "--timeline", "--phases", "--engine-config",
               '{"overlap_scheduling": true}', "--out", str(out),
               "--phase-targets", "engine.runner.model_runner:sample,engine.core.late_step:LateStep._fed")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    modes = res["modes"]
    # a random: preset's head keeps printable ASCII alone (and tab, newline): the unconstrained
    # greedy tokens are text, one character each, not ids that decode to nothing
    assert res["head_rows_zeroed"] == 512 - 97
    assert modes[0]["text_chars"] == modes[0]["output_tokens"] > 0
    for m in modes:
        assert m["timeline"]["steps"] >= m["steps"] > 0
        parts = m["phases_per_step"]
        assert 0.9 <= parts["Scheduler.schedule"]["calls"] <= 1.5
        for v in parts.values():
            assert v["wall_ms"] >= 0 and v["cpu_ms"] >= 0
        if sys.platform == "linux":
            assert m["threads_per_step"]["enginecore-step"]["cpu_ms"] > 0
            assert 0 <= m["steal"] <= 1
    # the constrained run's steps are late-sampled: the grammar job is timed, not the launch
    assert "LateStep._grammar_job" in modes[1]["phases_per_step"]
    # --phase-targets: a module's global (the runner's sampler calls) and one more method
    assert modes[0]["phases_per_step"]["sample"]["calls"] >= 0.9
    assert modes[1]["phases_per_step"]["LateStep._fed"]["calls"] > 0
    assert "ModelRunner.launch" in modes[0]["phases_per_step"]
    assert "threads, a step" in p.stdout and "Scheduler.schedule" in p.stdout


def test_xgrammar_costs_bench(tmp_path):
    out = tmp_path / "x.json"
    p = _bench("xgrammar_costs", "--model", "random:tiny-llama", "--requests", "4", "--items",
               "1", "--fill-threads", "1,2", "--max-steps", "30", "--out", str(out), package="tools")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["schema"], r["setup"]) for r in rows] == [
        (s, k) for s in ("bench", "plain") for k in ("engine", "uncounted", "padded")]
    assert [r["grammar_vocab"] for r in rows] == [288, 288, 512] * 2
    for r in rows:
        assert r["same"]  # equal masks, equal draws: the same outputs in every setup
        assert r["steps"] > 0 and r["fill_1_ms"] > 0 and r["batch_fill_2_ms"] > 0
        assert r["accept_loop_ms"] > 0 and r["accept_batch_ms"] > 0
        assert abs(sum(v["share"] for v in r["by_state"].values()) - 1) < 1e-6
        assert r["by_state"]["string"]["rows"] > 0


def test_soak_picks_attackers_by_name():
    import argparse

    import pytest

    from bench import soak

    parse = soak._names(soak.ATTACKS)
    assert parse("") == () and parse("http,ipc") == ("http", "ipc")
    with pytest.raises(argparse.ArgumentTypeError):
        parse("http,nope")
    assert "huge_stop_ids" in soak.HTTP_KINDS


def test_host_overhead_runs_both_modes_with_the_null_model(tmp_path):
    out = tmp_path / "h.json"
    p = _bench("host_overhead", "--requests", "6", "--tokens", "5", "--rounds", "1", "--out", str(out),
               package="tools")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    (row,) = res["rounds"]
    assert row["bare_us"] > 0 and row["inproc_us"] > 0
    assert row["ratio"] == pytest.approx(row["bare_us"] / row["inproc_us"])
    assert "in-process / bare" in p.stdout


def test_host_overhead_against_the_simulated_device(tmp_path):
    out = tmp_path / "h.json"
    p = _bench("host_overhead", "--requests", "6", "--tokens", "5", "--rounds", "1", "--sim", "h200",
               "--out", str(out), package="tools")
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rounds"]
    # 6 requests x 5 tokens: ~6 steps of ~1.4 ms simulated, the host's share beside them
    assert 0.05 < row["bare_busy"] <= 1.0 and 0.05 < row["inproc_busy"] <= 1.0
    assert "device busy" in p.stdout


@pytest.mark.alone  # asserts wall-clock bounds
def test_simulated_device_queues_steps_like_a_stream():
    import time
    from types import SimpleNamespace as NS

    from bench.device_sim import CostModel, SimDevice

    model = CostModel(base_ms=20.0, row_us=1000.0, ctx_ns=1e6, prompt_us=100.0)
    decode = [(NS(num_computed_tokens=9, num_known_tokens=10), 1)]  # 1 row, ctx 10
    prefill = [(NS(num_computed_tokens=0, num_known_tokens=30), 20)]  # 20 prompt tokens, no row
    # (forward: base + context + prompt; sampling: its rows)
    assert model.seconds(decode) == pytest.approx((0.020 + 0.010, 0.001))
    assert model.seconds(prefill) == pytest.approx((0.020 + 0.020 + 0.002, 0.0))
    dev = SimDevice(model)
    t0 = time.perf_counter()
    a, b = dev.enqueue(0.031), dev.enqueue(0.031)  # the second starts when the first ends
    assert b.at - a.at == pytest.approx(0.031, abs=1e-6) and a.at - t0 >= 0.031 - 1e-6
    assert not b.query()
    b.synchronize()
    assert b.query() and time.perf_counter() - t0 >= 0.062 - 1e-4
    assert dev.busy_s == pytest.approx(0.062)
    time.sleep(0.01)  # the device idles: the next work starts when it is queued
    c = dev.enqueue(0.005)
    assert c.at - time.perf_counter() == pytest.approx(0.005, abs=2e-3)


def test_prefill_kernel_sweep_dry_run(tmp_path):
    """scripts/gpu/bench_prefill_attn.py's own logic (scripts/gpu/kernels.sh runs it): its dry run
    in Triton's interpreter sweeps, checks every choice against the plain kernel and writes the
    rows."""
    pytest.importorskip("triton")
    out = tmp_path / "p.json"
    p = subprocess.run([sys.executable, "scripts/gpu/bench_prefill_attn.py", "--dry-run",
                        "--packed", "1,2", "--block-n", "64", "--warps", "4", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["shape"], r["packed"]) for r in rows} == {(s, k) for s in ("cached", "fresh")
                                                       for k in (1, 2)}
    assert all(r["max_diff"] <= 1e-5 and r["ms"] > 0 for r in rows)


def test_structured_split_runs_with_the_worker_and_its_diagnostic(tmp_path):
    """tools/structured_split.py (the device's split of a constrained step) on CPU: both modes,
    with the diagnostic flag; every part it times shows up, the
    grammar worker's submit and wait included (the worker is built where CI runs)."""
    from engine.structured import native

    out = tmp_path / "st.json"
    done = subprocess.run(
        [sys.executable, "-m", "tools.structured_split", "--deliver-after-step", "--",
         "--device", "cpu", "--model", "random:tiny-llama", "--requests", "8",
         "--max-tokens", "12", "--items", "2", "--engine-config",
         '{"overlap_scheduling": true}', "--fractions", "0,1", "--no-plain", "--no-progress",
         "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = {line.split()[0] for line in done.stdout.splitlines()[-14:] if line.strip()}
    assert {"step", "forward", "sample_step", "mask", "sample", "apply"} <= parts, done.stdout
    if native.worker_module() is not None:
        assert {"job_submit", "job_wait"} <= parts, done.stdout
    assert out.exists()


def test_prefix_profile_script_runs_on_cpu(tmp_path):
    """tools/profile_prefix.py on CPU: the profiled caching-on run prints its ops with their time
    per call and writes them."""
    out = tmp_path / "pp.json"
    p = subprocess.run([sys.executable, "-m", "tools.profile_prefix", "--device", "cpu",
                        "--conversations", "2", "--turns", "2", "--system-len", "40", "--top", "5",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "us/call" in p.stdout and "caching on:" in p.stdout
    rows = json.loads(out.read_text())["cpu"]
    assert len(rows) == 5 and all(r["calls"] > 0 for r in rows)


def test_spy_summary_counts_one_threads_samples(tmp_path, capsys):
    """tools/spy_summary.py: a py-spy raw profile's samples of one thread, by function
    (once a sample however often it recurs) and by innermost line; ``within`` keeps the stacks
    through one frame."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("spy_summary", ROOT / "tools" / "spy_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prof = tmp_path / "p.raw"
    prof.write_text(
        "thread (1): enginecore-step;run (a.py:1);step (core.py:10);f (x.py:3) 5\n"
        "thread (1): enginecore-step;run (a.py:1);step (core.py:11);f (x.py:3);f (x.py:4) 2\n"
        "thread (1): enginecore-step;run (a.py:1);idle (a.py:9) 4\n"
        "thread (2): MainThread;loop (b.py:2) 7\n"
        "garbage\n")
    total, inclusive, by_line = mod.summarize(prof.read_text().splitlines(), "enginecore-step")
    assert total == 11
    assert inclusive["run (a.py)"] == 11 and inclusive["step (core.py)"] == 7
    assert inclusive["f (x.py)"] == 7  # a recursive frame counts once a sample
    assert by_line["f (x.py:3)"] == 5 and by_line["f (x.py:4)"] == 2
    total, inclusive, _ = mod.summarize(prof.read_text().splitlines(), "enginecore-step",
                                        within="step (core.py")
    assert total == 7 and "idle (a.py)" not in inclusive
    assert mod.main([str(prof), "--thread", "MainThread", "--top", "3"]) == 0
    assert "7 samples of thread 'MainThread'" in capsys.readouterr().out
    assert mod.main([str(prof), "--thread", "nobody"]) == 1


def test_step_parts_patches_are_given_back():
    """bench.step_timeline.phases wraps methods (static ones too) and puts them back."""
    from bench import step_timeline
    from engine.core.late_step import LateStep
    from engine.core.scheduler import Scheduler

    done, schedule = LateStep.__dict__["_grammar_done"], Scheduler.__dict__["schedule"]
    with step_timeline.phases(("engine.core.late_step:LateStep._grammar_done",
                               "engine.core.scheduler:Scheduler.schedule")) as totals:
        assert isinstance(LateStep.__dict__["_grammar_done"], staticmethod)
        assert LateStep.__dict__["_grammar_done"] is not done
        with pytest.raises(AttributeError):  # the wrapped function runs, and is counted
            LateStep._grammar_done(None, None, None)
        assert totals["LateStep._grammar_done"][0] == 1
    assert LateStep.__dict__["_grammar_done"] is done
    assert Scheduler.__dict__["schedule"] is schedule
    later = step_timeline.phase_deltas({"a": [1, 0.0, 0.0]}, {"a": [3, 0.004, 0.002]}, 2)
    assert later == {"a": {"calls": 1.0, "wall_ms": 2.0, "cpu_ms": 1.0}}


def test_text_head_under_tensor_parallel_is_text_or_reports_nothing(tmp_path):
    """Tensor parallel: the driver holds one slice of the LM head, the workers the rest, out of
    printable_head's reach: it zeroes nothing and says so, rather than claiming a text baseline
    whose tokens come from the other slices."""
    out = tmp_path / "s.json"
    p = _bench("structured", "--device", "cpu", "--model", "random:tiny-llama", "--no-progress",
               "--requests", "2", "--max-tokens", "8", "--items", "1", "--fractions", "0",
               "--no-plain", "--engine-config", '{"tensor_parallel_size": 2}', "--out", str(out),
               timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    m = res["modes"][0]
    assert res["head_rows_zeroed"] == 0 or m["text_chars"] == m["output_tokens"], (
        res["head_rows_zeroed"], m["text_chars"], m["output_tokens"])


def test_weight_sync_bench_runs_on_cpu(tmp_path) -> None:
    """bench.weight_sync end to end on a tiny model: every path's row, outputs equal to a fresh
    engine given the same weights (its exit status)."""
    import json

    from bench import weight_sync

    out = tmp_path / "ws.json"
    assert weight_sync.main(["--device", "cpu", "--rounds", "1", "--no-progress",
                             "--out", str(out)]) == 0
    res = json.loads(out.read_text())["models"][0]
    assert set(res["paths"]) == {"tensors", "distributed", "sleep"}
    assert res["paths"]["tensors"]["kept_stream_tokens"] == 64


def test_serve_bench_drives_the_real_server_and_the_in_process_run(tmp_path):
    """bench.serve: the real ``enginecore serve --http`` from two client processes, two load
    points, every token counted (the usage agrees), and the in-process figure beside it."""
    out = tmp_path / "s.json"
    p = _bench("serve", "--device", "cpu", "--no-progress", "--num-requests", "6", "--min-input", "8",
               "--max-input", "24", "--min-output", "4", "--max-output", "12", "--warmup", "0",
               "--concurrency", "2,6", "--clients", "2", "--client", "httpx", "--out", str(out),
               timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    expected = res["workload"]["output_tokens"]
    (rnd,) = res["rounds"]
    assert [pt["concurrency"] for pt in rnd["points"]] == [2, 6]
    for pt in rnd["points"]:
        assert pt["errors"] == 0 and pt["requests"] == 6, pt
        assert pt["output_tokens"] == expected and pt["usage_disagrees"] == 0, pt
        assert pt["output_tok_s"] > 0 and pt["ttft_p50_ms"] > 0 and pt["itl_p99_ms"] is not None
        assert pt["e2e_p99_ms"] >= pt["ttft_p99_ms"] > 0
    assert rnd["inproc"]["output_tokens"] == expected
    assert set(rnd["ratios"]) >= {"out_tok_s", "ttft_p50"}
    assert res["server"]["api_servers"] == 1 and res["server_exit_code"] == 0
    assert "HTTP / in-process at the burst" in p.stdout
    # TTFT by hop: every request in each figure; the server's and the engine's intervals lie
    # within the client's (one clock for every process of the machine), so their means do too
    slack = 1.0  # ms: float sums
    for pt in rnd["points"]:
        hops = pt["hops"]
        assert hops["scraped"] is True
        assert hops["client_send_offset"]["n"] == 6 and hops["client_send_offset"]["p50_ms"] >= 0
        for key in ("client_ttft", "client_head", "client_head_to_first", "client_e2e",
                    "server_ttft", "submit", "queue", "prefill", "arrival_offset", "server_e2e"):
            assert hops[key]["n"] == 6, (key, hops[key])
            assert hops[key]["p50_ms"] <= hops[key]["p99_ms"], (key, hops[key])
        mean = {k: v["mean_ms"] for k, v in hops.items() if isinstance(v, dict)}
        assert 0 < mean["server_ttft"] <= mean["client_ttft"] + slack, mean
        assert mean["submit"] + mean["queue"] + mean["prefill"] <= mean["server_ttft"] + slack
        assert mean["client_minus_server"] >= -slack and mean["api_engine_residual"] >= -slack
        assert mean["client_head"] <= mean["client_ttft"] and mean["server_e2e"] <= mean["client_e2e"]
    ip = rnd["inproc"]["hops"]
    for key in ("inproc_ttft", "queue", "prefill", "arrival_offset"):
        assert ip[key]["n"] == 6, (key, ip[key])
    assert ip["queue"]["mean_ms"] + ip["prefill"]["mean_ms"] <= ip["inproc_ttft"]["mean_ms"] + slack
    assert ip["inproc_residual"]["mean_ms"] >= -slack
    assert "TTFT by hop" in p.stdout and "= server - submit - queue - prefill" in p.stdout
    # no matplotlib here: the plot is skipped with a note (a PNG where it is installed)
    assert out.with_suffix(".png").exists() or any("matplotlib" in n for n in res["notes"])


def test_serve_hops_from_metrics_texts_also_of_an_older_server():
    """bench.serve_hops: histogram deltas between two scrapes (series summed over their labels,
    quantiles within buckets), vLLM's name where ours is missing, and "-" for a family an older
    server does not serve."""
    from types import SimpleNamespace

    from bench import serve_hops as sh

    def text(families: dict) -> str:
        lines = ["# HELP x y"]
        for name, (counts, total) in families.items():
            labels = 'engine="0",model_name="m",' if name.startswith("vllm:") else ""
            running = 0
            for le, c in zip(("0.1", "1.0", "+Inf"), counts):
                running += c
                lines.append(f'{name}_bucket{{{labels}le="{le}"}} {float(running)}')
            lines += [f"{name}_sum{{{labels[:-1]}}} {total}", f"{name}_count {float(running)}"]
        return "\n".join(lines) + "\n"

    ttft, queue = "vllm:time_to_first_token_seconds", "enginecore_request_queue_time_seconds"
    before = text({ttft: ((1, 0, 0), 0.05), queue: ((2, 0, 0), 0.02)})
    after = text({ttft: ((1, 4, 0), 2.05), queue: ((4, 2, 0), 1.02)})
    h = sh.parse(after)[ttft]
    assert h.bounds == (0.1, 1.0) and h.counts == (1, 4, 0) and h.sum == 2.05
    d = sh.delta(sh.parse(before)[ttft], h)
    assert d.counts == (0, 4, 0) and d.count == 4
    assert sh.quantile(d, 0.5) == pytest.approx(0.55)  # 2 of 4 in (0.1, 1.0]: half way
    assert sh.quantile(sh.Hist((0.1,), (0, 3), 9.0), 0.99) == 0.1  # +Inf: the last finite bound
    results = [SimpleNamespace(error=None, submit=0.0, head=0.4, first=0.6, end=1.0)] * 4
    hops = sh.http_hops(results, before, after)
    assert hops["server_ttft"]["family"] == ttft  # vLLM's name: ours is not in this exposition
    assert hops["server_ttft"]["mean_ms"] == pytest.approx(500) and hops["server_ttft"]["n"] == 4
    assert hops["queue"]["n"] == 4 and hops["queue"]["mean_ms"] == pytest.approx(250)
    assert hops["client_ttft"]["mean_ms"] == pytest.approx(600)
    assert hops["client_head_to_first"]["mean_ms"] == pytest.approx(200)
    assert hops["client_minus_server"]["mean_ms"] == pytest.approx(100)
    # not served by this (older) server: "-"; without a prefill figure there is no residual
    assert hops["submit"] is None and hops["prefill"] is None and hops["arrival_offset"] is None
    assert hops["api_engine_residual"] is None
    rows = {r["hop"]: r for r in sh.rows(hops, "HTTP")}
    assert rows["  API: route -> submit"]["mean_ms"] is None
    assert rows["server TTFT"]["p50_ms"] == pytest.approx(550)
    # with a prefill figure but no time to submit: the residual says what it still includes
    prefill = "vllm:request_prefill_time_seconds"
    hops = sh.http_hops(results, text({ttft: ((1, 0, 0), 0.05), queue: ((2, 0, 0), 0.02),
                                       prefill: ((0, 0, 0), 0.0)}),
                        text({ttft: ((1, 4, 0), 2.05), queue: ((4, 2, 0), 1.02),
                              prefill: ((4, 0, 0), 0.2)}))
    assert hops["api_engine_residual"]["mean_ms"] == pytest.approx(500 - 250 - 50)
    assert hops["api_engine_residual"]["includes"] == ["submit"]
    # a scrape that failed: the client's rows only
    hops = sh.http_hops(results, None, after)
    assert hops["scraped"] is False and hops["server_ttft"] is None and hops["client_ttft"]["n"] == 4
    assert sh.engine_hists(SimpleNamespace(queue_time_counts=None)) == {}


@pytest.mark.asyncio
async def test_serve_bench_raw_client_reads_what_httpx_reads():
    """bench.serve's two clients count the same tokens of the same stream, and both record a
    refusal as an error with its status."""
    import httpx
    import msgspec

    sys.path.insert(0, str(ROOT / "tests" / "http"))
    from http_helpers import served

    from bench.serve_client import Item, Result, one, one_raw

    body = {"prompt": [5, 6, 7], "max_tokens": 9, "ignore_eos": True, "temperature": 0,
            "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    async with served() as s:
        url = httpx.URL(s.base_url)
        async with httpx.AsyncClient(base_url=s.base_url) as client:
            got = {}
            for name, send, target in (("raw", one_raw, (url.host, url.port)),
                                       ("httpx", one, client)):
                ok, bad = Result(i=0), Result(i=1)
                good_body = msgspec.Raw(json.dumps(body).encode())
                bad_body = msgspec.Raw(json.dumps({**body, "max_tokens": -1}).encode())
                await send(target, "/v1/completions", Item(0, good_body), ok)
                await send(target, "/v1/completions", Item(1, bad_body), bad)
                assert ok.error is None and ok.tokens == 9 == ok.usage_tokens, (name, ok)
                assert ok.finish == "length" and len(ok.itl) == 8 and ok.end >= ok.first >= ok.submit
                assert ok.first >= ok.head >= ok.submit and bad.head is not None
                assert bad.error.startswith("HTTP 400") and bad.tokens == 0, (name, bad)
                got[name] = ok.tokens
    assert got["raw"] == got["httpx"]


def test_first_request_compares_the_first_request_with_warm_ones(tmp_path):
    """bench.first_request: in process and over HTTP, each in its own process, a first request
    and warm ones of each kind, their ratios; the warm-up's flag reaches the engine."""
    out = tmp_path / "fr.json"
    p = _bench("first_request", "--device", "cpu", "--prompt-tokens", "24", "--stream-tokens", "4",
               "--warm", "2", "--warmup", "on", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    runs = {r["mode"]: r for r in res["runs"]}
    assert set(runs) == {"inproc", "http"}
    for run in runs.values():
        assert run["warmup"] is True and run["ready_s"] > 0
        for kind in ("prefill", "stream"):
            k = run["kinds"][kind]
            assert k["first_ttft_ms"] > 0 and k["warm_ttft_ms"] > 0
            assert k["ttft_ratio"] == pytest.approx(k["first_ttft_ms"] / k["warm_ttft_ms"])
    assert runs["inproc"]["graphs_captured_after_ready"] == 0  # CPU: no graphs at all
    assert "[http] warm-up on" in p.stdout and "TTFT first" in p.stdout
