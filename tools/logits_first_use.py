"""The LM head's first use per row count on CUDA: ``model.logits`` on ``m`` rows (contiguous,
and gathered by an index as a mixed step does) for every ``m`` up to ``--rows``, the first call
per ``m`` against the second (host ms; each call synced). A cold engine pays the first-call
cost at every new batch size a burst goes through.

    python3 -m tools.logits_first_use [--model random:qwen3-0.6b] [--rows 256]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine.config import EngineConfig
from engine.memory.owner import Resource as R
from engine.runner.model_runner import ModelRunner


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--warmup", default="on", choices=["on", "off"])
    a = ap.parse_args()
    r = ModelRunner(EngineConfig(model=a.model, device="cuda", kv_cache_bytes=2 * 2**30,
                                 enable_prefix_caching=False, warmup=a.warmup == "on"))
    r.load()
    model = r._owner[R.WEIGHTS]
    hidden = torch.randn(2 * a.rows + 8, model.config.hidden_size, device="cuda",
                         dtype=model.model.norm.weight.dtype)
    out = {}
    for name, rows in (("contiguous", lambda m: list(range(m))),
                       ("gathered", lambda m: list(range(1, 2 * m, 2)))):
        first, second = [], []
        for m in range(1, a.rows + 1):
            idx = rows(m)
            first.append(timed(lambda: r.head_logits(model, hidden, idx)))
            second.append(timed(lambda: r.head_logits(model, hidden, idx)))
        out[name] = {"first_ms_sum": round(sum(first), 1), "second_ms_sum": round(sum(second), 1),
                     "first_ms_max": round(max(first), 2), "second_ms_max": round(max(second), 2)}
        print(name, json.dumps(out[name]), flush=True)
    r.shutdown()


if __name__ == "__main__":
    main()
