"""The OpenAI-compatible ASGI app (FastAPI), written against an *engine-like* object.

The engine-like object is either an in-process :class:`engine.AsyncEngine` or an
``ipc.EngineClient`` (a frontend process's connection to the engine process). Their common
surface, smoothed over by :class:`EngineHandle`:

* ``generate(prompt, params, request_id)``: an async iterator of ``RequestOutput`` (returned
  directly or by an awaitable); errors are raised on the call or on the first ``__anext__``;
* ``abort(request_id)``, ``state``, ``health()`` (sync on the engine, async on the client);
* the chat template: ``apply_chat_template(messages)`` on the client, ``tokenizer.`` on the
  engine; the model name: ``model`` / ``config.model``; ``max_model_len`` / ``runner.``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``
true/false; SSE chunks in OpenAI's format ending with ``data: [DONE]``), ``GET /health`` (200
while the engine is alive), ``GET /ready`` (200 only while it is SERVING), ``GET /metrics``.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
requests (also the engine's ``BadRequestError``, e.g. a prompt longer than the context), 404 for
an unknown model, 503 (with ``Retry-After``) while the engine drains, is shut down or is dead.

A request whose client goes away (mid-stream, or while a non-streaming request is generating)
is aborted in the engine.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import anyio
import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from states import State

from engine.errors import BadRequestError, EngineDeadError, EngineError, EngineShutdownError
from ipc.errors import ErrorKind, spec_of
from . import protocol as P
from .metrics import Metrics, RequestTracker

log = logging.getLogger("enginecore.http")

_json = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"
HEALTH_TIMEOUT = 2.0


async def _maybe_await(value):
    if inspect.isawaitable(value):
        return await value
    return value


class EngineHandle:
    """One way to call an AsyncEngine or an EngineClient; see the module docstring."""

    def __init__(self, engine: Any, model_name: Optional[str] = None) -> None:
        self.engine = engine
        if model_name is None:
            model_name = getattr(engine, "model", None)
            if not isinstance(model_name, str) or not model_name:
                model_name = engine.config.model
        self.model: str = model_name
        #: Set by the frontend when its connection to the engine is gone for good.
        self.dead: Optional[str] = None
        #: True once the engine was seen FAILED (it moves on to SHUTDOWN after its release).
        self.failed = False
        self._state_waiters: list[anyio.Event] = []
        register = getattr(engine, "on_state_change", None)
        if callable(register):
            register(self._on_state_change)

    def _on_state_change(self, old, new) -> None:
        if State(new) is State.FAILED:
            self.failed = True
        waiters, self._state_waiters = self._state_waiters, []
        for ev in waiters:
            ev.set()

    async def state_changed(self, timeout: float) -> None:
        """Wait for the next state change (or ``timeout``)."""
        ev = anyio.Event()
        self._state_waiters.append(ev)
        with anyio.move_on_after(timeout):
            await ev.wait()

    @property
    def max_model_len(self) -> Optional[int]:
        n = getattr(self.engine, "max_model_len", None)
        if n is None:
            runner = getattr(self.engine, "runner", None)
            n = getattr(runner, "max_model_len", None)
        return int(n) if n else None

    @property
    def state(self) -> State:
        st = self.engine.state
        st = st if isinstance(st, State) else State(st)
        if st is State.FAILED:
            self.failed = True
        return st

    async def health(self):
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        with anyio.fail_after(HEALTH_TIMEOUT):
            return await _maybe_await(self.engine.health())

    async def chat_prompt(self, messages: list[dict]) -> str:
        fn = getattr(self.engine, "apply_chat_template", None)
        if fn is None:
            fn = self.engine.tokenizer.apply_chat_template
        try:
            return await _maybe_await(fn(messages, add_generation_prompt=True))
        except EngineError:
            raise
        except Exception as exc:  # a template that fails on these messages
            raise P.RequestError(f"chat template failed: {exc}", param="messages") from None

    async def generate(self, prompt, params, request_id: str) -> AsyncIterator:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        return await _maybe_await(self.engine.generate(prompt, params, request_id=request_id))

    async def abort(self, request_id: str) -> None:
        if self.dead is None:
            await _maybe_await(self.engine.abort(request_id))


# --------------------------------------------------------------------------- errors

def _error(status: int, message: str, type: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type, param, code), status_code=status, headers=headers)


def error_response(exc: BaseException, metrics: Optional[Metrics] = None) -> JSONResponse:
    """The HTTP answer for an error raised before a response started (ipc.errors.ERROR_TABLE
    gives each exception its status, OpenAI type and code)."""
    if isinstance(exc, P.RequestError):
        if metrics is not None:
            metrics.rejected.labels("bad_request").inc()
        return _error(exc.status, str(exc), "invalid_request_error", exc.param, exc.code)
    spec = spec_of(exc)
    if metrics is not None:
        metrics.rejected.labels(_REJECTED_REASON.get(spec.kind, "unavailable")).inc()
    headers = None
    if spec.retryable or spec.kind is ErrorKind.SHUTDOWN:
        retry = max(1, math.ceil(getattr(exc, "retry_after", 1.0) or 1.0))
        headers = {"Retry-After": str(retry)}
    if spec.kind is ErrorKind.INTERNAL:
        log.error("unexpected error: %r", exc)
        text = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
    else:
        text = str(exc)
    return _error(spec.http_status, text, spec.openai_type, None, spec.openai_code, headers=headers)


_REJECTED_REASON = {ErrorKind.BAD_REQUEST: "bad_request", ErrorKind.DRAINING: "draining",
                    ErrorKind.OVERLOADED: "overloaded"}


def _stream_error(exc: BaseException) -> dict:
    spec = spec_of(exc)
    return P.error_body(str(exc) or type(exc).__name__, "server_error", None,
                        spec.openai_code or "internal_error")


_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "function-", "literal[")


def _param_of(loc) -> Optional[str]:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages.[0].content"`` (pydantic
    adds the member of a union it tried as a location element: dropped)."""
    parts: list[str] = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif parts and str(p).lower().startswith(_TYPE_TAGS):
            break
        else:
            parts.append(str(p))
    return ".".join(parts) or None


def _sse(obj: dict) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


# --------------------------------------------------------------------------- one request

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

    def __init__(self, handle: EngineHandle, tracker: RequestTracker, request_id: str) -> None:
        self.handle = handle
        self.tracker = tracker
        self.request_id = request_id
        self.it: Optional[AsyncIterator] = None
        self.first = None
        self.finished = False
        self.closed = False

    async def start(self, prompt, params) -> "_Run":
        self.it = await self.handle.generate(prompt, params, self.request_id)
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
        # Both engines' streams abort an unfinished request on aclose(); other iterators get an
        # explicit abort.
        aclose = getattr(self.it, "aclose", None)
        with anyio.CancelScope(shield=True):
            try:
                if aclose is not None:
                    await aclose()
                elif not self.finished and self.it is not None:
                    await self.handle.abort(self.request_id)
            except Exception as exc:  # the engine is gone: nothing left to abort
                log.debug("abort of %s failed: %r", self.request_id, exc)


class _Kind:
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


async def _serve_request(fe: "Frontend", request: Request, body: P._SamplingFields,
                         prompt, params, kind: _Kind, arrival: float) -> Response:
    handle = fe.handle
    tracker = fe.metrics.tracker(arrival)
    run = _Run(handle, tracker, kind.rid)

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

    def __init__(self, run: _Run, kind: _Kind) -> None:
        super().__init__(_stream(run, kind), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._run.close()


async def _stream(run: _Run, kind: _Kind) -> AsyncIterator[bytes]:
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
            yield _sse(_stream_error(exc))
            yield _DONE
            return
        if kind.include_usage and last is not None:
            yield kind.usage_chunk(P.usage(last.num_prompt_tokens, last.num_output_tokens))
        yield _DONE
    finally:
        await run.close()


# --------------------------------------------------------------------------- the app

class Frontend:
    """What the routes share: the engine handle and this process's metrics."""

    def __init__(self, engine: Any, model_name: Optional[str] = None) -> None:
        self.handle = engine if isinstance(engine, EngineHandle) else EngineHandle(engine, model_name)
        self.metrics = Metrics()
        self.created = P.now()

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.handle.model:
            raise P.RequestError(f"The model `{model}` does not exist; this server serves "
                                 f"`{self.handle.model}`.", param="model", code="model_not_found",
                                 status=404)

    def default_max_tokens(self, chat: bool) -> int:
        # Completions: OpenAI's default of 16. Chat: until the context is full (the engine stops
        # a request at the context limit with finish_reason "length").
        return (self.handle.max_model_len or 4096) if chat else 16


def create_app(engine: Any, *, model_name: Optional[str] = None) -> FastAPI:
    """The ASGI app serving ``engine`` (an AsyncEngine, an EngineClient or an EngineHandle)."""
    fe = Frontend(engine, model_name)
    app = FastAPI(title="enginecore", summary="OpenAI-compatible API of an enginecore engine",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = fe

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _param_of(first.get("loc", ()))
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            param, msg = None, f"invalid JSON body: {first.get('ctx', {}).get('error', msg)}"
        fe.metrics.rejected.labels("bad_request").inc()
        return _error(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": fe.handle.model, "object": "model", "created": fe.created,
                "owned_by": "enginecore"}
        if fe.handle.max_model_len:
            card["max_model_len"] = fe.handle.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            fe.check_model(body.model)
            prompt = body.check()
            params = body.sampling_params(body.max_tokens if body.max_tokens is not None
                                          else fe.default_max_tokens(chat=False))
        except BadRequestError as exc:
            return error_response(exc, fe.metrics)
        kind = _Kind(False, P.new_id("cmpl"), fe.handle.model, body.include_usage)
        return await _serve_request(fe, request, body, prompt, params, kind, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            fe.check_model(body.model)
            messages = body.check()
            n = body.requested_max_tokens
            params = body.sampling_params(n if n is not None else fe.default_max_tokens(chat=True))
            prompt = await fe.handle.chat_prompt(messages)
        except Exception as exc:
            return error_response(exc, fe.metrics)
        kind = _Kind(True, P.new_id("chatcmpl"), fe.handle.model, body.include_usage)
        return await _serve_request(fe, request, body, prompt, params, kind, arrival)

    @app.get("/health")
    async def health() -> Response:
        try:
            h = await fe.handle.health()
        except Exception as exc:
            return JSONResponse({"status": "dead", "detail": str(exc)}, status_code=503)
        state = h.state.value if isinstance(h.state, State) else str(h.state)
        ok = bool(h.live)
        return JSONResponse({"status": "ok" if ok else "unavailable", "state": state},
                            status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready() -> Response:
        handle = fe.handle
        state = State.FAILED if handle.dead is not None else handle.state
        ok = state is State.SERVING
        return JSONResponse({"status": "ready" if ok else "not ready", "state": state.value},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            fe.metrics.set_health(await fe.handle.health())
        except Exception:
            fe.metrics.set_unreachable()
        data, content_type = fe.metrics.render()
        return Response(data, media_type=content_type)

    return app


__all__ = ["create_app", "EngineHandle", "Frontend", "error_response"]
