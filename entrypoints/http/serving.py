"""One generation request over HTTP: its choices (one per prompt and ``n``) submitted to the
engine, their outputs sent back as one JSON response or as server-sent events (OpenAI's chunks,
each naming its choice's ``index``, ending with ``data: [DONE]``).

With ``n > 1`` the first choice of each prompt is submitted first and the others once it has
produced its first token: its prompt's full KV blocks are then in the prefix cache, so the other
choices' prefills reuse them instead of computing the prompt again.

A request whose client goes away (mid-stream, or while a non-streaming request is generating)
is aborted in the engine: leaving a request stream early (``aclose``) aborts it, whatever the
engine behind it.
"""

from __future__ import annotations

import logging
import math
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.errors import BadRequestError, EngineError, EngineShutdownError
from engine.interface import RequestStreamLike
from . import protocol as P
from .choices import ChoiceState, Job, Kind, total_usage, usage
from .context import Frontend, client_of
from .errors import JSONBody, error_response, json_bytes, stream_error
from .metrics import Metrics, RequestTracker

log = logging.getLogger("enginecore.http")

_DONE = b"data: [DONE]\n\n"
#: how the engine's refusal of a max_tokens past the context begins (engine/serving/admission.py)
MAX_TOKENS_REFUSAL = "max_tokens is too large"


def _sse(obj: dict) -> bytes:
    """One event: its JSON on one line, whatever line ends a reader knows (errors.json_bytes)."""
    return b"data: " + json_bytes(obj) + b"\n\n"


async def _unless_disconnected(request: Request, fn: Callable[[], Awaitable[Any]],
                               metrics: Optional[Metrics]) -> tuple[str, Any]:
    """Run ``fn`` unless the HTTP client disconnects first (then ``fn`` is cancelled).

    Returns ``("ok", result)``, ``("error", response)`` for an exception of ``fn`` (turned into
    its response right here: keeping the exception would keep its frames -- and the engine's
    request stream in them -- alive in a reference cycle) or ``("gone", None)``."""
    result: list = []
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            result.append(("ok", await fn()))
        except Exception as exc:
            result.append(("error", error_response(exc, metrics)))
        tg.cancel_scope.cancel()
    return result[0] if result else ("gone", None)


class _Run:
    """One engine request: its outputs (starting with the first), metrics, and the abort if it
    is left before its terminal output."""

    def __init__(self, fe: Frontend, tracker: RequestTracker, request_id: str,
                 client: str) -> None:
        self.fe = fe
        self.tracker = tracker
        self.request_id = request_id
        self.client = client
        self.it: Optional[RequestStreamLike] = None
        self.first = None
        self.finished = False
        self.closed = False

    async def start(self, prompt, params, max_tokens_param: str = "max_tokens") -> "_Run":
        try:
            self.it = self.fe.generate(prompt, params, self.request_id, self.client)
            self.first = await self.it.__anext__()
        except StopAsyncIteration:  # pragma: no cover - engines always send a terminal output
            raise EngineShutdownError("the engine ended the request without output") from None
        except BadRequestError as exc:
            # the engine's refusal of a max_tokens past the context (engine/serving/admission.py):
            # a 400 naming the field it came in
            if str(exc).startswith(MAX_TOKENS_REFUSAL):
                raise P.RequestError(str(exc), param=max_tokens_param) from None
            raise
        self._seen(self.first)
        return self

    def _seen(self, out) -> None:
        self.tracker.output(out)
        if out.finished:
            self.finished = True

    async def outputs(self) -> AsyncIterator:
        """The outputs; an engine error mid-request is raised (the request is over)."""
        yield self.first
        if self.finished:
            return
        it = self.it
        while True:
            try:
                out = await it.__anext__()
            except StopAsyncIteration:  # pragma: no cover
                raise EngineShutdownError("the engine ended the request early") from None
            except Exception:
                self.finished = True  # the engine (or the connection to it) ended the request
                self.tracker.finish("error")
                raise
            self._seen(out)
            yield out
            if out.finished:
                return

    async def close(self) -> None:
        """Idempotent; shielded: runs also when the client went away (cancellation)."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.tracker.finish("abort")
        if self.it is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                await self.it.aclose()  # an unfinished request is aborted
            except Exception as exc:  # the engine is gone: nothing left to abort
                log.debug("abort of %s failed: %r", self.request_id, exc)


async def _gather(fns) -> list:
    """Run ``fns`` concurrently; their results in order. The first error is raised as itself
    (not an ExceptionGroup), after the others have finished or been cancelled."""
    if len(fns) == 1:
        return [await fns[0]()]
    results: list = [None] * len(fns)
    errors: list[BaseException] = []

    async def one(k: int) -> None:
        try:
            results[k] = await fns[k]()
        except Exception as exc:
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for k in range(len(fns)):
            tg.start_soon(one, k)
    if errors:
        raise errors[0]
    return results


class _Request:
    """The runs of one HTTP request, one per job (choice)."""

    def __init__(self, fe: Frontend, jobs: list[Job], kind: Kind, arrival: float,
                 echo: bool, want_prompt_lps: bool, client: str = "") -> None:
        self.fe = fe
        self.jobs = jobs
        self.kind = kind
        single = len(jobs) == 1
        self.runs = [_Run(fe, t, kind.rid if single else f"{kind.rid}-{j.index}", client)
                     for t, j in zip(fe.metrics.trackers(arrival, jobs), jobs)]
        self.states = [ChoiceState(kind.chat, j, echo, want_prompt_lps, kind.tools) for j in jobs]

    async def start(self) -> None:
        if any(st.needs_table for st in self.states):
            table = await self.fe.token_table()
            for st in self.states:
                st.table = table
        firsts = [k for k, j in enumerate(self.jobs) if j.index == self._first_of(j)]
        rest = [k for k in range(len(self.jobs)) if k not in set(firsts)]
        for group in (firsts, rest):
            if group:
                await _gather([self._starter(k) for k in group])

    def _first_of(self, job: Job) -> int:
        return min(j.index for j in self.jobs if j.prompt_index == job.prompt_index)

    def _starter(self, k: int):
        job = self.jobs[k]
        return lambda: self.runs[k].start(job.prompt, job.params, self.kind.max_tokens_param)

    def first_usage(self) -> dict:
        """Usage before any output token (every run has its first output by then)."""
        first = self.runs[0].first
        return usage(first.num_prompt_tokens, 0, first.num_cached_tokens)

    def refused(self) -> None:
        for run in self.runs:
            if run.first is None:
                run.tracker.discard()
                run.finished = True  # refused or never sent: nothing to abort

    async def close(self) -> None:
        for run in self.runs:
            await run.close()


async def serve_request(fe: Frontend, request: Request, body: P._SamplingFields,
                        jobs: list[Job], kind: Kind, arrival: float, *, echo: bool = False,
                        want_prompt_lps: bool = False) -> Response:
    """Submit every choice, then answer: one JSON response, or the event stream."""
    req = _Request(fe, jobs, kind, arrival, echo, want_prompt_lps, client_of(request))

    how, result = await _unless_disconnected(request, req.start, fe.metrics)
    if how != "ok":
        if how == "error":
            req.refused()
        await req.close()  # gone: aborts the requests, queued or running
        return Response(status_code=499) if how == "gone" else result

    if body.stream:
        return _EventStream(req)

    def collector(k: int):
        async def collect():
            async for out in req.runs[k].outputs():
                req.states[k].piece(out)
        return collect

    try:
        how, result = await _unless_disconnected(
            request, lambda: _gather([collector(k) for k in range(len(jobs))]), None)
    finally:
        await req.close()
    if how != "ok":
        return Response(status_code=499) if how == "gone" else result
    return JSONBody(kind.whole(req.states))


class _EventStream(StreamingResponse):
    """The SSE response: one pump per choice feeds the body's generator; closes (aborts) the
    requests also when the body never started (the client went away first)."""

    def __init__(self, req: _Request) -> None:
        self._send, self._recv = anyio.create_memory_object_stream(math.inf)
        super().__init__(_stream(req, self._recv), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._req = req

    async def _pump(self, k: int) -> None:
        try:
            async for out in self._req.runs[k].outputs():
                self._send.send_nowait((k, out))
        except Exception as exc:
            self._send.send_nowait((k, exc))

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for k in range(len(self._req.runs)):
                    tg.start_soon(self._pump, k)
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self._send.close()
            self._recv.close()
            await self._req.close()


async def _stream(req: _Request, recv) -> AsyncIterator[bytes]:
    kind, states = req.kind, req.states
    try:
        if kind.chat:  # as vLLM: the role (with the prompt's ids), then what echo repeats
            use = req.first_usage() if kind.continuous_usage else None
            for k, st in enumerate(states):
                head = ({"prompt_token_ids": req.runs[k].first.prompt_token_ids}
                        if kind.return_ids else None)
                yield _sse(kind.chunk(st.job.index, "", None, None, role=True, use=use, head=head))
            if kind.echoed:
                for st in states:
                    yield _sse(kind.chunk(st.job.index, kind.echoed, None, None, use=use))
        left = len(states)
        while left:
            k, item = await recv.receive()
            if isinstance(item, BaseException):
                if isinstance(item, EngineError):  # the engine died (or shut down) under us
                    yield _sse(stream_error(item))
                    yield _DONE
                    return
                raise item
            st = states[k]
            first = st.first
            text, lps = st.piece(item)
            ids = {"token_ids": item.token_ids} if st.want_ids else None
            if st.tools is not None:  # a forced tool call: its deltas, not content
                use = total_usage(states) if kind.continuous_usage else None
                calls = st.tool_piece(text, item.finished)
                if calls is not None or lps:
                    yield _sse(kind.chunk(st.job.index, None, lps, None, use=use,
                                          tool_calls=calls, extra=ids))
                    ids = {"token_ids": []} if ids else None
                if item.finished:
                    left -= 1
                    yield _sse(kind.chunk(st.job.index, None, None, st.finish_reason, use=use,
                                          extra=ids))
                continue
            extra = ({"prompt_logprobs": st.prompt_lps}
                     if first and st.prompt_lps is not None else {})
            if first and st.want_ids and not kind.chat:  # chat: on the role chunk
                extra["prompt_token_ids"] = st.prompt_ids
            if ids:
                extra.update(ids)
            use = total_usage(states) if kind.continuous_usage else None
            if item.finished:
                left -= 1
                if kind.chat and (text or lps):
                    yield _sse(kind.chunk(st.job.index, text, lps, None, use=use, extra=extra))
                    text, lps, extra = None, None, ({"token_ids": []} if ids else None)
                yield _sse(kind.chunk(st.job.index, text, lps, st.finish, use=use, extra=extra))
            elif text or lps or (extra and set(extra) != {"token_ids"}) or (ids and item.token_ids):
                yield _sse(kind.chunk(st.job.index, text, lps, None, use=use, extra=extra))
        if kind.include_usage:
            yield _sse(kind.usage_chunk(total_usage(states)))
        yield _DONE
    finally:
        await req.close()


__all__ = ["Kind", "Job", "serve_request"]
