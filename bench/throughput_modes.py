"""The engine modes of ``bench.throughput`` (bare step loop, in-process, IPC), each timing its runs."""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from typing import Any, Callable, Optional

from . import common
from .common import now
from .recorder import Recorder, warm_work
from .serve_hops import inproc_hops

#: ``--logprobs K``: every request asks for its tokens' logprobs and the top K (set by ``bench.throughput``)
LOGPROBS: Optional[int] = None


def _params(max_tokens: int, temperature: float):
    from engine import SamplingParams

    lp = dict(logprobs=True, top_logprobs=LOGPROBS) if LOGPROBS is not None else {}
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, **lp)


def engine_cfg(args):
    return common.engine_config(
        args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_bytes=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None)


def _desc(mode: str, r: int, args) -> str:
    return mode if args.repeat == 1 else f"{mode} {r + 1}/{args.repeat}"


def _best(runs: list[dict], **extra) -> dict[str, Any]:
    """The run with the highest output tok/s, with every run's figure kept."""
    best = dict(max(runs, key=lambda r: r["output_tok_s"] or 0))
    best["runs_output_tok_s"] = [r["output_tok_s"] for r in runs]
    best["repeat"] = len(runs)
    best["median_output_tok_s"] = statistics.median(best["runs_output_tok_s"])
    best.update(extra)
    return best


# -- mode: bare EngineCore.step() loop --------------------------------------------------------------
def run_bare(args, work) -> dict[str, Any]:
    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner

    cfg = engine_cfg(args)
    t_load = now()
    runner = ModelRunner(cfg)
    try:
        runner.load()
        load_s = now() - t_load
        if args.warmup:
            core = EngineCore(runner)
            for i, (p, o) in enumerate(warm_work(work, args.warmup)):
                core.add_request(f"w{i}", p, _params(o, args.temperature))
            while core.has_work():
                core.step()
        runs = []
        for r in range(args.repeat):
            core = EngineCore(runner)  # fresh scheduler and statistics for each timed run
            common.sync(args.device)
            with common.progress(sum(o for _, o in work), _desc("bare", r, args), "tok", args.no_progress) as bar:
                rec = Recorder(work, bar)
                index = {}
                cpu0 = time.process_time()
                rec.t0 = now()
                for i, (p, o) in enumerate(work):
                    rid = f"r{i}"
                    index[rid] = i
                    rec.submitted(i, now())
                    core.add_request(rid, p, _params(o, args.temperature))
                last_bar = 0.0
                with _timeline(args) as tl:
                    while core.has_work():
                        outs = core.step()
                        t = now()
                        for out in outs:
                            rec.piece(index[out.request_id], t, len(out.token_ids),
                                      out.finish_reason if out.finished else None)
                        if t - last_bar > 0.2:
                            rec.flush_bar()
                            last_bar = t
                    common.sync(args.device)
                    rec.t1 = now()
                cpu_s = time.process_time() - cpu0
                rec.flush_bar()
            st = core.statistics()
            runs.append(rec.summary("bare", steps=st.steps, preemptions=st.preemptions,
                                    cpu_s=cpu_s, **_timeline_of("bare", tl, rec)))
        return _best(runs, load_s=load_s, kv_blocks=runner.num_blocks)
    finally:
        runner.shutdown()


def _timeline(args):
    """``--timeline``: every step of the timed run timed (bench/step_timeline.py)."""
    if not args.timeline:
        return contextlib.nullcontext()
    from .step_timeline import recording

    return recording()


def _timeline_of(mode: str, tl, rec: Recorder) -> dict[str, Any]:
    if tl is None:
        return {}
    from .step_timeline import print_summary

    s = tl.summary(rec.t0, rec.t1)
    print_summary(mode, s)
    return {"timeline": s}


# -- modes: streaming (in-process AsyncEngine, IPC client) -------------------------------------------
async def _stream_all(generate: Callable, work, temperature: float, rec: Recorder) -> None:
    import anyio

    async def one(i: int, prompt: list[int], max_tokens: int) -> None:
        rec.submitted(i, now())
        stream = generate(prompt, _params(max_tokens, temperature))
        if inspect.isawaitable(stream):
            stream = await stream
        async for out in stream:
            rec.piece(i, now(), len(out.token_ids), out.finish_reason if out.finished else None)

    async def ticker(done: anyio.Event) -> None:
        while not done.is_set():
            rec.flush_bar()
            with anyio.move_on_after(0.2):
                await done.wait()

    done = anyio.Event()
    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker, done)
        rec.t0 = now()
        async with anyio.create_task_group() as tg:
            for i, (p, o) in enumerate(work):
                tg.start_soon(one, i, p, o)
        rec.t1 = now()
        done.set()
    rec.flush_bar()


async def _warm(generate: Callable, work, temperature: float) -> None:
    rec = Recorder(work)
    await _stream_all(generate, work, temperature, rec)


def run_inproc(args, work) -> dict[str, Any]:
    import anyio

    from engine import AsyncEngine

    result: dict[str, Any] = {}

    async def main() -> None:
        t_load = now()
        # (the timeline is on from the start: the engine loop binds its step method once)
        with _timeline(args) as tl:
            async with AsyncEngine.open(engine_cfg(args)) as eng:
                load_s = now() - t_load
                if args.warmup:
                    await _warm(eng.generate, warm_work(work, args.warmup), args.temperature)
                runs = []
                for r in range(args.repeat):
                    s0, h0 = eng.statistics(), eng.health_nowait()
                    with common.progress(sum(o for _, o in work), _desc("inproc", r, args), "tok",
                                         args.no_progress) as bar:
                        rec = Recorder(work, bar)
                        cpu0 = time.process_time()
                        await _stream_all(eng.generate, work, args.temperature, rec)
                        cpu_s = time.process_time() - cpu0
                    s1 = eng.statistics()
                    # TTFT by hop (bench/serve_hops.py): the engine's histograms over the run
                    hops = inproc_hops(rec.submit, rec.first, h0, eng.health_nowait())
                    runs.append(rec.summary("inproc", steps=s1.steps - s0.steps,
                                            preemptions=s1.preemptions - s0.preemptions, cpu_s=cpu_s,
                                            hops=hops, **_timeline_of("inproc", tl, rec)))
                result.update(_best(runs, load_s=load_s))

    anyio.run(main, backend="asyncio", backend_options=_backend_options(args))
    return result


def run_ipc(args, work) -> dict[str, Any]:
    import anyio

    from ipc.client import EngineClient

    result: dict[str, Any] = {}

    async def main() -> None:
        t_load = now()
        async with EngineClient.spawn(engine_cfg(args)) as client:
            load_s = now() - t_load
            if args.warmup:
                await _warm(client.generate, warm_work(work, args.warmup), args.temperature)
            runs = []
            for r in range(args.repeat):
                h0 = await client.health()
                with common.progress(sum(o for _, o in work), _desc("ipc", r, args), "tok",
                                     args.no_progress) as bar:
                    rec = Recorder(work, bar)
                    await _stream_all(client.generate, work, args.temperature, rec)
                h1 = await client.health()
                # (Health's counters are 0 when the engine does not report them: unknown)
                runs.append(rec.summary("ipc", steps=(h1.steps - h0.steps) or None,
                                        preemptions=h1.preemptions - h0.preemptions))
            result.update(_best(runs, load_s=load_s))

    try:
        anyio.run(main, backend="asyncio", backend_options=_backend_options(args))
    except ImportError as exc:  # the IPC layer is still being written
        return {"mode": "ipc", "skipped": f"IPC layer incomplete: {exc!r}"}
    return result


def _backend_options(args) -> dict:
    if args.uvloop:
        try:
            import uvloop  # noqa: F401

            return {"use_uvloop": True}
        except ImportError:
            pass
    return {}


#: the engine modes by name: ``(args, work) -> result row``
RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {"bare": run_bare, "inproc": run_inproc, "ipc": run_ipc}
