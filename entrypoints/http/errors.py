"""Every error the HTTP frontend answers, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

* 400 ``invalid_request_error``: invalid JSON, a value of the wrong type or out of range (we answer
  400 where FastAPI would answer 422, as OpenAI does), what the engine cannot do;
* 404 (unknown path, ``code: "not_found"``; unknown model, ``code: "model_not_found"``),
  405 (``code: "method_not_allowed"``, with ``Allow``), 408 (body not sent in time),
  413 (body too large, ``code: "request_too_large"``);
* 429 ``rate_limit_error`` with ``Retry-After``: this frontend's requests in flight
  (``code: "too_many_requests"``) or the engine's admission limits (``"engine_overloaded"``);
* 503 ``service_unavailable``: too many connections, the engine draining or asleep
  (``Retry-After``; ``code: "engine_sleeping"`` while asleep), shut down or dead; 500
  ``server_error`` only for a bug.

:func:`error_response` maps an exception through ``ipc.errors.ERROR_TABLE``; :func:`send_error`
answers from raw ASGI code (the guards and the connection-level refusals).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineError
from ipc.errors import ErrorKind, spec_of

from . import protocol as P

log = logging.getLogger("enginecore.http")
_json = msgspec.json.Encoder()

#: The ``code`` of the statuses answered without an exception of ours behind them.
STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "request_too_large", 429: "too_many_requests", 503: "service_unavailable"}
_REJECTED_REASON = {ErrorKind.BAD_REQUEST: "bad_request", ErrorKind.DRAINING: "draining",
                    ErrorKind.OVERLOADED: "overloaded", ErrorKind.SLEEPING: "sleeping"}


# NOTE: JSON leaves U+0085 (NEL), U+2028 and U+2029 unescaped (msgspec, and json.dumps with
# ensure_ascii=False, as Starlette's JSONResponse), but Python's str.splitlines -- so httpx's
# iter_lines, and other line-based readers -- ends a line at each: an SSE event whose text has
# one arrives cut in two. Escaped (``\u0085``) they stay the same JSON. In valid UTF-8 their
# byte sequences cannot occur inside another character, and JSON puts non-ASCII text only
# inside strings: replacing the bytes is exact.
_SEPARATORS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"),
               (b"\xe2\x80\xa9", b"\\u2029"))


def escape_separators(data: bytes) -> bytes:
    """UTF-8 JSON ``data`` with U+0085, U+2028 and U+2029 escaped (the same JSON value)."""
    if data.isascii():  # (most chunks: one pass in C)
        return data
    for raw, escaped in _SEPARATORS:
        data = data.replace(raw, escaped)
    return data


def json_bytes(obj) -> bytes:
    """``obj`` as JSON that no line-based reader splits (:func:`escape_separators`)."""
    return escape_separators(_json.encode(obj))


class JSONBody(JSONResponse):
    """Starlette's JSONResponse, with U+0085, U+2028 and U+2029 escaped."""

    def render(self, content) -> bytes:
        return escape_separators(super().render(content))


def openai_error(status: int, message: str, type: str, param=None, code=None,
                 headers=None) -> JSONResponse:
    return JSONBody(P.error_body(message, type, param, code), status_code=status, headers=headers)


def error_response(exc: BaseException, metrics=None) -> JSONResponse:
    """The HTTP answer for an error raised before a response started (ipc.errors.ERROR_TABLE
    gives each exception its status, OpenAI type and code)."""
    if isinstance(exc, P.RequestError):
        if metrics is not None:
            metrics.rejected.labels("bad_request").inc()
        return openai_error(exc.status, str(exc), "invalid_request_error", exc.param, exc.code)
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
    return openai_error(spec.http_status, text, spec.openai_type, None, spec.openai_code,
                        headers=headers)


def stream_error(exc: BaseException) -> dict:
    """The error event that ends a stream whose response has started."""
    spec = spec_of(exc)
    return P.error_body(str(exc) or type(exc).__name__, "server_error", None,
                        spec.openai_code or "internal_error")


# --------------------------------------------------------------------------- validation

_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "function-", "literal[",
              "constrained-")


def param_of(loc) -> Optional[str]:
    """``("messages", 0, "content", "str")`` -> ``"messages.[0].content"`` (pydantic adds the
    member of a union it tried as a location element: dropped; so is FastAPI's ``"body"``)."""
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


def invalid_body(errors: list) -> P.RequestError:
    """The 400 for a body that failed validation (its first error names the parameter)."""
    first = errors[0] if errors else {}
    param = param_of(first.get("loc", ()))
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        param, msg = None, f"invalid JSON body: {first.get('ctx', {}).get('error', msg)}"
    elif first.get("type") in ("model_type", "model_attributes_type") and param is None:
        msg = "the request body must be a JSON object"
    return P.RequestError(f"{param}: {msg}" if param else msg, param=param)


def validation_error(exc: ValidationError) -> P.RequestError:
    return invalid_body(exc.errors(include_url=False, include_input=False))


def install_handlers(app: FastAPI, metrics) -> None:
    """OpenAI-shaped answers for what FastAPI/Starlette answer themselves (404, 405, 422)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(invalid_body(list(exc.errors())), metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = STATUS_CODES.get(exc.status_code)
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return openai_error(exc.status_code, message, kind, None, code, headers=exc.headers)


# --------------------------------------------------------------------------- raw ASGI

def error_bytes(status: int, message: str, type: str = "invalid_request_error",
                code: Optional[str] = None) -> bytes:
    return json_bytes(P.error_body(message, type, None, code or STATUS_CODES.get(status)))


async def send_error(send, status: int, message: str, type: str = "invalid_request_error",
                     code: Optional[str] = None, headers: tuple = (), close: bool = False) -> None:
    """Answer an ASGI request with an OpenAI error (``close``: and end the connection)."""
    body = error_bytes(status, message, type, code)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           *headers]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


__all__ = ["escape_separators", "json_bytes", "JSONBody", "openai_error", "error_response",
           "stream_error", "param_of", "invalid_body",
           "validation_error", "install_handlers", "error_bytes", "send_error", "STATUS_CODES"]
