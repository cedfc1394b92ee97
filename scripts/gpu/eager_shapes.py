"""Host cost of an eager linear whose row count M is new vs seen before (issue 15).

    python3 scripts/gpu/eager_shapes.py

Prefill steps run eagerly with a token count that changes every step. Times F.linear's host
call (no sync) for qwen3-0.6b's layer shapes in bf16: the first call at each new M, and again
at an M already seen.
"""
import random
import statistics
import time

import torch
import torch.nn.functional as F

dev = torch.device("cuda")
shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # qkv, o, gate_up, down
ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in shapes]
xs = torch.randn(8192, 3072, device=dev, dtype=torch.bfloat16)


def host_us(m: int) -> list[float]:
    out = []
    for w in ws:
        x = xs[:m, : w.shape[1]]
        t = time.perf_counter()
        F.linear(x, w)
        out.append((time.perf_counter() - t) * 1e6)
    return out


for m in (64, 128, 256):  # warm up cuBLAS itself
    host_us(m)
torch.cuda.synchronize()
rng = random.Random(0)
new_ms = rng.sample(range(300, 8000), 40)
first = [host_us(m) for m in new_ms]
torch.cuda.synchronize()
again = [host_us(m) for m in new_ms]
torch.cuda.synchronize()
for name, rows in (("new M", first), ("seen M", again)):
    per = list(zip(*rows))
    print(f"{name:7s} host us per call, median by shape (qkv, o, gate_up, down): "
          + ", ".join(f"{statistics.median(p):.0f}" for p in per))
for lib in ("cublaslt", "cublas"):
    try:
        torch.backends.cuda.preferred_blas_library(lib)
    except Exception as exc:  # noqa: BLE001
        print(lib, exc)
        continue
    ms = rng.sample(range(300, 8000), 20)
    a = [host_us(m) for m in ms]
    b = [host_us(m) for m in ms]
    torch.cuda.synchronize()
    print(f"{lib}: new M {statistics.median(sum(a, [])):.0f} us, seen M "
          f"{statistics.median(sum(b, [])):.0f} us a call")
