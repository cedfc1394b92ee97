"""Length-prefixed msgpack frames: a 4-byte big-endian body length, then the body.

:class:`FrameCodec` holds one reused ``msgspec.msgpack.Encoder``, one typed ``Decoder`` and one
reused output buffer per connection. :func:`read_frame` checks a frame's length header against
the limit *before* reading its body (msgspec has no size limit of its own). Every way a body can
fail to decode is reported as one type, :class:`~ipc.errors.ProtocolError`; every way the stream
can end as :class:`~ipc.errors.ConnectionClosed`.
"""

from __future__ import annotations

import struct
from typing import Any, Iterable

import anyio
import msgspec
from anyio.abc import ByteSendStream
from anyio.streams.buffered import BufferedByteReceiveStream

from .errors import ConnectionClosed, FrameTooLargeError, ProtocolError
from .messages import DEFAULT_MAX_FRAME, Message

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size  # 4
#: Largest length a header can express; max_frame may not exceed it.
MAX_HEADER_VALUE = 2**32 - 1

# A reused encode buffer that grew past this is dropped after use, so one huge message does not
# pin its memory for the connection's lifetime.
_KEEP_BUFFER = 1024 * 1024

_STREAM_ENDED = (
    anyio.IncompleteRead,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)


class FrameCodec:
    """Encodes messages into frames and decodes frame bodies, for one connection.

    ``incoming`` is the type the decoder accepts: :data:`~ipc.messages.Message` (default), or
    ``ClientMessage`` on the engine side / ``EngineMessage`` on the client side, so a message
    sent in the wrong direction is a :class:`ProtocolError` too.

    Not for concurrent use from several threads; within one event loop it is safe, since
    :meth:`encode` and :meth:`decode` never await.
    """

    __slots__ = ("_encoder", "_decoder", "_buf", "max_frame")

    def __init__(self, incoming: Any = Message, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if not 1 <= max_frame <= MAX_HEADER_VALUE:
            raise ValueError(f"max_frame must be in [1, {MAX_HEADER_VALUE}], got {max_frame}")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._buf = bytearray(4096)
        self.max_frame = max_frame

    # ---------------------------------------------------------------- encoding

    def _encode_at(self, msg: Any, start: int) -> None:
        buf = self._buf
        self._encoder.encode_into(msg, buf, start + HEADER_SIZE)  # resizes buf to fit exactly
        size = len(buf) - start - HEADER_SIZE
        if size > self.max_frame:
            del buf[start:]
            raise FrameTooLargeError(size, self.max_frame)
        HEADER.pack_into(buf, start, size)

    def _take(self, end: int) -> bytes:
        out = bytes(memoryview(self._buf)[:end])
        if len(self._buf) > _KEEP_BUFFER:
            self._buf = bytearray(4096)
        return out

    def encode(self, msg: Any) -> bytes:
        """One frame (header + body). Raises :class:`FrameTooLargeError` above ``max_frame``."""
        self._encode_at(msg, 0)
        return self._take(len(self._buf))

    def encode_many(self, msgs: Iterable[Any]) -> bytes:
        """Several frames back to back in one buffer (one ``send`` for all of them)."""
        end = 0
        for msg in msgs:
            self._encode_at(msg, end)
            end = len(self._buf)
        return self._take(end)

    def encode_body(self, msg: Any) -> bytes:
        """Just the msgpack body, without the header (for tests and tools)."""
        return self._encoder.encode(msg)

    # ---------------------------------------------------------------- decoding

    def decode(self, body: bytes | bytearray | memoryview) -> Any:
        """Decode one frame body; any failure is a :class:`ProtocolError`."""
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"invalid message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"malformed message: {exc}") from None
        except RecursionError:
            raise ProtocolError("message nested too deeply") from None
        except Exception as exc:  # MemoryError, errors raised by a Struct's __post_init__, ...
            raise ProtocolError(f"undecodable message: {type(exc).__name__}: {exc}") from None

    # ---------------------------------------------------------------- stream helpers

    async def read(self, stream: BufferedByteReceiveStream, max_frame: int | None = None) -> Any:
        """Read and decode one message (see :func:`read_frame`)."""
        body = await read_frame(stream, self.max_frame if max_frame is None else max_frame)
        return self.decode(body)

    async def write(self, stream: ByteSendStream, msg: Any) -> None:
        """Encode and send one message (see :func:`write_frame`)."""
        await write_frame(stream, self, msg)


async def read_frame(stream: BufferedByteReceiveStream, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Read one frame's body from ``stream``.

    The length header is checked before any of the body is read: 0 raises
    :class:`ProtocolError`, more than ``max_frame`` raises :class:`FrameTooLargeError`. EOF
    (also in the middle of a frame), a reset or a closed stream raise :class:`ConnectionClosed`.
    """
    try:
        header = await stream.receive_exactly(HEADER_SIZE)
    except _STREAM_ENDED as exc:
        raise ConnectionClosed(f"connection closed ({type(exc).__name__})") from None
    (size,) = HEADER.unpack(header)
    if size == 0:
        raise ProtocolError("empty frame (length 0)")
    if size > max_frame:
        raise FrameTooLargeError(size, max_frame)
    try:
        return await stream.receive_exactly(size)
    except _STREAM_ENDED as exc:
        raise ConnectionClosed(
            f"connection closed in the middle of a {size}-byte frame ({type(exc).__name__})"
        ) from None


async def write_frame(stream: ByteSendStream, codec: FrameCodec, msg: Any) -> None:
    """Encode ``msg`` with ``codec`` and send it; a broken stream raises :class:`ConnectionClosed`."""
    frame = codec.encode(msg)
    try:
        await stream.send(frame)
    except _STREAM_ENDED as exc:
        raise ConnectionClosed(f"connection closed ({type(exc).__name__})") from None


__all__ = [
    "FrameCodec", "read_frame", "write_frame", "HEADER", "HEADER_SIZE",
    "ProtocolError", "FrameTooLargeError", "ConnectionClosed",
]
