"""Errors of the IPC layer itself (framing, handshake, transport).

They subclass :class:`engine.errors.EngineError`, so a caller that catches the engine's errors
also catches a broken connection. ``ipc.messages.ErrorKind`` maps each class to a wire code.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional

from engine.errors import (BadRequestError, CheckpointError, EngineDeadError, EngineDrainingError,
                           EngineError, EngineOverloadedError, EnginePausedError,
                           EngineShutdownError, EngineSleepingError)
from states import InvalidTransitionError


class IPCError(EngineError):
    """Base class of the IPC layer's errors."""


class ProtocolError(IPCError):
    """A frame or message that breaks the protocol: undecodable, invalid, out of bounds or
    unexpected at this point of the conversation. The connection cannot be trusted any more."""


class FrameTooLargeError(ProtocolError):
    """A length header above the frame limit (rejected before the body is read), or an outgoing
    message that would not fit in one frame."""

    def __init__(self, size: int | None = None, limit: int | None = None, message: str | None = None):
        if message is None:
            message = f"frame of {size} bytes exceeds the limit of {limit} bytes"
        super().__init__(message)
        self.size = size
        self.limit = limit


class ConnectionClosed(IPCError, ConnectionError):
    """The peer closed the connection (EOF, also in the middle of a frame) or it broke."""


class AuthError(IPCError):
    """The handshake's token was missing or wrong."""


class VersionError(IPCError):
    """The peers speak different protocol versions."""


class RemoteError(IPCError):
    """An unexpected error inside the engine process (``ErrorKind.INTERNAL``)."""


class ErrorKind(enum.IntEnum):
    """What went wrong; travels as its integer value (see ``ipc.messages.Error``)."""

    BAD_REQUEST = 1         # invalid params/prompt/request id
    DRAINING = 2            # not accepting new requests; retry_after
    SHUTDOWN = 3            # the engine has shut down
    DEAD = 4                # the engine failed
    INVALID_TRANSITION = 5  # e.g. Drain while already shut down
    PROTOCOL = 6            # undecodable/invalid/unexpected frame
    AUTH = 7                # missing or wrong token
    VERSION = 8             # protocol version mismatch
    TOO_LARGE = 9           # frame length header above max_frame
    INTERNAL = 10           # unexpected error in the engine process
    OVERLOADED = 11         # admission limits reached; retry_after
    SLEEPING = 12           # asleep (sleep mode): not accepting until woken; retry_after
    PAUSED = 13             # paused, refusing new requests (reject_while_paused); retry_after


class ErrorSpec(NamedTuple):
    """How one exception class travels and is answered: its wire kind, and the HTTP status,
    OpenAI error ``type`` and ``code`` a frontend answers it with."""

    exc: type
    kind: ErrorKind
    http_status: int
    openai_type: str
    openai_code: Optional[str]

    @property
    def retryable(self) -> bool:
        return self.kind in (ErrorKind.DRAINING, ErrorKind.OVERLOADED, ErrorKind.SLEEPING)


#: The one table every mapper reads (wire <-> exception, exception -> HTTP). Order matters:
#: subclasses before their bases; the first row of a kind is the class a client raises for it.
ERROR_TABLE: tuple[ErrorSpec, ...] = (
    ErrorSpec(FrameTooLargeError, ErrorKind.TOO_LARGE, 413, "invalid_request_error", "request_too_large"),
    ErrorSpec(ProtocolError, ErrorKind.PROTOCOL, 400, "invalid_request_error", "protocol_error"),
    ErrorSpec(AuthError, ErrorKind.AUTH, 401, "authentication_error", "invalid_api_key"),
    ErrorSpec(VersionError, ErrorKind.VERSION, 400, "invalid_request_error", "version_mismatch"),
    ErrorSpec(EngineOverloadedError, ErrorKind.OVERLOADED, 429, "rate_limit_error", "engine_overloaded"),
    ErrorSpec(EngineDrainingError, ErrorKind.DRAINING, 503, "service_unavailable", "engine_draining"),
    ErrorSpec(EngineSleepingError, ErrorKind.SLEEPING, 503, "service_unavailable", "engine_sleeping"),
    ErrorSpec(EnginePausedError, ErrorKind.PAUSED, 503, "service_unavailable", "engine_paused"),
    ErrorSpec(EngineShutdownError, ErrorKind.SHUTDOWN, 503, "service_unavailable", "engine_shutdown"),
    ErrorSpec(EngineDeadError, ErrorKind.DEAD, 503, "service_unavailable", "engine_dead"),
    ErrorSpec(ConnectionClosed, ErrorKind.DEAD, 503, "service_unavailable", "engine_dead"),
    ErrorSpec(BadRequestError, ErrorKind.BAD_REQUEST, 400, "invalid_request_error", None),
    # update_weights to a checkpoint the engine refuses (a client raises BadRequestError for it)
    ErrorSpec(CheckpointError, ErrorKind.BAD_REQUEST, 400, "invalid_request_error", "bad_checkpoint"),
    ErrorSpec(InvalidTransitionError, ErrorKind.INVALID_TRANSITION, 409, "invalid_request_error",
              "invalid_state"),
    ErrorSpec(RemoteError, ErrorKind.INTERNAL, 500, "server_error", "internal_error"),
    ErrorSpec(BaseException, ErrorKind.INTERNAL, 500, "server_error", "internal_error"),
)
_BY_KIND = {}
for _spec in ERROR_TABLE:
    _BY_KIND.setdefault(_spec.kind, _spec)
del _spec


def spec_of(exc: BaseException) -> ErrorSpec:
    """The table's row for ``exc`` (its most specific class)."""
    for spec in ERROR_TABLE:
        if isinstance(exc, spec.exc):
            return spec
    raise AssertionError("unreachable: the table ends with BaseException")  # pragma: no cover


def spec_of_kind(kind: ErrorKind) -> ErrorSpec:
    """The table's first row of ``kind``: the class a client raises for it."""
    return _BY_KIND[kind]


__all__ = [
    "ErrorKind", "ErrorSpec", "ERROR_TABLE", "spec_of", "spec_of_kind",
    "IPCError", "ProtocolError", "FrameTooLargeError", "ConnectionClosed", "AuthError",
    "VersionError", "RemoteError",
]
