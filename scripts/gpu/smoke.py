"""GPU smoke: load random:qwen3-0.6b bf16 with an 8 GiB KV cache, stream requests, shut down,
and print device memory before load / serving / after shutdown."""
import gc, sys, time
import anyio, torch
from engine import AsyncEngine, EngineConfig, SamplingParams


def mem():
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


async def main(n_req=int(sys.argv[1]) if len(sys.argv) > 1 else 64):
    torch.cuda.init()
    base = mem()
    print("before load", base, flush=True)
    cfg = EngineConfig(model="random:qwen3-0.6b", kv_cache_bytes=8 * 2**30, max_num_seqs=256)
    t0 = time.perf_counter()
    async with AsyncEngine.open(cfg) as eng:
        print(f"serving after {time.perf_counter() - t0:.2f}s; mem {mem()}", flush=True)
        params = SamplingParams(max_tokens=128, ignore_eos=True)
        total = 0

        async def one(i):
            nonlocal total
            async for out in eng.generate([(i * 7 + j) % 50000 for j in range(100 + i % 200)], params):
                total += len(out.token_ids)

        t = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(n_req):
                tg.start_soon(one, i)
        dt = time.perf_counter() - t
        print(f"{n_req} requests: {total} tokens in {dt:.2f}s = {total / dt:.0f} tok/s", flush=True)
        print(eng.statistics(), flush=True)
    gc.collect()
    after = mem()
    print("after shutdown", after, "equal:", after == base, flush=True)


anyio.run(main)
