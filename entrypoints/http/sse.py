"""A streamed generation request's answer: server-sent events in OpenAI's chunk format (each
naming its choice's ``index``; chat's role chunk first; usage last with ``include_usage``; an
engine error mid-stream as an error event), ending with ``data: [DONE]``.

:class:`EventStream` is the response ``serving.serve_request`` returns for ``stream: true``: it
submits the request's choices itself, under its own watch for the client going away, and sends
each event from the task that reads the outputs.
"""

from __future__ import annotations

import math
from typing import Any, AsyncIterator

import anyio
from fastapi.responses import Response

from engine.errors import EngineError
from .choices import total_usage
from .errors import error_response, json_bytes, stream_error

_DONE = b"data: [DONE]\n\n"


def _sse(obj: dict) -> bytes:
    """One event: its JSON on one line, whatever line ends a reader knows (errors.json_bytes)."""
    return b"data: " + json_bytes(obj) + b"\n\n"


#: the SSE response's head (the status and these headers; uvicorn adds the transfer encoding)
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class EventStream(Response):
    """The SSE response, as a plain ASGI app: its events are sent from the task that reads the
    outputs -- with one choice, straight from its run's stream; with several, from a memory
    stream that one pump per choice feeds. A watcher ends it when the client goes away. Closes
    (aborts) the requests whatever happens, also when the body never started.

    Why not Starlette's ``StreamingResponse``: it runs the body in a task of its own, so every
    token took one more hop through the event loop (the engine's stream, a pump, a memory
    stream, the body's task): measured under a burst of 256 streams, the frontend process's
    CPU per token is what limits a single API server."""

    def __init__(self, req) -> None:  # serving._Request
        super().__init__(status_code=200)
        self._req = req
        self._over = False  # the response is complete: the watcher's wake-up is not the client's
        self._watched = False  # the watcher has returned

    async def _watch(self, receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._watched = True
        if not self._over:
            scope.cancel()

    async def _pump(self, k: int, send_stream) -> None:
        try:
            async for out in self._req.runs[k].outputs():
                send_stream.send_nowait((k, out))
        except Exception as exc:
            send_stream.send_nowait((k, exc))

    async def _source(self, tg) -> AsyncIterator[tuple[int, Any]]:
        """(choice, output or the exception that ended it), as they come."""
        runs = self._req.runs
        if len(runs) == 1:
            try:
                async for out in runs[0].outputs():
                    yield 0, out
            except Exception as exc:
                yield 0, exc
            return
        send_stream, recv = anyio.create_memory_object_stream(math.inf)
        with send_stream, recv:
            for k in range(len(runs)):
                tg.start_soon(self._pump, k, send_stream)
            left = len(runs)
            while left:
                k, item = await recv.receive()
                if isinstance(item, BaseException) or item.finished:
                    left -= 1
                yield k, item

    async def __call__(self, scope, receive, send) -> None:
        req = self._req
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                try:
                    await req.start()
                except Exception as exc:
                    req.refused()
                    answer: Response = error_response(exc, req.fe.metrics)
                else:
                    answer = self
                    await self._send_events(send, tg)
                if answer is not self:
                    await answer(scope, receive, send)
                await self._end(tg)
        finally:
            await req.close()

    async def _send_events(self, send, tg) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        source = self._source(tg)
        body = _stream(self._req, source)
        try:
            async for event in body:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        finally:
            await body.aclose()
            await source.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _end(self, tg) -> None:
        """The response is complete: the watcher's ``receive`` returns by itself (uvicorn
        answers it once the response is complete), so it is left to end rather than cancelled
        -- anyio's ``cancel`` formats the current task's repr, tens of microseconds per request.
        Cancelled only if it still waits after a turn of the loop."""
        self._over = True
        if not self._watched:
            await anyio.lowlevel.checkpoint()
            if not self._watched:
                tg.cancel_scope.cancel()


async def _stream(req, source) -> AsyncIterator[bytes]:
    """The events of ``req`` from ``source`` (:meth:`EventStream._source`)."""
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
        async for k, item in source:
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


__all__ = ["EventStream"]
