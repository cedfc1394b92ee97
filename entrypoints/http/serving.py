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
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import anyio
from fastapi import Request
from fastapi.responses import Response

from engine.errors import BadRequestError, EngineShutdownError
from engine.interface import RequestStreamLike
from . import protocol as P
from .choices import ChoiceState, Job, Kind, usage
from .context import Frontend, client_of
from .errors import JSONBody, error_response
from .metrics import Metrics, RequestTracker
from .sse import EventStream

log = logging.getLogger("enginecore.http")

#: how the engine's refusal of a max_tokens past the context begins (engine/serving/admission.py)
MAX_TOKENS_REFUSAL = "max_tokens is too large"


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
        self.tracker.submitted()
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
            if self.kind.ids_as_tokens:
                table = table.as_ids()
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
        prompt = job.prompt if job.submit is None else job.submit
        return lambda: self.runs[k].start(prompt, job.params, self.kind.max_tokens_param)

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
    """Submit every choice, then answer: one JSON response, or the event stream (which submits
    them itself, under its own watch for the client going away)."""
    req = _Request(fe, jobs, kind, arrival, echo, want_prompt_lps, client_of(request))
    if body.stream:
        return EventStream(req)

    async def answer() -> Response:
        try:
            await req.start()
        except Exception as exc:
            req.refused()
            return error_response(exc, fe.metrics)

        def collector(k: int):
            async def collect():
                async for out in req.runs[k].outputs():
                    req.states[k].piece(out)
            return collect

        await _gather([collector(k) for k in range(len(jobs))])
        return JSONBody(kind.whole(req.states))

    try:
        how, result = await _unless_disconnected(request, answer, None)
    finally:
        await req.close()  # gone: aborts the requests, queued or running
    return Response(status_code=499) if how == "gone" else result


__all__ = ["Kind", "Job", "serve_request"]
