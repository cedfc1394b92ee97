"""Profile EngineCore.step on CUDA: where does a decode step's time go?

    python3 scripts/gpu/profile_step.py [batch=256]

Environment: ENGINECORE_TRITON=0 (torch gather attention), ENGINECORE_CUDA_GRAPHS=0 (no graphs),
PROFILE=0 (skip the torch profiler tables).
"""
import os, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner

r = ModelRunner(EngineConfig(model="random:qwen3-0.6b", kv_cache_bytes=16 * 2**30))
r.load()
c = EngineCore(r)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
for i in range(n):
    c.add_request(str(i), [(i * 7 + j) % 50000 for j in range(100 + i % 200)],
                  SamplingParams(max_tokens=256, ignore_eos=True))
# prefill everything first
while c.scheduler.waiting or any(q.num_computed_tokens < q.num_prompt_tokens for q in c.scheduler.running):
    c.step()
for _ in range(3):  # warm-up decode steps (compiles kernels, captures the graph)
    c.step()
torch.cuda.synchronize()
cpu0 = time.process_time()
t = time.perf_counter()
for _ in range(20):
    c.step()
torch.cuda.synchronize()
dt = (time.perf_counter() - t) / 20
ctx = [q.num_tokens for q in c.scheduler.running]
g = r._owner.get("cuda_graphs")
print(f"decode step, batch {len(c.scheduler.running)} (contexts {min(ctx)}..{max(ctx)}): "
      f"{dt * 1000:.2f} ms wall, {(time.process_time() - cpu0) / 20 * 1000:.2f} ms CPU; "
      f"graphs {'captured ' + str(g.captured) + ' in ' + str({b: round(s, 3) for b, s in g.capture_seconds.items()}) + ' s' if g else 'off'}",
      flush=True)
if g is not None and g.captured:  # the forward alone: replay the biggest graph
    b = g.captured[-1]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        g.run(b, None, None, None)
        e0.record()
        for _ in range(20):
            g.run(b, None, None, None)
        e1.record()
    torch.cuda.synchronize()
    print(f"graph replay (forward only, batch {b}): {e0.elapsed_time(e1) / 20:.2f} ms", flush=True)
if os.environ.get("PROFILE", "1") != "0":
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            c.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
r.shutdown()
