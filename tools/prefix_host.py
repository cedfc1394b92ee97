"""Host cost of a cached burst: what a later turn of ``bench.prefix`` costs the host.

    python -m tools.prefix_host                 # random:tiny-llama fp32 on cpu, overlapped
    python -m tools.prefix_host --profile 25    # plus cProfile's 25 most expensive functions

The setup ``bench.prefix`` has on its later turns: a warmed cache holding a ``--system-len``
system prompt and every conversation's first turn (prompt and answer), then a burst of
``--conversations`` arrivals at once, each the whole conversation so far plus a new user message
of ``--min-user``..``--max-user`` tokens: all but the last partial block and the user message is
cached. Measured per arrival (µs of host time), by phase:

* ``submit``: the event loop's ``AsyncEngine.submit`` (admission checks, the ids, the inbox);
* ``add``: ``EngineCore.add_request`` (the Request, its detokenizer, the runner's admit);
* ``lookup``, ``admit``: the scheduler's prefix-cache lookup (block hashes included) and the
  block manager's admission; ``schedule``: all of ``Scheduler.schedule`` (both included);
* ``forward``: the runner's forward up to the model (input building), ``model``: the model.

and the time from the burst to the last first token, through ``EngineCore`` alone (``core``,
steps on this thread) and through ``AsyncEngine`` (``async``: ``generate`` calls, event loop and
step thread as served). ``--rounds`` rounds, each on a fresh cache; figures are medians.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import anyio

PHASES = ("submit", "add", "lookup", "admit", "schedule", "forward", "model")


def plan(args, vocab: int, seed: int):
    rng = random.Random(seed)
    hi = min(vocab - 1, 10000)
    system = [rng.randint(0, hi) for _ in range(args.system_len)]
    users = [[[rng.randint(0, hi) for _ in range(rng.randint(args.min_user, args.max_user))]
              for _ in range(2)] for _ in range(args.conversations)]
    return system, users


class Timers:
    """Monkeypatched wrappers that add each call's perf_counter time to a phase."""

    def __init__(self):
        self.t = defaultdict(float)
        self._undo = []
        self.on = False
        self.last = (0, 0)  # the last schedule's (requests, tokens)

    def wrap(self, obj, name, phase):
        fn = getattr(obj, name)
        t = self.t

        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t[phase] += time.perf_counter() - t0
        object.__setattr__(obj, name, timed)  # past the runner's attribute guard
        self._undo.append((obj, name))

    def install(self, core, eng=None):
        runner = core.runner
        schedule = core.scheduler.schedule

        def scheduled():
            out = schedule()
            self.last = (len(out), sum(n for _, n in out))
            return out
        core.scheduler.schedule = scheduled
        model = runner._owner["weights"]
        self.wrap(core, "add_request", "add")
        self.wrap(core.blocks, "lookup", "lookup")
        self.wrap(core.blocks, "admit", "admit")
        self.wrap(core.scheduler, "schedule", "schedule")
        self.wrap(runner, "forward", "forward")
        self.wrap(model, "forward", "model")
        if eng is not None:
            self.wrap(eng, "submit", "submit")

    def reset(self):
        self.t.clear()


def _params(args):
    from engine import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)


def _config(args):
    from engine import EngineConfig
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, seed=0,
                        overlap_scheduling=args.overlap, max_model_len=args.max_model_len,
                        max_num_seqs=256, enable_prefix_caching=not args.no_caching,
                        max_num_batched_tokens=args.budget)


def _run_core(core, prompts, params, timers, first_of, steps=None):
    """Add ``prompts`` and step until each has its first token; returns the seconds it took.
    ``steps``: a list that gets each step's (seconds, scheduled tokens, requests) on cuda
    (synchronized after each step)."""
    import torch
    cuda = core.runner.device.type == "cuda"
    t0 = time.perf_counter()
    ids = []
    for i, p in enumerate(prompts):
        rid = f"r{len(core.requests)}-{time.perf_counter_ns()}-{i}"
        core.add_request(rid, p, params)
        ids.append(rid)
    left = set(ids)
    while left and core.has_work():
        ts = time.perf_counter()
        outs = core.step()
        if cuda and steps is not None:
            torch.cuda.synchronize()
            steps.append((time.perf_counter() - ts, timers.last))
        for out in outs:
            if out.request_id in left and out.token_ids:
                left.discard(out.request_id)
                first_of[out.request_id] = time.perf_counter() - t0
    return time.perf_counter() - t0, ids


def _finish(core):
    while core.has_work():
        core.step()


def core_round(args, seed, prof=None):
    from engine import ModelRunner
    from engine.core.engine_core import EngineCore

    runner = ModelRunner(_config(args))
    runner.load()
    core = EngineCore(runner)
    timers = Timers()
    timers.install(core)
    try:
        params = _params(args)
        system, users = plan(args, runner.model_config.vocab_size, seed)
        firsts = [system + u[0] for u in users]
        _, ids = _run_core(core, firsts, params, timers, {})
        answers = {rid: None for rid in ids}
        reqs = {rid: core.requests[rid] for rid in ids}
        _finish(core)
        burst = [reqs[rid].token_ids + u[1] for rid, u in zip(answers, users)]
        if args.device == "cuda":  # an untimed burst first: kernels compiled, graphs captured
            warm = [reqs[rid].token_ids + [(t + 1) % 9000 for t in u[1]]
                    for rid, u in zip(answers, users)]  # other user messages: not cached
            _run_core(core, warm, params, timers, {})
            _finish(core)
        timers.on = True
        if prof is not None:
            prof.enable()
        firsts_at: dict = {}
        steps: list = []
        tprof = None
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile
            tprof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            tprof.__enter__()
        wall, _ = _run_core(core, burst, params, timers, firsts_at, steps)
        if tprof is not None:
            tprof.__exit__(None, None, None)
            print(tprof.key_averages().table(sort_by="cuda_time_total", row_limit=args.torch_profile))
        if steps:
            print("steps (ms synchronized, requests, tokens):",
                  [(round(s * 1e3, 2), *b) for s, b in steps])
        if prof is not None:
            prof.disable()
        timers.on = False
        stats = core.blocks.statistics()
        _finish(core)
        return wall, dict(timers.t), stats
    finally:
        runner.shutdown()


async def _async_round(args, seed, prof=None):
    from engine import AsyncEngine

    params = _params(args)
    async with AsyncEngine.open(_config(args)) as eng:
        timers = Timers()
        timers.install(eng.core, eng)
        system, users = plan(args, eng.runner.model_config.vocab_size, seed)
        history = {}

        async def turn(c, prompt, first):
            toks = []
            t_first = None
            async for out in eng.generate(prompt, params):
                if t_first is None and out.token_ids:
                    t_first = time.perf_counter()
                toks += out.token_ids
            history[c] = prompt + toks
            first[c] = t_first

        first: dict = {}
        async with anyio.create_task_group() as tg:
            for c, u in enumerate(users):
                tg.start_soon(turn, c, system + u[0], first)
        first = {}
        timers.on = True
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for c, u in enumerate(users):
                tg.start_soon(turn, c, history[c] + u[1], first)
        if prof is not None:
            prof.disable()
        timers.on = False
        ttft = sorted(t - t0 for t in first.values())
        return ttft, dict(timers.t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:tiny-llama")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--min-user", type=int, default=32)
    ap.add_argument("--max-user", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", choices=["core", "async", "both"], default="both")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false")
    ap.add_argument("--no-caching", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's N top functions")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--dtype", default=None, help="default float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--torch-profile", type=int, default=0,
                    help="cuda: torch.profiler's N top ops of the burst by device time")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    import torch
    torch.set_num_threads(args.threads)

    n = args.conversations
    prof = cProfile.Profile() if args.profile else None
    rows = defaultdict(list)
    for r in range(args.rounds):
        if args.mode in ("core", "both"):
            wall, t, stats = core_round(args, r, prof)
            rows["core_burst_ms"].append(wall * 1e3)
            for k, v in t.items():
                rows[f"core_{k}_us"].append(v / n * 1e6)
        if args.mode in ("async", "both"):
            ttft, t = anyio.run(_async_round, args, r, prof)
            rows["async_last_first_ms"].append(ttft[-1] * 1e3)
            rows["async_p50_first_ms"].append(ttft[len(ttft) // 2] * 1e3)
            for k, v in t.items():
                rows[f"async_{k}_us"].append(v / n * 1e6)
    print(f"{args.model} {args.device} {args.dtype}, {n} arrivals, overlap={args.overlap}, "
          f"caching={not args.no_caching}, {args.rounds} rounds (median [min..max])")
    for k, vs in rows.items():
        print(f"  {k:28s} {statistics.median(vs):10.1f}  [{min(vs):.1f}..{max(vs):.1f}]")
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
