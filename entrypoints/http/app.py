"""The OpenAI-compatible ASGI app (FastAPI) over an :class:`engine.interface.Engine`: an
in-process ``AsyncEngine``, or an ``ipc.EngineClient`` in a frontend process. Nothing is probed:
the app calls the protocol.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream``
true/false; SSE chunks in OpenAI's format ending with ``data: [DONE]``), ``GET /health`` (200
while the engine is alive), ``GET /ready`` (200 only while it is SERVING), ``GET /metrics``; with
``sleep_mode``, the admin endpoints of ``admin.py`` (``/sleep``, ``/wake_up``, ...).

A request passes, in order: the CORS policy (Starlette's ``CORSMiddleware``, only with
``limits.allowed_origins``: off by default, so no ``Access-Control-*`` header and no preflight
granted), the ``Host`` allow-list against DNS rebinding (``hosts.py``: on when bound to
loopback or with ``limits.allowed_hosts``), the media type (every POST ``application/json``, else 415), the in-flight limit and the
body limits (``guards.py``, before the body is read; a large body waits for a slot of
``body_gate.py``), the raw body against the schema's shape: every list's length, every value's
kind, the free-form JSON's size (``raw_limits.check_raw``, before the body becomes objects), the
JSON schema (``protocol.py``: strict types, every number and list bounded;
a large body is parsed on a worker thread), the prompt's size in characters, then the chat
template (rendered off the event loop by the engine's async ``apply_chat_template``) and the
engine. Every refusal is an OpenAI-shaped error (``errors.py``).
"""

from __future__ import annotations

import time
from typing import Mapping, Optional, Sequence, TypeVar, Union

import anyio
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from states import State

from engine.interface import Engine
from . import protocol as P
from .body_gate import LargeBodyGate, slot_of
from .raw_limits import SMALL_BODY, check_raw
from ..malloc import Trimmer
from .context import Frontend
from .errors import install_handlers, validation_error
from .guards import BodyGuard, InFlightGuard, JsonOnlyGuard
from .hosts import HostGuard, HostPolicy
from .limits import INLINE_PARSE_BYTES, HttpLimits
from . import generate, tokens

Body = TypeVar("Body", bound=P._Body)


async def parse_body(request: Request, model: type[Body], fe: Frontend) -> Body:
    """The request's JSON body as ``model`` (``RequestError`` if it is not one). The guard has
    bounded its size; a large one is parsed on a worker thread."""
    raw = await _body(request)
    parse = _checked(model)
    slot = slot_of(request.scope)  # a large body's: given back with the parse's CPU time
    if len(raw) <= INLINE_PARSE_BYTES:
        got, cpu = _timed(parse, raw)
    else:
        got, cpu = await anyio.to_thread.run_sync(_timed, parse, raw, limiter=fe.parse_limiter)
    if slot is not None:
        slot.add(cpu)
        slot.release()
    if not isinstance(got, P.RequestError):
        return got
    try:
        raise got
    finally:
        del got  # the traceback holds this frame: the frame must not hold the error


def _timed(parse, raw: bytes) -> tuple:
    """``parse(raw)`` and the CPU seconds this thread spent on it."""
    start = time.thread_time()
    got = parse(raw)
    return got, time.thread_time() - start


async def _body(request: Request) -> bytes:
    """The body as the guard gave it (one message): not copied, as ``request.body()`` does
    (it joins the body with the empty chunk that ends the stream; 13 ms of the event loop
    for 7.7 MiB, measured here)."""
    chunks = [chunk async for chunk in request.stream() if chunk]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _checked(model: type[Body]):
    """``model.model_validate_json`` after the raw body's check (``raw_limits.check_raw``;
    a body of at most ``SMALL_BODY`` bytes is left to the schema alone): the body, or the
    ``RequestError`` refusing it, returned (not raised) and made afresh, with no traceback.

    Why: an exception raised on the worker thread reaches the event loop through anyio's
    future, whose frame holds the future: the traceback makes a reference cycle, which keeps
    the body and all the parse made until the garbage collector's next full collection, rare
    in a quiet process. Measured on a frontend: 80 MB (about ten 7.7 MiB bodies) still held
    12 s after three waves of 16 refused bodies, freed by one ``gc.collect()``."""
    def parse(raw: bytes) -> Union[Body, P.RequestError]:
        try:
            schema = check_raw(raw, model) if len(raw) > SMALL_BODY else model
            return schema.model_validate_json(raw)
        except ValidationError as exc:
            return validation_error(exc)
        except P.RequestError as exc:
            return P.RequestError(str(exc), exc.param, exc.code, exc.status)
    return parse


class _DirectRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` and returns a ``Response`` itself: called
    directly, without FastAPI's per-request dependency solving and response serialization it
    has nothing to do for (tens of microseconds a request, on the generation routes)."""

    def get_route_handler(self):
        return self.endpoint


def create_app(engine: Engine, *, model_name: Union[str, Sequence[str], None] = None,
               limits: HttpLimits = HttpLimits(),
               cache_info: Optional[Mapping[str, str]] = None, sleep_mode: bool = False,
               admin_token: Optional[str] = None, bound: Optional[str] = None) -> FastAPI:
    """The ASGI app serving ``engine`` under ``limits``, as ``model_name`` (one or more names;
    default: the model's own), with ``cache_info`` as the cache_config_info metric's labels
    (read from an in-process engine when not given). ``sleep_mode``: with the admin endpoints
    (``admin_token``: required on them as ``Authorization: Bearer``). ``bound``: the address
    the server listens on (the ``Host`` policy: ``hosts.py``)."""
    fe = Frontend(engine, limits, model_name, cache_info)
    app = FastAPI(title="enginecore", summary="OpenAI-compatible API of an enginecore engine",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = fe
    install_handlers(app, fe.metrics)
    if sleep_mode:
        from .admin import add_sleep_routes

        add_sleep_routes(app, fe, admin_token)

    def rejected(reason: str) -> None:
        fe.metrics.rejected.labels(reason).inc()

    # The last added is the outermost: the media type and the in-flight limit answer before the
    # body is read; the CORS headers (when on) reach every answer, the guards' refusals too.
    app.state.large_bodies = LargeBodyGate(limits.large_body_slots, limits.large_body_cpu_share)
    app.add_middleware(BodyGuard, max_body_bytes=limits.max_body_bytes,
                       body_timeout=limits.body_timeout, on_reject=rejected, after_large=Trimmer(),
                       gate=app.state.large_bodies, large_body_bytes=limits.large_body_bytes)
    app.add_middleware(InFlightGuard, limit=limits.max_requests_in_flight, on_reject=rejected)
    app.add_middleware(JsonOnlyGuard, on_reject=rejected)
    hosts = HostPolicy(limits.allowed_hosts, bound)
    if hosts.on:
        app.add_middleware(HostGuard, policy=hosts, on_reject=rejected)
    if limits.cors:
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                           allow_methods=[m.upper() for m in limits.allowed_methods],
                           allow_headers=list(limits.allowed_headers),
                           allow_credentials=limits.allow_credentials)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = []
        for name in fe.served:
            card = {"id": name, "object": "model", "created": fe.created, "owned_by": "enginecore",
                    "root": fe.model}
            if fe.max_model_len:
                card["max_model_len"] = fe.max_model_len
            cards.append(card)
        return {"object": "list", "data": cards}

    async def completions(request: Request) -> Response:
        return await generate.completions(fe, request, parse_body)

    async def chat_completions(request: Request) -> Response:
        return await generate.chat_completions(fe, request, parse_body)

    for path, endpoint in (("/v1/completions", completions),
                           ("/v1/chat/completions", chat_completions)):
        app.router.add_api_route(path, endpoint, methods=["POST"], route_class_override=_DirectRoute)

    tokens.register(app, fe, parse_body)  # /tokenize, /detokenize, /version

    @app.get("/health")
    async def health() -> Response:
        status, body, _ = await fe.health()
        return JSONResponse(body, status_code=status)

    @app.get("/ready")
    async def ready() -> Response:
        state = fe.state
        ok = state is State.SERVING
        return JSONResponse({"status": "ready" if ok else "not ready", "state": state.value},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        _, _, h = await fe.health()
        if h is not None:
            fe.metrics.set_health(h)
        else:
            fe.metrics.set_unreachable()
        data, content_type = fe.metrics.render()
        return Response(data, media_type=content_type)

    return app


__all__ = ["create_app", "parse_body", "Frontend"]
