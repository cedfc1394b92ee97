"""Hostile input against the engine itself (findings 1, 3, 5, 6): in process and over
IPC, one request's bad input ends that request -- never the engine."""

from __future__ import annotations

from contextlib import asynccontextmanager
import time

import anyio
import pytest

from engine import AsyncEngine, BadRequestError, EngineConfig, SamplingParams
from engine.errors import EngineOverloadedError
from ipc.client import EngineClient
from ipc.server import serve_ipc
from states import State

TINY = "random:tiny-llama"
pytestmark = pytest.mark.asyncio

HUGE = [2**63, 2**64 - 1, 2**31, -1, -(2**63)]


async def served(eng: AsyncEngine, prompt, params: SamplingParams):
    last = None
    async for out in eng.generate(prompt, params):
        last = out
    return last


async def test_finding1_huge_top_k_is_refused_and_the_engine_serves_on() -> None:
    """2**63 as top_k used to overflow a torch.long in the step and kill the engine."""
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        for v in HUGE:
            for field in ("top_k", "seed", "max_tokens", "min_tokens"):
                if field == "seed" and v == 2**31:
                    continue  # a valid seed
                with pytest.raises(BadRequestError, match=field):
                    eng.generate([5, 6, 7], SamplingParams(**{field: v}))
        # the largest accepted top_k is clamped to the vocabulary in the step: served
        out = await served(eng, [5, 6, 7], SamplingParams(max_tokens=4, temperature=1.0,
                                                          top_k=2**31 - 1, seed=2**63 - 1))
        assert out.finished and out.finish_reason == "length"
        assert eng.state is State.SERVING


async def test_bools_are_not_numbers_and_strings_are_not_bools() -> None:
    for bad in (dict(max_tokens=True), dict(top_k=False), dict(seed=True), dict(min_tokens=True),
                dict(temperature=True), dict(ignore_eos="yes"), dict(logprobs=1),
                dict(stop=["x", 3]), dict(stop_token_ids=[True]), dict(top_p=float("nan")),
                dict(temperature=float("inf"))):
        with pytest.raises(BadRequestError):
            SamplingParams(**bad).validate()


async def test_finding5_stop_lists_are_bounded() -> None:
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        vocab = eng.runner.model_config.vocab_size
        with pytest.raises(BadRequestError, match="stop_token_ids"):
            eng.generate([5], SamplingParams(stop_token_ids=list(range(1_000_000))))
        with pytest.raises(BadRequestError, match="not a token id"):
            eng.generate([5], SamplingParams(stop_token_ids=[vocab]))
        with pytest.raises(BadRequestError, match="stop"):
            eng.generate([5], SamplingParams(stop=["x" * 10_000]))
        with pytest.raises(BadRequestError, match="stop"):
            eng.generate([5], SamplingParams(stop=["a"] * 17))
        out = await served(eng, [5, 6], SamplingParams(max_tokens=3, ignore_eos=True,
                                                       stop_token_ids=[i % vocab for i in range(1024)]))
        assert out.finished


async def test_a_request_that_fails_its_preparation_ends_alone(monkeypatch) -> None:
    """The step cannot be killed by one request: what fails in ModelRunner.admit ends that
    request with finish_reason="error"; the others are served."""
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        from engine.runner.model_runner import ModelRunner

        real = ModelRunner.admit

        def admit(self, req):
            if req.params.max_tokens == 7:
                raise OverflowError("Overflow when unpacking long long")
            real(self, req)

        monkeypatch.setattr(ModelRunner, "admit", admit)
        results = {}

        async def one(i: int) -> None:
            results[i] = await served(eng, [3 + i, 4], SamplingParams(max_tokens=7 if i == 3 else 5,
                                                                      ignore_eos=True))

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        assert results[3].finish_reason == "error" and "Overflow" in results[3].reason
        assert all(results[i].finish_reason == "length" for i in range(8) if i != 3)
        assert eng.state is State.SERVING
        assert not eng.core.requests and eng.admission.tokens_in_flight == 0


async def test_finding3_engine_wide_admission_limit() -> None:
    cfg = EngineConfig(model=TINY, max_num_seqs=2, max_waiting_requests=4, max_queued_tokens=10_000)
    async with AsyncEngine.open(cfg) as eng:
        streams = [eng.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
                   for _ in range(4)]
        with pytest.raises(EngineOverloadedError) as info:
            eng.generate([5, 6, 7], SamplingParams(max_tokens=4))
        assert info.value.retryable and info.value.retry_after > 0
        for s in streams:
            async for out in s:
                pass
            assert out.finish_reason == "length"
        # capacity is back once they finished
        assert (await served(eng, [5], SamplingParams(max_tokens=2))).finished
    cfg = EngineConfig(model=TINY, max_queued_tokens=100)
    async with AsyncEngine.open(cfg) as eng:
        s = eng.generate(list(range(1, 90)), SamplingParams(max_tokens=30, ignore_eos=True))
        with pytest.raises(EngineOverloadedError, match="prompt tokens"):
            eng.generate(list(range(1, 20)), SamplingParams(max_tokens=2))
        async for _ in s:
            pass
        assert eng.admission.tokens_in_flight == 0


async def test_finding6_giant_prompts_are_never_tokenized_on_the_event_loop(monkeypatch) -> None:
    import threading

    from engine.loader.tokenizer import Tokenizer

    loop_thread = threading.get_ident()
    calls: list[tuple[int, int]] = []
    real = Tokenizer.encode

    def encode(self, text, add_special_tokens=True):
        calls.append((len(text), threading.get_ident()))
        return real(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", encode)
    async with AsyncEngine.open(EngineConfig(model="default", max_model_len=2048)) as eng:
        with pytest.raises(BadRequestError, match="characters"):
            eng.generate("x" * 4_000_000, SamplingParams(max_tokens=2))
        assert not calls  # refused by its length alone
        # a long prompt under the character bound is tokenized on a worker thread
        text = "hello world, some prose " * 4000  # ~96k chars, ~20k tokens: too long
        streams = [eng.generate(text, SamplingParams(max_tokens=2)) for _ in range(4)]
        assert eng.health_nowait().waiting == 4  # accepted, being tokenized
        for s in streams:
            with pytest.raises(BadRequestError, match="context limit"):
                async for _ in s:
                    pass
        assert [n for n, _ in calls] == [len(text)] * 4
        assert all(tid != loop_thread for _, tid in calls)
        # short prompts stay inline (cheap) and are served
        assert (await served(eng, "The capital of France is", SamplingParams(max_tokens=2))).finished
        # aborted while still being tokenized: it ends "abort", never reaching the core
        s = eng.generate("word " * 1000, SamplingParams(max_tokens=50, ignore_eos=True))
        await eng.abort(s.request_id)
        async for out in s:
            pass
        assert out.finish_reason == "abort"
        assert eng.state is State.SERVING
        assert not eng._sinks and eng.admission.tokens_in_flight == 0


@asynccontextmanager
async def ipc_engine(tmp_path):
    address = f"unix://{tmp_path}/e.sock"
    cfg = EngineConfig(model=TINY, max_num_seqs=2, max_waiting_requests=3)
    async with AsyncEngine.open(cfg) as eng:
        async with anyio.create_task_group() as tg:
            await tg.start(serve_ipc, eng, address)
            async with EngineClient.connect(address) as client:
                yield eng, client
            tg.cancel_scope.cancel()


async def test_over_ipc_hostile_params_are_typed_refusals(tmp_path) -> None:
    async with ipc_engine(tmp_path) as (eng, client):
        await _hostile_over_ipc(eng, client)


async def _hostile_over_ipc(eng, client) -> None:
    for v in HUGE:
        with pytest.raises(BadRequestError):
            client.generate([5, 6], SamplingParams(top_k=v))
    streams = [client.generate([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
               for _ in range(6)]
    outcomes = []
    for s in streams:
        try:
            async for out in s:
                pass
            outcomes.append(out.finish_reason)
        except EngineOverloadedError as exc:
            assert exc.retry_after > 0
            outcomes.append("overloaded")
    assert outcomes.count("overloaded") >= 1 and outcomes.count("length") >= 3
    assert eng.state is State.SERVING and (await client.health()).live


async def test_prompt_ids_that_are_not_token_ids_are_refused_at_once() -> None:
    """The prompt's ids are checked where they enter (one msgspec pass): any
    that is not an int (a bool, a float, a string, None), below 0 or not below the
    vocabulary ends that request with BadRequestError; the engine serves on. An int subclass
    is taken as the plain int of its value, and the caller's list is not the engine's."""
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        vocab = eng.runner.model_config.vocab_size
        class Int(int):
            pass

        for bad in ([5, True], [False], [5, 1.0], [5, "6"], [None], [-1, 5], [5, vocab],
                    [vocab + 10**30], [-(2**63)], [5] * 200 + [vocab]):
            with pytest.raises(BadRequestError, match="prompt token ids"):
                eng.generate(bad, SamplingParams(max_tokens=2))
        out = await served(eng, [0, vocab - 1, 5], SamplingParams(max_tokens=2, ignore_eos=True))
        assert out.finished and out.finish_reason == "length"
        mine = [Int(5), 6, 7]
        stream = eng.generate(mine, SamplingParams(max_tokens=2, ignore_eos=True))
        mine[1:] = [True, -1]  # the caller's list changes after submit: the engine's does not
        added = eng._inbox[-1]  # what the engine loop will add to the core
        assert added.request_id == stream.request_id
        assert added.ids == [5, 6, 7] and all(type(t) is int for t in added.ids)
        async for out in stream:
            pass
        assert out.finished and out.finish_reason == "length" and out.num_prompt_tokens == 3
        assert eng.state is State.SERVING
