"""A fast, deterministic stand-in for ``engine.AsyncEngine``: an ``engine.interface.Engine``
plus the IPC server's ``submit`` with a sink (``ipc.server.ServedEngine``).

Each step produces one token per running request and hands all of the step's outputs to their
sinks in one synchronous loop, like ``AsyncEngine._dispatch``. Token ``k`` of a request is
``k``; its text is ``"<k>"`` (or ``text_size`` bytes when set, or ``text(k)``). ``clients``:
each submitted request's client, as ``submit`` got it.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Callable, Optional

import anyio

from engine.errors import (BadRequestError, CheckpointError, EngineDeadError, EngineDrainingError,
                           EnginePausedError, EngineShutdownError, EngineSleepingError)
from engine.interface import Health, RequestStreamLike, TokenizerInfo
from engine.params import RequestOutput, SamplingParams
from states import InvalidTransitionError, Lifecycle, State


class FakeEngine:
    def __init__(self, step_interval: float = 0.002, text_size: int = 0, *, tokenizer=None,
                 max_model_len: int = 0, text: Optional[Callable[[int], str]] = None) -> None:
        self.lifecycle = Lifecycle()
        self.lifecycle.trigger("load")
        self.lifecycle.trigger("serve")
        self.config = SimpleNamespace(model="fake:counter")
        self.tokenizer = tokenizer  # an engine.loader.tokenizer.Tokenizer, or None (no template)
        self.max_model_len = max_model_len
        self.step_interval = step_interval
        self.text_size = text_size
        self.text = text
        self.clients: dict[str, str] = {}
        self.requests: dict[str, list] = {}  # rid -> [sink, params, n_out, n_prompt]
        self.aborted: list[tuple[str, str]] = []
        self.submitted: list[str] = []
        self.steps = 0
        self.step_sizes: list[int] = []
        self.paused = False
        self._listeners: list[Callable[[State, State], None]] = []
        self.lifecycle.on_change(lambda old, new: [f(old, new) for f in list(self._listeners)])
        self._stopped = anyio.Event()
        self._deadline = math.inf
        self._death: Optional[BaseException] = None
        self.calls: list[tuple] = []  # sleep-mode calls, with their arguments
        self.woken: set[str] = set()

    # -- API ----------------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.lifecycle.state

    @property
    def model(self) -> str:
        return self.config.model

    def tokenizer_info(self) -> TokenizerInfo:
        tok = self.tokenizer
        if tok is None:
            return TokenizerInfo()
        return TokenizerInfo(tok.chat_template, tok.bos_token, tok.eos_token, tok.vocab_size)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    async def detokenize(self, ids: list[int], each: bool = False,
                         tokens: bool = False) -> list[str]:
        if each or tokens:
            return [chr(t) for t in ids]
        return ["".join(chr(t) for t in ids)]

    async def token_bytes(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)]

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  **options) -> str:
        from engine.loader.tokenizer import render_chat_template

        info = self.tokenizer_info()
        return render_chat_template(info.chat_template, messages, info.bos_token, info.eos_token,
                                    add_generation_prompt, **options)

    def generate(self, prompt, params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None, *, client: str = "") -> RequestStreamLike:
        from engine.serving.request_stream import RequestStream

        rid = request_id or f"fake-{len(self.submitted)}"
        stream = RequestStream(rid, self._abort_nowait)
        self.submit(prompt, params or SamplingParams(), rid, stream.sink(), client)
        return stream

    def on_state_change(self, listener) -> None:
        self._listeners.append(listener)

    def submit(self, prompt, params: SamplingParams, request_id: str, sink, client: str = "") -> int:
        st = self.state
        if st is State.DRAINING:
            raise EngineDrainingError(retry_after=2.5)
        if st is State.SLEEPING:
            raise EngineSleepingError(retry_after=4.0)
        if st is State.PAUSED and getattr(self, "reject", False):
            raise EnginePausedError(retry_after=3.0)
        if st is State.SHUTDOWN:
            raise EngineShutdownError("engine is shut down; generate() is not possible")
        if st is State.FAILED:
            raise EngineDeadError("engine is dead")
        if request_id in self.requests:
            raise BadRequestError(f"request_id {request_id!r} is already in flight")
        params.validate()
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        if n_prompt == 0:
            raise BadRequestError("empty prompt")
        self.requests[request_id] = [sink, params, 0, n_prompt]
        self.submitted.append(request_id)
        self.clients[request_id] = client
        return n_prompt

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        self._abort_nowait(request_id, reason)

    def _abort_nowait(self, request_id: str, reason: str) -> None:  # RequestStream calls it
        self.aborted.append((request_id, reason))
        req = self.requests.pop(request_id, None)
        if req is not None:
            req[0](RequestOutput(request_id=request_id, finished=True, finish_reason="abort",
                                 reason=reason, num_prompt_tokens=req[3], num_output_tokens=req[2]))

    async def health(self) -> Health:
        st = self.state
        return Health(state=st, live=self.lifecycle.live, ready=st is State.SERVING,
                          running=len(self.requests), waiting=0, kv_usage=min(1.0, len(self.requests) / 100))

    # -- sleep mode: the lifecycle and the calls' arguments, no memory ------------------------
    async def sleep(self, level: int = 1, mode: str = "abort", timeout: Optional[float] = None,
                    tags: Optional[list[str]] = None) -> None:
        self.lifecycle.trigger("sleep")  # InvalidTransitionError unless SERVING
        self.calls.append(("sleep", level, mode, timeout) + ((tags,) if tags else ()))
        for rid in list(self.requests):
            self._abort_nowait(rid, "sleep")

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self.lifecycle.require("wake_up", State.SLEEPING)
        self.calls.append(("wake_up", tags))
        self.woken.update(tags or ("weights", "kv_cache"))
        if self.woken == {"weights", "kv_cache"}:
            self.woken = set()
            self.lifecycle.trigger("wake")

    @property
    def is_sleeping(self) -> bool:
        return self.state is State.SLEEPING

    async def update_weights(self, path: str, version: Optional[int] = None) -> None:
        self.lifecycle.require("update_weights", State.SLEEPING)
        self.calls.append(("update_weights", path) + ((version,) if version is not None else ()))
        if "bad" in path:
            raise CheckpointError(path, "intermediate_size 96 != 128")

    # -- RL-loop calls: the lifecycle and the calls' arguments --------------------------------
    async def pause(self, mode: str = "abort", timeout: Optional[float] = None) -> None:
        if self.state is not State.PAUSED:
            self.lifecycle.trigger("pause")
        self.calls.append(("pause", mode, timeout))
        if mode == "abort":
            for rid in list(self.requests):
                self._abort_nowait(rid, "pause")

    async def resume(self) -> None:
        if self.state is not State.SERVING:
            self.lifecycle.trigger("resume")
        self.calls.append(("resume",))

    def is_paused(self) -> bool:
        return self.state is State.PAUSED

    async def abort_all(self, reason: str = "abort_all") -> int:
        n = len(self.requests)
        for rid in list(self.requests):
            self._abort_nowait(rid, reason)
        self.calls.append(("abort_all", reason))
        return n

    def weight_info(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [("model.embed_tokens.weight", (256, 64), "float32"),
                ("model.norm.weight", (64,), "float32")]

    async def init_weight_transfer(self, backend, address, port, rank, world_size,
                                   timeout=300.0) -> None:
        self.calls.append(("init_weight_transfer", backend, address, port, rank, world_size))

    async def update_weights_from_distributed(self, metadata, version=None,
                                              bucket_bytes=256 * 2**20) -> None:
        self.lifecycle.require("update_weights_from_distributed", State.PAUSED, State.SLEEPING)
        self.calls.append(("update_weights_from_distributed", metadata, version))

    async def update_weights_from_ipc(self, handles, version=None) -> None:
        import torch

        from engine.weight_ipc import check_handles

        check_handles(handles, torch.device("cuda", 0))  # as an engine on cuda:0 would
        self.lifecycle.require("update_weights_from_ipc", State.PAUSED, State.SLEEPING)
        self.calls.append(("update_weights_from_ipc", [t.name for t in handles.tensors], version))

    async def close_weight_transfer(self) -> None:
        self.calls.append(("close_weight_transfer",))

    async def drain(self, timeout: Optional[float] = None, reason: str = "drain timeout") -> None:
        st = self.state
        if st is State.SLEEPING:  # nothing in flight while asleep here: released at once
            self.lifecycle.trigger("shutdown")
            self._stopped.set()
            return
        if st is State.SERVING:
            self.lifecycle.trigger("drain")
        elif st is not State.DRAINING:
            if st is State.SHUTDOWN:
                raise InvalidTransitionError(st, "drain", self.lifecycle.allowed())
            raise EngineDeadError("engine is dead")
        self._deadline = min(self._deadline, time.monotonic() + (math.inf if timeout is None else timeout))
        await self._stopped.wait()

    async def shutdown(self) -> None:
        await self.drain(0)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        while not self._stopped.is_set():
            await anyio.sleep(self.step_interval)
            if self.state is State.DRAINING:
                if time.monotonic() >= self._deadline:
                    for rid in list(self.requests):
                        await self.abort(rid, "drain timeout")
                if not self.requests:
                    self.lifecycle.trigger("shutdown")
                    self._stopped.set()
                    return
            if not self.paused:
                self.step()

    def step(self) -> None:
        outputs = []
        for rid, req in list(self.requests.items()):
            sink, params, n, n_prompt = req
            req[2] = n = n + 1
            text = (self.text(n) if self.text is not None
                    else "x" * self.text_size if self.text_size else f"<{n}>")
            out = RequestOutput(request_id=rid, token_ids=[n], text=text,
                                num_prompt_tokens=n_prompt, num_output_tokens=n)
            if n >= params.max_tokens:
                out.finished, out.finish_reason = True, "length"
                del self.requests[rid]
            outputs.append((sink, out))
        if outputs:
            self.steps += 1
            self.step_sizes.append(len(outputs))
        for sink, out in outputs:  # one synchronous dispatch per step
            sink(out)

    def die(self, exc: BaseException) -> None:
        self._death = exc
        self.lifecycle.trigger("fail")
        err = EngineDeadError("engine failed", exc)
        reqs, self.requests = self.requests, {}
        for req in reqs.values():
            req[0](err)
        self.lifecycle.trigger("shutdown")
        self._stopped.set()
