"""Sleep-mode admin endpoints, added only by ``create_app(..., sleep_mode=True)``
(``enginecore serve --http ... --enable-sleep-mode``):

* ``POST /sleep`` -- ``level`` (1 | 2, default 1), ``mode`` ("abort" | "wait", default "abort"),
  ``timeout`` (seconds, for "wait"; absent: no limit); answers once the device memory is freed;
* ``POST /wake_up`` -- ``tags`` (a non-empty subset of ["weights", "kv_cache"]; absent: both);
* ``POST /update_weights`` -- ``path``: a checkpoint on the engine's machine, same architecture;
* ``GET /is_sleeping`` -- ``{"is_sleeping": bool}``;
* ``POST /pause`` -- ``mode`` ("abort" | "wait" | "keep", default "abort"), ``timeout`` (for
  "wait"); answers once nothing steps (docs/rl.md); ``POST /resume``; ``GET /is_paused``;
* ``POST /abort_all`` -- ``reason``; every request in flight ends with its partial output, the
  answer's ``count`` says how many.

``/sleep`` also takes ``tags`` (``["kv_cache"]``: only the KV cache), ``/update_weights`` a
``version`` (the ``weight_version`` outputs carry from then on).

Parameters come only as a JSON object body (``Content-Type: application/json``, as every POST:
``guards.JsonOnlyGuard``; an empty body is ``{}``), never in the query string: a query parameter
is a 400 naming it. (vLLM reads them from the query string; then a cross-site form, which a
browser posts without asking, could choose them. A JSON body needs the CORS preflight.) They are
checked here, strictly and bounded (unknown keys too), before the engine is called.
A call answers ``{"status": "ok", "state": ..., "is_sleeping": ...}`` or an OpenAI-shaped error:
400 bad parameters or a refused checkpoint (the old weights keep serving), 401 without the token,
409 not possible in the engine's state (``wake_up`` while serving, ``sleep`` while asleep),
503 engine gone. With ``token`` set, every admin call needs ``Authorization: Bearer <token>``,
from every address (loopback too):
the right token is compared first (constant time) and served at once; failures meet the IPC
server's throttle (``ipc.auth.AuthThrottle``, keyed by the client's address, one per frontend
process): past a few, the 401 is held (0.25 s doubling to 4 s), and beyond the failures held at
once the answer is 429 with ``Retry-After``, at once.
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Annotated, Any, Literal, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from engine.errors import EngineDeadError
from ipc.auth import AuthThrottle
from states import State

from . import protocol as P
from .context import Frontend
from .errors import error_response, openai_error, validation_error

#: The wire's bounds (ipc/messages.py): a path of at most PATH_MAX characters, timeouts to 1e9 s.
MAX_PATH_CHARS = 4096
MAX_TIMEOUT = 1e9


class _Admin(BaseModel):
    model_config = ConfigDict(extra="forbid")


Tags = Optional[Annotated[list[Literal["weights", "kv_cache"]], Field(min_length=1, max_length=2)]]


class SleepParams(_Admin):
    level: P._int(1, 2) = 1
    mode: Literal["abort", "wait"] = "abort"
    timeout: Optional[P._num(0.0, MAX_TIMEOUT)] = None
    tags: Tags = None


class WakeUpParams(_Admin):
    tags: Tags = None


class PauseParams(_Admin):
    mode: Literal["abort", "wait", "keep"] = "abort"
    timeout: Optional[P._num(0.0, MAX_TIMEOUT)] = None


class AbortAllParams(_Admin):
    reason: Annotated[str, Field(strict=True, max_length=256)] = "abort_all"


def _utf8(path: str) -> str:
    path.encode("utf-8")  # a lone surrogate (JSON "\ud800") is a ValueError: a 400 naming "path"
    return path


class UpdateWeightsParams(_Admin):
    path: Annotated[str, Field(strict=True, min_length=1, max_length=MAX_PATH_CHARS, pattern=r"^[^\x00]+$"),
                    AfterValidator(_utf8)]
    version: Optional[P._int(0, 2**63 - 1)] = None


async def _params(request: Request, model: type[_Admin]) -> _Admin:
    if request.scope.get("query_string"):
        key = next(iter(request.query_params), "")[:64] or None
        raise P.RequestError(f"{key or 'query string'}: the admin endpoints take no query "
                             "parameters; send them as a JSON object body (Content-Type: "
                             "application/json)", param=key)
    data: dict[str, Any] = {}
    body = await request.body()  # bounded by the BodyGuard
    if body.strip():
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise P.RequestError(f"invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise P.RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _authorized(request: Request, token: Optional[str]) -> bool:
    if token is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def add_sleep_routes(app: FastAPI, fe: Frontend, token: Optional[str],
                     throttle: Optional[AuthThrottle] = None) -> None:
    """The admin routes of the module docstring on ``app`` (``token``: required if not None;
    ``throttle``: for failed ones, a default ``AuthThrottle`` if None)."""
    throttle = throttle or AuthThrottle()

    async def unauthorized(request: Request) -> Optional[JSONResponse]:
        """None for the right token (at once); else the 401 after the throttle's hold, or a 429
        at once when too many failures are held already."""
        if _authorized(request, token):
            return None
        denied = await throttle.deny(request.client.host if request.client else "?")
        if denied.retry_after is not None:
            return openai_error(429, "too many failed authentications; try later",
                                "authentication_error", None, "too_many_failed_authentications",
                                headers={"Retry-After": str(max(1, math.ceil(denied.retry_after)))})
        return openai_error(401, "the admin endpoints need the server token "
                            "(Authorization: Bearer <token>)", "authentication_error", None,
                            "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def answer(extra: Optional[dict] = None) -> JSONResponse:
        state = fe.state
        return JSONResponse({"status": "ok", "state": state.value,
                             "is_sleeping": state is State.SLEEPING,
                             "is_paused": state is State.PAUSED, **(extra or {})})

    async def call(request: Request, model: type[_Admin], run) -> Response:
        if (refused := await unauthorized(request)) is not None:
            return refused
        try:
            params = await _params(request, model)
            if fe.dead is not None:
                raise EngineDeadError(fe.dead)
            extra = await run(params)
        except Exception as exc:
            return error_response(exc)
        return answer(extra)

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        return await call(request, SleepParams,
                          lambda p: fe.engine.sleep(p.level, p.mode, p.timeout, p.tags))

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        return await call(request, WakeUpParams, lambda p: fe.engine.wake_up(p.tags))

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        return await call(request, UpdateWeightsParams,
                          lambda p: fe.engine.update_weights(p.path, p.version))

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request) -> Response:
        if (refused := await unauthorized(request)) is not None:
            return refused
        return JSONResponse({"is_sleeping": fe.state is State.SLEEPING})

    @app.post("/pause")
    async def pause(request: Request) -> Response:
        return await call(request, PauseParams, lambda p: fe.engine.pause(p.mode, p.timeout))

    @app.post("/resume")
    async def resume(request: Request) -> Response:
        return await call(request, _Admin, lambda p: fe.engine.resume())

    @app.get("/is_paused")
    async def is_paused(request: Request) -> Response:
        if (refused := await unauthorized(request)) is not None:
            return refused
        return JSONResponse({"is_paused": fe.state is State.PAUSED})

    @app.post("/abort_all")
    async def abort_all(request: Request) -> Response:
        async def run(p: AbortAllParams) -> dict:
            return {"count": await fe.engine.abort_all(p.reason)}
        return await call(request, AbortAllParams, run)


__all__ = ["add_sleep_routes", "SleepParams", "WakeUpParams", "UpdateWeightsParams",
           "PauseParams", "AbortAllParams"]
