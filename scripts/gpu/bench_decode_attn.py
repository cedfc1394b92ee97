"""Decode attention alone, one qwen3-0.6b layer shape (16 q heads, 8 KV heads, D=128, bf16,
block 16), batch 256, contexts 100..450: the Triton kernel vs the torch gather path, with the
bytes of K/V read against the time (memory roofline ~4.3-4.8 TB/s)."""
import torch
from engine.ops.triton import decode_attention as ta
from engine.model.attention import AttentionMetadata, decode_attention_torch

torch.manual_seed(0)
B, H, KVH, D, bs = 256, 16, 8, 128, 16
for lo, hi in ((100, 450), (2000, 4000)):
    lens = torch.randint(lo, hi, (B,)).tolist()
    width = max(-(-n // bs) for n in lens)
    nblocks = B * width + 1
    cache = torch.randn(2, nblocks, bs, KVH, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(nblocks, device="cuda")[: B * width].view(B, width)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(B, device="cuda")
    cl = torch.tensor(lens, device="cuda")
    out = torch.empty_like(q)
    meta = AttentionMetadata(None, [], rows, bt, cl, max(lens))
    kv_bytes = sum(lens) * KVH * D * 2 * 2

    def bench(fn, n=20):
        fn(); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            fn()
        e1.record(); torch.cuda.synchronize()
        return e0.elapsed_time(e1) / n

    tt = bench(lambda: ta.decode_attention(q, cache, rows, bt, cl, D ** -0.5, out))
    o2 = torch.empty_like(q)
    tr = bench(lambda: decode_attention_torch(q, cache, meta, D ** -0.5, o2))
    err = (out.float() - o2.float()).abs().max().item()
    print(f"B={B} ctx {lo}..{hi}: K/V {kv_bytes / 1e6:.0f} MB; triton {tt * 1000:.0f} us "
          f"({kv_bytes / tt / 1e9:.2f} TB/s), torch {tr * 1000:.0f} us ({kv_bytes / tr / 1e9:.2f} TB/s); "
          f"max|diff| {err:.2e}", flush=True)
    del cache
