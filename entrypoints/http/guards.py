"""Pure ASGI middleware that refuses before the app does any work (see ``limits.py``).

* :class:`JsonOnlyGuard` (outermost of these): every POST must say ``Content-Type:
  application/json`` (parameters such as ``charset`` allowed; no other media type, none
  missing, one header only), else 415 from its head alone, before the body is read. Why: a
  browser sends a POST whose type is ``text/plain``, ``application/x-www-form-urlencoded`` or
  ``multipart/form-data`` -- or that has no body and no type -- to any origin without asking it
  first (no CORS preflight), so any web page its user opens could drive a server on loopback;
  a JSON body needs the preflight, which this server grants only to the origins it is told to
  (``--allowed-origins``). vLLM refuses the same requests (with a 400).
* :class:`InFlightGuard` (next): at most ``limit`` generation requests open at once; the
  next one gets 429 + ``Retry-After`` before its body is read.
* :class:`BodyGuard`: reads the whole body itself, bounded in size (``Content-Length`` checked
  first, then the bytes counted as they arrive: 413), in time (408) and, over all requests of the process, in memory buffered at once
  (503 + ``Retry-After``). A large body first waits for a slot of the ``LargeBodyGate``
  (``body_gate.py``), unread meanwhile; no slot within the body timeout: 503 and closed. The
  app then gets the body as one message, and the client's disconnect afterwards as usual.

NOTE: a 413 or 415 does not close the connection at once: closing with the client's bytes unread makes
the kernel send a reset, and the client loses the answer (a lingering close, as nginx does).
uvicorn discards the rest of the body without buffering it; the connection's head timer
(``server.py``), re-armed when the response completes, closes it if the client keeps sending.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import anyio

from .body_gate import RECEIVE_CPU_PER_BYTE, SCOPE_KEY, LargeBodyGate, Slot
from .errors import send_error

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: The media type every POST body must have (``Content-Type``, before any ``;``, any case).
JSON_MEDIA_TYPE = b"application/json"
#: Bodies buffered at once by one process, all requests together, in units of max_body_bytes.
BUFFER_BUDGET_BODIES = 32

Reject = Optional[Callable[[str], None]]


def _content_types(scope) -> list[bytes]:
    """The request's media types: each ``Content-Type`` header's, lower case, no parameters."""
    return [value.split(b";", 1)[0].strip().lower()
            for name, value in scope["headers"] if name == b"content-type"]


class JsonOnlyGuard:
    def __init__(self, app, on_reject: Reject = None) -> None:
        self.app = app
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        types = _content_types(scope)
        if types == [JSON_MEDIA_TYPE]:
            return await self.app(scope, receive, send)
        if self.on_reject is not None:
            self.on_reject("bad_request")
        told = ("no Content-Type" if not types else "several Content-Type headers" if len(types) > 1
                else f"Content-Type {types[0][:64].decode('latin-1')!r}")
        # Not closed: the body left unread is discarded by the server (see the NOTE above).
        await send_error(send, 415, f"unsupported media type: a POST body must be JSON "
                         f"(Content-Type: application/json), not {told}",
                         code="unsupported_media_type")


class InFlightGuard:
    def __init__(self, app, limit: int, on_reject: Reject = None) -> None:
        self.app = app
        self.limit = limit
        self.on_reject = on_reject
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            if self.on_reject is not None:
                self.on_reject("overloaded")
            return await send_error(send, 429, f"too many requests in flight on this server "
                                    f"(limit {self.limit}); retry later", "rate_limit_error",
                                    headers=((b"retry-after", b"1"),))
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _content_length(scope) -> tuple[bool, Optional[int]]:
    """(valid, length or None) from the request's headers."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit() or len(value) > 18:
                return False, None
            return True, int(value)
    return True, None


#: a body at least this large makes the guard call ``after_large`` when its request is done
LARGE_BODY_BYTES = 1 << 20


class BodyGuard:
    def __init__(self, app, max_body_bytes: int, body_timeout: float,
                 on_reject: Reject = None, after_large=None,
                 gate: Optional[LargeBodyGate] = None, large_body_bytes: int = 0) -> None:
        self.app = app
        self.gate = gate  # bodies over large_body_bytes take one of its slots (body_gate.py)
        self.large = large_body_bytes if gate is not None else max_body_bytes
        self.after_large = after_large  # called when a request with a large body is done
        self.max = max_body_bytes
        self.timeout = body_timeout
        self.on_reject = on_reject
        self.budget = BUFFER_BUDGET_BODIES * max_body_bytes
        self.buffered = 0  # body bytes held by requests of this process right now

    def _reject(self, reason: str) -> None:
        if self.on_reject is not None:
            self.on_reject(reason)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        valid, length = _content_length(scope)
        if not valid:
            self._reject("bad_request")
            return await send_error(send, 400, "invalid Content-Length header", close=True)
        if length is not None and length > self.max:
            self._reject("too_large")
            return await send_error(send, 413, self._too_large())
        held = 0
        slot: Optional[Slot] = None
        try:
            if length is not None and length > self.large:
                slot = await self._slot()
                if slot is None:
                    return await self._busy(send)
            chunks: list[bytes] = []
            with anyio.move_on_after(self.timeout) as deadline:
                while True:
                    if slot is None and held > self.large:  # chunked, past the size: wait here
                        slot = await self._slot(deadline=True)
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return  # the client went away: nobody to answer
                    data = msg.get("body", b"")
                    if held + len(data) > self.max:
                        self._reject("too_large")
                        return await send_error(send, 413, self._too_large())
                    if self.buffered + len(data) > self.budget:
                        self._reject("overloaded")
                        return await send_error(
                            send, 503, "this server is buffering too many request bodies; "
                            "retry later", "service_unavailable", "server_busy",
                            headers=((b"retry-after", b"1"),))
                    if data:
                        chunks.append(data)
                        held += len(data)
                        self.buffered += len(data)
                    if not msg.get("more_body", False):
                        break
            if deadline.cancelled_caught:
                self._reject("bad_request")
                return await send_error(send, 408, f"the request body was not received within "
                                        f"{self.timeout:g} s", close=True)
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            if slot is not None:
                slot.add(held * RECEIVE_CPU_PER_BYTE)
                scope = {**scope, SCOPE_KEY: slot}  # the app's parse gives it back
            await self.app(scope, _replay(body, receive), send)
        finally:
            if slot is not None:
                slot.release()
            self.buffered -= held
            if held >= LARGE_BODY_BYTES and self.after_large is not None:
                self.after_large()

    async def _slot(self, deadline: bool = False) -> Optional[Slot]:
        """A large-body slot; None if none came within the body timeout (``deadline``: the
        body's own deadline, around this wait, bounds it instead)."""
        assert self.gate is not None
        if deadline:
            return await self.gate.acquire()
        with anyio.move_on_after(self.timeout):
            return await self.gate.acquire()
        return None

    async def _busy(self, send) -> None:
        self._reject("overloaded")
        # closed: the body is left unread (reading it is what the slot bounds)
        await send_error(send, 503, f"this server is receiving too many large request bodies; "
                         f"none could start within {self.timeout:g} s; retry later",
                         "service_unavailable", "server_busy",
                         headers=((b"retry-after", b"1"),), close=True)

    def _too_large(self) -> str:
        return f"request body too large: the limit is {self.max} bytes"


def _replay(body: bytes, receive) -> Callable[[], Any]:
    """A ``receive`` that gives ``body`` once, then the connection's own messages."""
    pending = [body]

    async def replay():
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replay


__all__ = ["JsonOnlyGuard", "InFlightGuard", "BodyGuard", "GENERATION_PATHS", "JSON_MEDIA_TYPE"]
