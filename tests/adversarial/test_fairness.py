"""One client's flood must not starve another: an IPC client pipelines thousands of requests into
a real engine process (the default model, on CPU) while another client asks for completions.

Without fairness the victim's request waited behind the whole flood (here: no first token within
40 s, with 2,800 flood requests still ahead of it), or was refused once the flood filled the
engine-wide waiting limit. Now waiting requests are admitted round-robin across clients and each
client holds at most its share of the limits: the victim's first token comes within a small
multiple of its TTFT on the idle engine, the flood is partly refused (beyond its share) but what
was accepted is served meanwhile, and every flood request ends exactly once (aborted at the end).

The multiple is not 1: a running request is never preempted for a waiting one, so the victim
waits for a flood request to end -- the flood's requests, admitted together, end together, one
wave every ``max_tokens`` (4) steps of a full batch -- then its own prefill step."""

from __future__ import annotations

import statistics
import time

import anyio
import pytest

from engine import AsyncEngine, BadRequestError, EngineConfig
from engine.errors import EngineOverloadedError
from engine.params import SamplingParams
from ipc.client import EngineClient

pytestmark = pytest.mark.asyncio

FLOOD = 3000
CONFIG = EngineConfig(model="default", max_model_len=256, max_num_seqs=8,
                      max_num_batched_tokens=256, max_waiting_requests=2500,
                      max_waiting_per_client=2000)
PROMPT = [1, 504, 3458, 314, 260, 2088, 1345, 30]  # 8 token ids
FLOOD_TOKENS = 4
RATIO = 15  # the victim's TTFT under the flood, at most this many times its quiet one (~6 seen)


async def ttft(client, n: int = 3) -> list[float]:
    """``n`` requests one after another: each one's time to its first token."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        stream = client.generate([7 + i, *PROMPT], SamplingParams(max_tokens=2, ignore_eos=True))
        first = await stream.__anext__()
        times.append(time.perf_counter() - t0)
        assert first.token_ids
        async for _ in stream:
            pass
    return times


@pytest.mark.alone  # asserts latency ratios
async def test_a_flood_of_one_client_does_not_starve_another(tmp_path, alone_from_here):
    address = f"unix://{tmp_path}/engine.sock"
    async with EngineClient.spawn(CONFIG, address=address) as victim, \
            EngineClient.connect(address, client_name="flood") as flood:
        await ttft(victim, 2)  # warm-up
        await anyio.to_thread.run_sync(alone_from_here)  # (the load and warm-up: beside others)
        quiet = await ttft(victim)

        outcome: dict[int, str] = {}
        served_at: list[float] = []

        async def follow(k: int, stream) -> None:
            try:
                async for out in stream:
                    last = out
                outcome[k] = last.finish_reason
                if last.finish_reason == "length":
                    served_at.append(time.perf_counter())
            except EngineOverloadedError:
                outcome[k] = "overloaded"

        params = SamplingParams(max_tokens=FLOOD_TOKENS, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            streams = [flood.generate([(k % 500) + 9, *PROMPT], params) for k in range(FLOOD)]
            for k, s in enumerate(streams):
                tg.start_soon(follow, k, s)
            with anyio.fail_after(20):  # the flood is in: thousands waiting
                while (h := await victim.health()).waiting < 1500:
                    await anyio.sleep(0.05)
            t_attack = time.perf_counter()
            attacked = await ttft(victim, 5)
            waiting_after = (await victim.health()).waiting
            served_during = len(served_at)
            for s in streams:  # the rest of the flood is aborted: each ends once
                await flood.abort(s.request_id)
            with anyio.fail_after(30):
                while len(outcome) < FLOOD:
                    await anyio.sleep(0.05)

        summary = {r: list(outcome.values()).count(r) for r in set(outcome.values())}
        print(f"quiet TTFT {[round(t * 1e3, 1) for t in quiet]} ms; under the flood "
              f"{[round(t * 1e3, 1) for t in attacked]} ms; waiting {h.waiting} -> "
              f"{waiting_after}; flood served while the victim waited: {served_during}; "
              f"outcomes {summary}; attack phase {time.perf_counter() - t_attack:.1f} s")
        assert len(outcome) == FLOOD  # every flood request ended (a stream ends once)
        assert set(summary) <= {"length", "abort", "overloaded"}
        assert summary.get("overloaded", 0) > 0  # beyond its share: refused at once
        assert summary.get("overloaded", 0) <= FLOOD - CONFIG.max_waiting_per_client
        assert summary.get("length", 0) >= 1 and served_during >= 1  # the flood is served
        assert statistics.median(attacked) <= RATIO * statistics.median(quiet)


TINY = "random:tiny-llama"
LONG = SamplingParams(max_tokens=2000, ignore_eos=True)  # running until aborted


async def _aborted(engine, streams) -> list[str]:
    """Abort ``streams``; how each ended."""
    for s in streams:
        await engine.abort(s.request_id)
    ends = []
    for s in streams:
        async for out in s:
            pass
        ends.append(out.finish_reason)
    return ends


async def _waiting(eng, n: int) -> list[str]:
    """The clients of the core's waiting requests once there are ``n`` (in admission order)."""
    with anyio.fail_after(10):
        while len(eng.core.scheduler.waiting) < n:  # the loop takes them from its inbox
            await anyio.sleep(0.01)
    return [r.client for r in eng.core.scheduler.waiting]


async def test_a_named_client_holds_only_its_share_of_the_admission_limits():
    cfg = EngineConfig(model=TINY, max_num_seqs=1, max_waiting_requests=8, max_waiting_per_client=3,
                       max_queued_tokens=1000, max_queued_tokens_per_client=40)
    async with AsyncEngine.open(cfg) as eng:
        a = [eng.generate([5, 6, 7], LONG, client="A")]
        await a[0].__anext__()  # running: A's share is of waiting requests
        a += [eng.generate([5, 6, 7], LONG, client="A") for _ in range(3)]
        with pytest.raises(EngineOverloadedError, match="max_waiting_per_client=3"):
            eng.generate([5, 6, 7], LONG, client="A")
        b = eng.generate(list(range(1, 39)), LONG, client="B")  # others are not refused
        with pytest.raises(EngineOverloadedError, match="max_queued_tokens_per_client=40"):
            eng.generate([1, 2, 3], LONG, client="B")  # 38 + 3 tokens: over B's share
        # the default client (in-process callers naming none) has no share: the engine-wide
        # limits only
        d = [eng.generate([5, 6, 7], LONG) for _ in range(4)]
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=8"):
            eng.generate([5, 6, 7], LONG)
        with pytest.raises(BadRequestError, match="client"):
            eng.generate([5], LONG, client=7)
        assert eng.admission.unfinished_of("A") == (4, 12)
        # round-robin in the order the clients came (A's first one is running): FIFO within each
        assert await _waiting(eng, 8) == ["A", "B", "", "A", "", "A", "", ""]
        assert await _aborted(eng, a + [b] + d) == ["abort"] * 9
        assert eng.admission.unfinished_of("A") == (0, 0) and not eng.admission._clients
        assert eng.admission.tokens_in_flight == 0 and not eng.core.scheduler.waiting


async def test_over_ipc_each_connection_and_each_user_it_names_is_a_client(tmp_path):
    from ipc.server import serve_ipc

    address = f"unix://{tmp_path}/e.sock"
    cfg = EngineConfig(model=TINY, max_num_seqs=1, max_waiting_per_client=2)
    async with AsyncEngine.open(cfg) as eng, anyio.create_task_group() as tg:
        await tg.start(serve_ipc, eng, address)
        async with EngineClient.connect(address) as one, EngineClient.connect(address) as two:
            s1 = [one.generate([5, 6], LONG)]
            await s1[0].__anext__()  # running
            s1 += [one.generate([5, 6], LONG) for _ in range(2)]  # waiting: the share
            await _waiting(eng, 2)
            with pytest.raises(EngineOverloadedError, match="for this client"):
                await one.generate([5, 6], LONG).__anext__()
            # the same connection's users, and another connection, are clients of their own
            s2 = [one.generate([5, 6], LONG, client="alice"), two.generate([5, 6], LONG),
                  two.generate([5, 6], LONG, client="alice")]
            assert sorted(await _waiting(eng, 5)) == ["c1", "c1", "c1/alice", "c2", "c2/alice"]
            assert await _aborted(one, s1 + s2[:1]) == ["abort"] * 4
            assert await _aborted(two, s2[1:]) == ["abort"] * 2
        tg.cancel_scope.cancel()
