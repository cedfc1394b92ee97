"""Where a later turn's TTFT goes in ``bench.prefix``: the step timeline of a burst.

    python -m tools.prefix_timeline --device cuda      # the bench's cuda workload, caching on
    python -m tools.prefix_timeline --device cpu --conversations 16 --max-tokens 16

Runs ``bench.prefix``'s workload once (after the same warm-up) with every engine step recorded
on the step thread: when it started and ended, what it scheduled (requests, prompt tokens of
prefill chunks, decode rows, requests admitted), how long the host spent scheduling, launching
the forward, and waiting for the device (``runner.collect``, the read-back of a step's tokens),
and ``loop``: how long after the step's end the event loop took its result (callbacks queued
before it -- consumers woken by outputs, the clients' next requests -- run first; meanwhile
the step thread waits for the loop, unless a step burst goes on without it) and ``then``: the
loop's own time from there to the next step's start (dispatching outputs, the consumers it
lets run, the inbox).
Then prints, for each later turn, the burst's steps from its first arrival to its last first
token, the slowest TTFTs with the steps they waited through, and whether CUDA graphs were
captured inside the timed region (a capture is an eager step plus the capture itself).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import anyio

from bench import common
from bench.device_sim import MODELS, simulate
from bench.prefix import CPU_DEFAULTS, CUDA_DEFAULTS, plan


class Tape:
    def __init__(self):
        self.steps: list[dict] = []
        self.cur: dict | None = None
        self.t0 = 0.0

    def install(self, eng):
        tape = self
        core = eng.core
        sched, runner = core.scheduler, core.runner
        run, schedule, collect = eng._stepper.run, sched.schedule, runner.collect
        forward = runner.forward

        def timed_step(fn):
            cur = tape.cur = dict(start=time.perf_counter(), sched=0.0, fwd=0.0, wait=0.0,
                                  reqs=0, prefill=0, decode=0, admitted=0, waiting=0)
            try:
                return fn()
            finally:
                cur["end"] = time.perf_counter()
                cur["waiting"] = len(sched.waiting)
                tape.steps.append(cur)

        def timed_schedule():
            t = time.perf_counter()
            before = len(sched.waiting)
            out = schedule()
            cur = tape.cur
            if cur is None:
                return out
            cur["sched"] += time.perf_counter() - t
            cur["reqs"] += len(out)
            cur["admitted"] += before - len(sched.waiting)
            for req, n in out:
                if n > 1 or req.num_computed_tokens + n < req.num_known_tokens:
                    cur["prefill"] += n
                else:
                    cur["decode"] += n
            return out

        def timed_collect(launched):
            t = time.perf_counter()
            try:
                return collect(launched)
            finally:
                if tape.cur is not None:
                    tape.cur["wait"] += time.perf_counter() - t

        def timed_forward(batch, poll=None):
            t = time.perf_counter()
            try:
                return forward(batch, poll)
            finally:
                if tape.cur is not None:
                    tape.cur["fwd"] += time.perf_counter() - t

        async def timed_run(fn, **kw):
            out = await run(lambda: timed_step(fn), **kw)
            if tape.steps:  # when the loop got the step's result: its lateness after the end
                tape.steps[-1]["resumed"] = time.perf_counter()
            return out

        # every step runs through the step thread's run() (the loop bound core.step already)
        eng._stepper.run = timed_run
        sched.schedule = timed_schedule
        object.__setattr__(runner, "collect", timed_collect)  # past the runner's attribute guard
        object.__setattr__(runner, "forward", timed_forward)


async def workload(eng, system, users, params, marks):
    async def conversation(c):
        history = list(system)
        for t, user in enumerate(users[c]):
            prompt = history + user
            toks: list[int] = []
            sub = time.perf_counter()
            first = None
            async for out in eng.generate(prompt, params):
                if first is None and out.token_ids:
                    first = time.perf_counter()
                toks += out.token_ids
            if marks is not None:
                marks[(c, t)] = (sub, first)
            history = prompt + toks

    async with anyio.create_task_group() as tg:
        for c in range(len(users)):
            tg.start_soon(conversation, c)


async def run(args):
    from engine import AsyncEngine, SamplingParams

    cfg = common.engine_config(args, enable_prefix_caching=not args.no_caching,
                               max_num_seqs=256, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    async with AsyncEngine.open(cfg) as eng:
        if args.sim:  # the host's work against a modelled device (bench/device_sim.py)
            simulate(eng.runner, args.sim, args.eager_ms)
        vocab = eng.runner.model_config.vocab_size
        async for _ in eng.generate([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=8, ignore_eos=True)):
            pass
        if args.device == "cuda":
            await workload(eng, *plan(args, vocab, args.seed + 1), params, None)
        eng.core.blocks.reset_prefix_cache()
        graphs = eng.runner._owner.get("cuda_graphs")
        before = dict(graphs.capture_seconds) if graphs is not None else {}
        tape = Tape()
        tape.install(eng)
        marks: dict = {}
        system, users = plan(args, vocab, args.seed)
        common.sync(args.device)
        wall0 = time.time()
        tape.t0 = time.perf_counter()
        await workload(eng, system, users, params, marks)
        common.sync(args.device)
        after = dict(graphs.capture_seconds) if graphs is not None else {}
    new = {b: s for b, s in after.items() if b not in before}
    report(args, tape, marks, new)
    compiled_since(wall0)


def compiled_since(wall0: float) -> None:
    """Triton kernels compiled inside the timed region (files of ``$TRITON_CACHE_DIR`` or
    ``~/.triton/cache`` written after it began)."""
    import os
    from pathlib import Path
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    if not root.is_dir():
        return
    names = sorted({f"{p.name} (+{(p.stat().st_mtime - wall0) * 1e3:.0f} ms)"
                    for p in root.glob("*/*.json") if p.stat().st_mtime >= wall0
                    and not p.name.startswith("__grp__")})
    print(f"Triton kernels compiled inside the timed region: {names or 'none'}")
    for p in root.glob("*/*.json"):
        if p.stat().st_mtime >= wall0 and not p.name.startswith("__grp__"):
            try:
                import json
                meta = json.loads(p.read_text())
                print("  ", p.name, {k: meta.get(k) for k in ("constants", "signature", "attrs", "specialization") if k in meta})
            except Exception as exc:  # noqa: BLE001 - diagnostics only
                print("  ", p.name, exc)


def report(args, tape, marks, new_graphs):
    t0 = tape.t0
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    print(f"CUDA graphs captured inside the timed region: "
          f"{ {b: round(s * 1e3, 1) for b, s in sorted(new_graphs.items())} or 'none'}")
    ttft = {k: (f - s) * 1e3 for k, (s, f) in marks.items()}
    by_turn = defaultdict(list)
    for (c, t), v in ttft.items():
        by_turn[t].append(v)
    for t in sorted(by_turn):
        vs = sorted(by_turn[t])
        print(f"turn {t}: TTFT p50 {common.percentile(vs, 50):.1f} ms, p99 "
              f"{common.percentile(vs, 99):.1f}, max {vs[-1]:.1f}")
    steps = tape.steps
    hdr = (f"{'start':>8} {'dur':>6} {'sched':>6} {'fwd':>6} {'wait':>6} {'loop':>6} {'then':>6} {'reqs':>5} "
           f"{'prefill':>7} {'decode':>6} {'adm':>4} {'wait_q':>6}  arrivals/firsts before end")
    for t in sorted(by_turn):
        if t == 0 and not args.first_turn:
            continue
        subs = [marks[(c, t)][0] for c in range(args.conversations)]
        firsts = [marks[(c, t)][1] for c in range(args.conversations)]
        lo, hi = min(subs), max(firsts)
        print(f"\n-- turn {t}: arrivals {ms(lo):.1f}..{ms(max(subs)):.1f} ms, first tokens "
              f"{ms(min(firsts)):.1f}..{ms(hi):.1f} ms")
        print(hdr)
        for i, s in enumerate(steps):
            if s["end"] < lo - 0.005 or s["start"] > hi + 0.002:
                continue
            # the loop's own time between taking this step's result and starting the next
            then = ((steps[i + 1]["start"] - s["resumed"]) * 1e3
                    if i + 1 < len(steps) and "resumed" in s else float("nan"))
            arr = sum(1 for x in subs if x <= s["end"])
            fst = sum(1 for x in firsts if x <= s["end"])
            late = (s["resumed"] - s["end"]) * 1e3 if "resumed" in s else float("nan")
            print(f"{ms(s['start']):8.1f} {(s['end'] - s['start']) * 1e3:6.1f} "
                  f"{s['sched'] * 1e3:6.2f} {s['fwd'] * 1e3:6.2f} {s['wait'] * 1e3:6.2f} "
                  f"{late:6.2f} {then:6.2f} "
                  f"{s['reqs']:5d} {s['prefill']:7d} {s['decode']:6d} {s['admitted']:4d} "
                  f"{s['waiting']:6d}  {arr}/{fst}")
    worst = sorted(((v, k) for k, v in ttft.items() if k[1] > 0), reverse=True)[:args.worst]
    for v, (c, t) in worst:
        s, f = marks[(c, t)]
        inside = [x for x in steps if x["end"] >= s and x["start"] <= f]
        print(f"\nslow: conversation {c} turn {t}: TTFT {v:.1f} ms, submitted at {ms(s):.1f}, "
              f"{len(inside)} steps meanwhile, longest "
              f"{max(((x['end'] - x['start']) * 1e3 for x in inside), default=0):.1f} ms; "
              f"gaps between steps {sum(max(0.0, b['start'] - a['end']) for a, b in zip(inside, inside[1:])) * 1e3:.1f} ms")
        for x in sorted(inside, key=lambda x: x["start"] - x["end"])[:3]:
            print(f"   step at {ms(x['start']):.1f}: {(x['end'] - x['start']) * 1e3:.1f} ms, "
                  f"wait {x['wait'] * 1e3:.1f}, reqs {x['reqs']}, prefill {x['prefill']}, "
                  f"decode {x['decode']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(ap, default_cpu_model=CPU_DEFAULTS["model"],
                           default_cuda_model=CUDA_DEFAULTS["model"])
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--min-user", type=int, default=None)
    ap.add_argument("--max-user", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--no-caching", action="store_true")
    ap.add_argument("--first-turn", action="store_true", help="print the first turn's steps too")
    ap.add_argument("--worst", type=int, default=3)
    ap.add_argument("--sim", default=None, choices=sorted(MODELS),
                    help="cpu only: a null model and a simulated device (bench/device_sim.py)")
    ap.add_argument("--eager-ms", type=float, default=None,
                    help="with --sim: host time (GIL held) of a step with prompt tokens")
    args = common.finish_common_args(ap.parse_args(argv), "prefix_timeline")
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if k != "model" and getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_model_len is None:
        longest = args.system_len + args.turns * (args.max_user + args.max_tokens)
        args.max_model_len = -(-(longest + 1) // 256) * 256
    anyio.run(run, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
