"""Errors of the IPC layer itself (framing, handshake, transport).

They subclass :class:`engine.errors.EngineError`, so a caller that catches the engine's errors
also catches a broken connection. ``ipc.messages.ErrorKind`` maps each class to a wire code.
"""

from __future__ import annotations

from engine.errors import EngineError


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


__all__ = [
    "IPCError", "ProtocolError", "FrameTooLargeError", "ConnectionClosed", "AuthError",
    "VersionError", "RemoteError",
]
