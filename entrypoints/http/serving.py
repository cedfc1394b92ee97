"""One generation request over HTTP: submitted to the engine, its outputs sent back as one
JSON response or as server-sent events (OpenAI's chunks, ending with ``data: [DONE]``).

A request whose client goes away (mid-stream, or while a non-streaming request is generating)
is aborted in the engine: leaving a request stream early (``aclose``) aborts it, whatever the
engine behind it.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.errors import EngineError, EngineShutdownError
from engine.interface import RequestStreamLike
from . import protocol as P
from .context import Frontend
from .errors import error_response, stream_error
from .metrics import Metrics, RequestTracker

log = logging.getLogger("enginecore.http")

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"


def _sse(obj: dict) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


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

    def __init__(self, fe: Frontend, tracker: RequestTracker, request_id: str) -> None:
        self.fe = fe
        self.tracker = tracker
        self.request_id = request_id
        self.it: Optional[RequestStreamLike] = None
        self.first = None
        self.finished = False
        self.closed = False

    async def start(self, prompt, params) -> "_Run":
        self.it = self.fe.generate(prompt, params, self.request_id)
        try:
            self.first = await self.it.__anext__()
        except StopAsyncIteration:  # pragma: no cover - engines always send a terminal output
            raise EngineShutdownError("the engine ended the request without output") from None
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


class Kind:
    """What differs between /v1/completions and /v1/chat/completions."""

    def __init__(self, chat: bool, rid: str, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.rid = rid
        self.model = model
        self.created = P.now()
        self.include_usage = include_usage

    def _chunk(self, text: Optional[str], finish: Optional[str], role: bool = False) -> bytes:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            obj = P.chat_chunk(self.rid, self.created, self.model, delta, finish)
        else:
            obj = P.completion_chunk(self.rid, self.created, self.model, text or "", finish)
        if self.include_usage:
            obj["usage"] = None
        return _sse(obj)

    def head(self) -> list[bytes]:
        return [self._chunk("", None, role=True)] if self.chat else []

    def piece(self, text: str) -> bytes:
        return self._chunk(text, None)

    def tail(self, text: str, finish: str) -> list[bytes]:
        if self.chat:
            return ([self._chunk(text, None)] if text else []) + [self._chunk(None, finish)]
        return [self._chunk(text, finish)]

    def usage_chunk(self, use: dict) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse(P.usage_chunk(self.rid, self.created, self.model, obj, use))

    def whole(self, text: str, finish: str, use: dict) -> dict:
        make = P.chat_completion if self.chat else P.completion
        return make(self.rid, self.created, self.model, text, finish, use)


async def serve_request(fe: Frontend, request: Request, body: P._SamplingFields,
                        prompt, params, kind: "Kind", arrival: float) -> Response:
    """Submit, then answer: one JSON response, or the event stream."""
    tracker = fe.metrics.tracker(arrival)
    run = _Run(fe, tracker, kind.rid)

    how, result = await _unless_disconnected(request, lambda: run.start(prompt, params), fe.metrics)
    if how != "ok":
        if how == "error" and run.first is None:
            tracker.discard()
            run.finished = True  # refused: nothing to abort
        await run.close()  # gone: aborts the request, queued or running
        return Response(status_code=499) if how == "gone" else result

    if body.stream:
        return _EventStream(run, kind)

    async def collect():
        parts, last = [], None
        async for out in run.outputs():
            parts.append(out.text)
            last = out
        return "".join(parts), last

    try:
        how, result = await _unless_disconnected(request, collect, None)  # not a refusal
    finally:
        await run.close()
    if how != "ok":
        return Response(status_code=499) if how == "gone" else result
    text, last = result
    use = P.usage(last.num_prompt_tokens, last.num_output_tokens)
    return JSONResponse(kind.whole(text, last.finish_reason or "stop", use))


class _EventStream(StreamingResponse):
    """The SSE response; closes (aborts) the request also when the body never started (the
    client went away before the response began)."""

    def __init__(self, run: _Run, kind: Kind) -> None:
        super().__init__(_stream(run, kind), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._run.close()


async def _stream(run: _Run, kind: Kind) -> AsyncIterator[bytes]:
    try:
        for chunk in kind.head():
            yield chunk
        last = None
        try:
            async for out in run.outputs():
                last = out
                if out.finished:
                    for chunk in kind.tail(out.text, out.finish_reason or "stop"):
                        yield chunk
                elif out.text:
                    yield kind.piece(out.text)
        except EngineError as exc:  # the engine died (or shut down) under this stream
            yield _sse(stream_error(exc))
            yield _DONE
            return
        if kind.include_usage and last is not None:
            yield kind.usage_chunk(P.usage(last.num_prompt_tokens, last.num_output_tokens))
        yield _DONE
    finally:
        await run.close()


__all__ = ["Kind", "serve_request"]
