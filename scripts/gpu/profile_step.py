"""Profile EngineCore.step on CUDA: where does a step's time go?"""
import sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.params import SamplingParams
from engine.runner import ModelRunner

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
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    c.step()
torch.cuda.synchronize()
print(f"decode step, batch {len(c.scheduler.running)}: {(time.perf_counter() - t) / 20 * 1000:.1f} ms", flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        c.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
r.shutdown()
