"""The engine's IPC layer: msgpack frames over a Unix socket or TCP. See :mod:`ipc.messages`."""

from .errors import (
    AuthError,
    ConnectionClosed,
    FrameTooLargeError,
    IPCError,
    ProtocolError,
    RemoteError,
    VersionError,
)
from .framing import FrameCodec, FrameReader, FrameWriter
from .messages import (
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    ErrorKind,
)
from .wire_errors import error_to_message, message_to_error
from .transport import connect, open_listener, parse_address, preflight_listen, remove_socket
from .client import ConnState, EngineClient
from .streams import RemoteStream
from .spawn import EngineProcess, EngineStartupError
from .sync_client import SyncEngineClient

__all__ = [
    "IPCError", "ProtocolError", "FrameTooLargeError", "ConnectionClosed", "AuthError",
    "VersionError", "RemoteError", "FrameCodec", "FrameReader", "FrameWriter", "PROTOCOL_VERSION",
    "DEFAULT_MAX_FRAME", "ErrorKind", "error_to_message", "message_to_error", "connect",
    "open_listener", "parse_address", "preflight_listen", "remove_socket", "EngineClient", "ConnState", "RemoteStream",
    "SyncEngineClient", "EngineProcess", "EngineStartupError",
]
