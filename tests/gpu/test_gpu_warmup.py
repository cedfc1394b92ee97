"""GPU: with the warm-up (engine/core/warmup.py; ``EngineConfig.warmup``, on by default on CUDA)
nothing is compiled or captured while the first requests of each kind are served: no CUDA graph
(``CudaGraphs.capture_seconds`` counts every capture) and no Triton kernel (Triton's
``jit_cache_hook`` is called for every kernel a launch does not find compiled in memory).
Without the warm-up the same requests do capture (the counter can see it).

Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import anyio
import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.memory.owner import Resource as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class TritonCompiles:
    """Every Triton kernel launch that misses the in-memory cache (compiled, or loaded from
    the disk cache) while installed."""

    def __init__(self):
        self.seen: list[str] = []

    def hook(self, *args, **kw) -> bool:
        self.seen.append(str(kw.get("repr") or kw.get("fn") or args[:1]))
        return False  # compile as usual

    def __enter__(self):
        import triton

        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
            self._set = lambda h: setattr(knobs.runtime, "jit_cache_hook", h)
            self._old = knobs.runtime.jit_cache_hook
        else:  # older Triton: a class attribute of JITFunction
            from triton.runtime.jit import JITFunction

            self._set = lambda h: setattr(JITFunction, "cache_hook", h)
            self._old = JITFunction.cache_hook
        self._set(self.hook)
        return self

    def __exit__(self, *exc):
        self._set(self._old)


def _first_requests() -> list[list[tuple[list[int], SamplingParams]]]:
    """Rounds of concurrent requests, the kinds a server sees first: a 600-token prompt for one
    token (greedy, then sampled), a streamed one, seeded top-k/top-p, logprobs and prompt
    logprobs, penalties, a prompt chunked over two steps, then 8 and 40 at once (decode
    batches of other buckets)."""
    def prompt(n, salt):
        return [(101 + 37 * j + 1009 * salt) % 150000 for j in range(n)]

    g = SamplingParams(max_tokens=1, ignore_eos=True)
    s16 = SamplingParams(max_tokens=16, ignore_eos=True)
    return [
        [(prompt(600, 0), g)],
        [(prompt(600, 1), SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True))],
        [(prompt(600, 2), s16)],
        [(prompt(300, 3), SamplingParams(max_tokens=8, temperature=0.7, top_k=50, top_p=0.9,
                                         seed=1, ignore_eos=True))],
        [(prompt(40, 4), SamplingParams(max_tokens=8, logprobs=True, top_logprobs=3,
                                        prompt_logprobs=1, ignore_eos=True))],
        [(prompt(50, 5), SamplingParams(max_tokens=8, repetition_penalty=1.2, ignore_eos=True))],
        [(prompt(3000, 6), SamplingParams(max_tokens=4, ignore_eos=True))],
        [(prompt(100 + i, 10 + i), s16) for i in range(8)],
        [(prompt(64 + i, 30 + i), s16) for i in range(40)],
    ]


def _serve(warmup: bool) -> dict:
    async def one(eng, ids, params, rid):
        n = 0
        async for o in eng.generate(ids, params, request_id=rid):
            n += len(o.token_ids)
        assert n == params.max_tokens

    async def main():
        cfg = EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16",
                           kv_cache_bytes=2 * 2**30, max_num_seqs=64, warmup=warmup)
        async with AsyncEngine.open(cfg) as eng:
            graphs = eng.runner.resource(R.CUDA_GRAPHS)
            before = dict(graphs.capture_seconds)
            with TritonCompiles() as compiles:
                for k, round_ in enumerate(_first_requests()):
                    async with anyio.create_task_group() as tg:
                        for i, (ids, params) in enumerate(round_):
                            tg.start_soon(one, eng, ids, params, f"r{k}-{i}")
            new = {b: s for b, s in graphs.capture_seconds.items() if b not in before}
            # the counter's own check: a kernel at a dtype the engine never used compiles
            from engine.ops.triton import fused_ops

            with TritonCompiles() as probe:
                x = torch.ones((2, 64), dtype=torch.float16, device="cuda")
                fused_ops.rms_norm(x, x[0], 1e-6)
                torch.cuda.synchronize()
            return {"captured_at_load": len(before), "captured_serving": new,
                    "triton_compiles": compiles.seen, "probe_compiles": len(probe.seen)}

    return anyio.run(main)


def _in_fresh_process(warmup: bool) -> dict:
    """``_serve`` in a process of its own: Triton's in-memory kernels are per process, and an
    earlier test in this one would have compiled them already."""
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, __file__, "on" if warmup else "off"], cwd=root,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [str(root), str(root / "tests" / "gpu"), os.environ.get("PYTHONPATH", "")])),
                       capture_output=True, text=True, timeout=400)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_with_warmup_nothing_is_compiled_or_captured_while_serving():
    res = _in_fresh_process(True)
    print(f"\nwarm-up on: {res['captured_at_load']} graphs at load; while serving "
          f"{res['captured_serving']}, Triton compiles {res['triton_compiles']}")
    assert res["probe_compiles"] >= 1, res  # the hook sees compiles
    assert not res["captured_serving"], res
    assert not res["triton_compiles"], res


def test_without_warmup_serving_captures_and_compiles():
    """The counters work: without the warm-up the first decodes capture their buckets (the
    Triton kernels the load did not compile are printed)."""
    res = _in_fresh_process(False)
    print(f"\nwarm-up off: {res['captured_at_load']} graphs at load; while serving "
          f"{res['captured_serving']}, {len(res['triton_compiles'])} Triton compiles")
    assert res["probe_compiles"] >= 1, res
    assert res["captured_serving"], res


if __name__ == "__main__":
    out = _serve(sys.argv[1] == "on")
    out["captured_serving"] = sorted(str(k) for k in out["captured_serving"])
    print("RESULT " + json.dumps(out), flush=True)
