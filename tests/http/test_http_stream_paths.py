"""What a frontend does per streamed request and per token, kept cheap (bench.serve measures
it) and still right: a streamed request submits its choices inside its response (a refusal at
submission is still a JSON error, a client gone before its first token still aborts it), the
per-token metrics are written in batches that add up to the same figures, the logprobs of
``logprobs: 0`` are unpacked by ``struct`` to what ``Logprobs.entries`` gives, and the default
count of API server processes."""

from __future__ import annotations

import math
import random
import struct
import sys
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engine.params import Logprobs
from entrypoints.http.choices import unpack_logprobs
from entrypoints.http.metrics import ITL_BUCKETS, observe_many
from entrypoints.http.supervisor import default_api_servers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ipc"))
from fake_engine import FakeEngine  # noqa: E402
from http_helpers import TINY, served  # noqa: E402


def test_observe_many_is_observe_one_at_a_time():
    rng = random.Random(3)
    values = [rng.choice(ITL_BUCKETS) if rng.random() < 0.3 else rng.expovariate(20)
              for _ in range(2000)] + [1e9, 0.0]
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("x", "x", buckets=ITL_BUCKETS, registry=one)
    h2 = Histogram("x", "x", buckets=ITL_BUCKETS, registry=many)
    for v in values:
        h1.observe(v)
    observe_many(h2, values[:700])
    observe_many(h2, values[700:])
    observe_many(h2, [])
    a = [ln for ln in generate_latest(one).decode().splitlines() if "_created" not in ln]
    b = [ln for ln in generate_latest(many).decode().splitlines() if "_created" not in ln]
    assert [ln for ln in a if "_sum" not in ln] == [ln for ln in b if "_sum" not in ln]
    s1, s2 = (float(next(ln for ln in x if "_sum" in ln).split()[-1]) for x in (a, b))
    assert math.isclose(s1, s2, rel_tol=1e-12)


def test_unpack_logprobs_without_alternatives_is_entries():
    rows = b"".join(struct.pack("<ifi", t, lp, r) for t, lp, r in (
        (5, -0.25, 0), (7, float("nan"), 3), (9, -1e-8, 2), (2**31 - 1, -80.5, 1)))
    lp = Logprobs(0, rows)
    assert unpack_logprobs(lp) == lp.entries() and len(unpack_logprobs(lp)) == 4
    assert unpack_logprobs(Logprobs(0, b"")) == []
    k2 = Logprobs.first_prompt_token(11, 2)  # with alternatives: entries() itself
    assert unpack_logprobs(k2) == k2.entries()


def test_default_api_servers_follow_the_cpus_on_an_accelerator():
    assert [default_api_servers("cuda", n) for n in (1, 2, 4, 7, 8, 15, 16, 64)] == \
        [1, 1, 1, 1, 2, 3, 4, 4]
    assert all(default_api_servers("cpu", n) == 1 for n in (1, 2, 16, 128))


@pytest.mark.asyncio
async def test_streamed_request_refused_at_submission_is_a_json_error():
    """The engine refuses a text prompt whose tokens with max_tokens pass the context: the
    stream answers a JSON 400 naming max_tokens, before any event."""
    async with served(TINY) as s, s.http() as c:
        limit = s.frontend.max_model_len
        r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": limit,
                                                  "stream": True})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["param"] == "max_tokens", r.text
        m = s.frontend.metrics
        assert m.in_flight._value.get() == 0
        assert m.rejected.labels("bad_request")._value.get() == 1
        ok = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                                   "stream": True})
        assert ok.status_code == 200 and ok.text.endswith("data: [DONE]\n\n")


@pytest.mark.asyncio
async def test_streamed_client_gone_before_its_first_token_aborts_it():
    fake = FakeEngine()
    fake.paused = True  # accepted, never stepped: no first token comes
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.run)
        # (through the IPC client, as a frontend process serves: its abort reaches fake.abort)
        async with served(engine=fake, via="client") as s, s.http() as c:
            with anyio.move_on_after(0.5):
                await c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 5,
                                                      "stream": True})
            with anyio.fail_after(10):
                while not fake.aborted:
                    await anyio.sleep(0.02)
            assert [rid for rid, _ in fake.aborted] == fake.submitted and fake.requests == {}
            m = s.frontend.metrics
            assert m.requests.labels("abort")._value.get() == 1 and m.in_flight._value.get() == 0
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_batched_token_metrics_add_up():
    """Generated tokens and inter-token gaps reach the metrics in batches (every 32 tokens, a
    second, and the request's end): after the requests, the same totals as one per token."""
    fake = FakeEngine(step_interval=0.001)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.run)
        async with served(engine=fake) as s, s.http() as c:
            lengths = [1, 2, 31, 32, 33, 100]
            for n, stream in ((n, st) for n in lengths for st in (True, False)):
                r = await c.post("/v1/completions", json={"prompt": "a b", "max_tokens": n,
                                                          "stream": stream})
                assert r.status_code == 200, r.text
            m = s.frontend.metrics
            assert m.generation_tokens._value.get() == 2 * sum(lengths)
            count = next(smp.value for smp in m.itl.collect()[0].samples
                         if smp.name.endswith("_count"))
            assert count == 2 * sum(n - 1 for n in lengths)
            assert m.in_flight._value.get() == 0
        tg.cancel_scope.cancel()
