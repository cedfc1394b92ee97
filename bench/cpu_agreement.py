"""Packed CPU weights against today's fp32 path on the default GGUF: greedy agreement on 32
prompts x 32 tokens and the logits' error at each prompt's last position.

    python -m bench.cpu_agreement [--cpu-weights auto|woq|fbgemm_fp16] [--prompts 32] [--tokens 32]

Agreement: the share of the 32x32 output positions where both paths produced the same token
(after a first difference the continuations differ, so this counts that too), the prompts whose
32 tokens are identical, and the mean index of the first difference. Logits: at each prompt's
last position (one prefill of the prompt alone, both paths), the largest difference of the
log-softmax over the fp32 path's 20 best tokens, and the largest logit difference over all tokens
relative to the row's largest |logit| (median and max over the prompts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SEEDS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
         "List three colours:", "1, 2, 3, 4,", "The cat sat on the", "Water boils at",
         "In 1969, the first", "import numpy as np\n", "My favourite food is", "The best way to learn",
         "Question: what is 2 + 2?\nAnswer:", "The sun rises in the", "Dear Sir or Madam,",
         "Here is a recipe for", "The quick brown fox"]


def greedy(runner, prompts, n):
    from engine import SamplingParams
    from engine.core.engine_core import EngineCore

    core = EngineCore(runner)
    for i, ids in enumerate(prompts):
        core.add_request(f"p{i}", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return [out[f"p{i}"] for i in range(len(prompts))]


def last_logits(runner, ids) -> torch.Tensor:
    """float32 logits at the last position of ``ids`` computed as one prefill chunk."""
    from engine.kv.kv_cache import blocks_needed
    from engine.forward.step_inputs import packed_forward

    model = runner.resource("weights")
    kv, state = runner.resource("kv_cache").tensor, runner.resource("model_state")
    blocks = list(range(blocks_needed(len(ids), runner.block_size)))
    with torch.inference_mode():
        hidden = packed_forward(model, kv, state, None, runner.device, runner.block_size,
                                [(ids, 0, blocks, False)])
        return model.logits(hidden[-1:])[0].float()


def logit_errors(ref, fast, prompts) -> dict:
    top_lp, rel = [], []
    for ids in prompts:
        a, b = last_logits(ref, ids), last_logits(fast, ids)
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        best = la.topk(20).indices
        top_lp.append((la[best] - lb[best]).abs().max().item())
        rel.append(((a - b).abs().max() / a.abs().max()).item())
    top_lp.sort()
    rel.sort()
    return {"top20_logprob_diff_median": top_lp[len(top_lp) // 2], "top20_logprob_diff_max": top_lp[-1],
            "logit_rel_diff_median": rel[len(rel) // 2], "logit_rel_diff_max": rel[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_agreement", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-weights", default="auto")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_agreement.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from engine import EngineConfig, ModelRunner

    cfg = dict(model="default", max_num_seqs=a.prompts, max_model_len=256, num_kv_blocks=a.prompts * 8 + 8)
    ref = ModelRunner(EngineConfig(cpu_weights="float", **cfg))
    ref.load()
    fast = ModelRunner(EngineConfig(cpu_weights=a.cpu_weights, **cfg))
    fast.load()
    try:
        tok = ref.tokenizer
        prompts = [tok.encode(SEEDS[i % len(SEEDS)] + ("" if i < len(SEEDS) else " and"))
                   for i in range(a.prompts)]
        t = time.perf_counter()
        base = greedy(ref, prompts, a.tokens)
        t_ref = time.perf_counter() - t
        t = time.perf_counter()
        got = greedy(fast, prompts, a.tokens)
        t_fast = time.perf_counter() - t
        errors = logit_errors(ref, fast, prompts)
    finally:
        fmt = fast.weight_format
        ref.shutdown()
        fast.shutdown()
    same = sum(x == y for b, g in zip(base, got) for x, y in zip(b, g))
    total = sum(len(b) for b in base)
    first = [next((i for i, (x, y) in enumerate(zip(b, g)) if x != y), len(b)) for b, g in zip(base, got)]
    identical = sum(f == len(b) for f, b in zip(first, base))
    res = {"benchmark": "cpu_agreement", "command": "python -m bench.cpu_agreement " + " ".join(argv or sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "format": fmt,
           "capability": torch.backends.cpu.get_cpu_capability(), "prompts": a.prompts, "tokens": a.tokens,
           "agreement": same / total, "identical_prompts": identical, "mean_first_difference": sum(first) / len(first),
           "seconds_float": t_ref, "seconds_packed": t_fast, **errors}
    print(f"{fmt} vs float ({res['capability']}): {same}/{total} tokens agree ({100 * same / total:.1f}%), "
          f"{identical}/{a.prompts} prompts identical, mean first difference at {res['mean_first_difference']:.1f}; "
          f"{a.prompts}x{a.tokens} took {t_ref:.1f} s float, {t_fast:.1f} s packed; last-position "
          f"log-softmax over the best 20: max diff {errors['top20_logprob_diff_max']:.2e} (median "
          f"{errors['top20_logprob_diff_median']:.2e}); logits {errors['logit_rel_diff_max']:.2e} of the "
          f"largest (median {errors['logit_rel_diff_median']:.2e})")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
