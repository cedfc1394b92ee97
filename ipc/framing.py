"""Length-prefixed msgpack frames (a 4-byte big-endian body length, then the body), read and
written the same way by the client, the server and both sides of the handshake.

* :class:`FrameCodec` holds one reused ``msgspec.msgpack.Encoder``, one typed ``Decoder`` and one
  reused output buffer.
* :class:`FrameReader` reads a stream in large chunks into one buffer and decodes every complete
  frame in it before it awaits the stream again. A frame's length header is checked against the
  limit as soon as its 4 bytes are in (msgspec has no size limit of its own): nobody waits for
  the body of an oversize frame. Every way a body can fail to decode is one type,
  :class:`~ipc.errors.ProtocolError`; every way the stream can end is
  :class:`~ipc.errors.ConnectionClosed`.
* :class:`FrameWriter` owns a stream's write side: items are queued without blocking and one task
  sends everything queued since its last send in one ``send``.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Iterable, Optional

import anyio
import msgspec
from anyio.abc import ByteReceiveStream, ByteSendStream

from .errors import ConnectionClosed, FrameTooLargeError, ProtocolError
from .messages import DEFAULT_MAX_FRAME, Message

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size  # 4
#: Largest length a header can express; max_frame may not exceed it.
MAX_HEADER_VALUE = 2**32 - 1
#: How much one ``receive`` asks for.
RECEIVE_CHUNK = 1 << 20

# A reused encode buffer that grew past this is dropped after use, so one huge message does not
# pin its memory for the connection's lifetime.
_KEEP_BUFFER = 1024 * 1024

#: What a stream that ended or broke raises (anyio's and the OS's ways).
STREAM_ENDED = (
    anyio.IncompleteRead,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)


def _check_max_frame(max_frame: int) -> int:
    if not 1 <= max_frame <= MAX_HEADER_VALUE:
        raise ValueError(f"max_frame must be in [1, {MAX_HEADER_VALUE}], got {max_frame}")
    return max_frame


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
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._buf = bytearray(4096)
        self.max_frame = _check_max_frame(max_frame)

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


class FrameReader:
    """Decoded messages from a byte stream, through one buffer.

    :meth:`read` returns the next message (the handshake, the server's reader); :meth:`run`
    hands every message to a synchronous ``dispatch`` and never returns normally (the client's
    hot path: a whole burst of frames is decoded and dispatched without a task switch).
    ``max_frame`` may be changed between reads (the handshake's limit is smaller).
    """

    __slots__ = ("_stream", "_decode", "_buf", "_pos", "max_frame")

    def __init__(self, stream: ByteReceiveStream, codec: FrameCodec, *,
                 max_frame: Optional[int] = None) -> None:
        self._stream = stream
        self._decode = codec.decode
        self._buf = bytearray()
        self._pos = 0  # start of the first frame not yet decoded
        self.max_frame = _check_max_frame(codec.max_frame if max_frame is None else max_frame)

    def _frame_end(self, pos: int) -> int:
        """End of the complete frame at ``pos``, or -1 if it is not all in the buffer yet.
        A bad length header raises as soon as the header is in."""
        buf = self._buf
        if len(buf) - pos < HEADER_SIZE:
            return -1
        (size,) = HEADER.unpack_from(buf, pos)
        if size == 0:
            raise ProtocolError("empty frame (length 0)")
        if size > self.max_frame:
            raise FrameTooLargeError(size, self.max_frame)
        end = pos + HEADER_SIZE + size
        return end if end <= len(buf) else -1

    @property
    def pending(self) -> int:
        """Bytes buffered that are not a complete frame yet (after the last one read)."""
        return len(self._buf) - self._pos

    async def _fill(self) -> None:
        buf = self._buf
        if self._pos:
            del buf[:self._pos]
            self._pos = 0
        try:
            chunk = await self._stream.receive(RECEIVE_CHUNK)
        except STREAM_ENDED as exc:
            where = f" in the middle of a frame ({len(buf)} bytes buffered)" if buf else ""
            raise ConnectionClosed(f"connection closed{where} ({type(exc).__name__})") from exc
        buf += chunk

    async def read(self) -> Any:
        """The next message. Raises :class:`ProtocolError` (incl. :class:`FrameTooLargeError`)
        or :class:`ConnectionClosed`."""
        while (end := self._frame_end(self._pos)) < 0:
            await self._fill()
        start, self._pos = self._pos + HEADER_SIZE, end
        with memoryview(self._buf) as view:
            return self._decode(view[start:end])

    async def run(self, dispatch: Callable[[Any], None]) -> None:
        """Decode and ``dispatch`` messages until the stream ends (:class:`ConnectionClosed`) or
        a frame is bad (:class:`ProtocolError`); every complete frame in the buffer is
        dispatched before the stream is awaited again."""
        decode, frame_end, buf = self._decode, self._frame_end, self._buf
        while True:
            pos = self._pos
            end = frame_end(pos)
            if end >= 0:
                with memoryview(buf) as view:
                    while end >= 0:
                        msg = decode(view[pos + HEADER_SIZE:end])
                        self._pos = pos = end
                        dispatch(msg)
                        end = frame_end(pos)
            await self._fill()


def join_frames(frames: list) -> bytes:
    """:class:`FrameWriter`'s encoder for items that are already frames."""
    return frames[0] if len(frames) == 1 else b"".join(frames)


class FrameWriter:
    """The write side of one stream: :meth:`put` queues an item (never blocks); :meth:`run`,
    the one task that sends, turns everything queued since its last send into bytes with
    ``encode`` and sends them in one ``send``, each within ``send_timeout`` seconds (None: no
    limit; ``TimeoutError`` when exceeded). Stream errors propagate as the stream raises them.
    """

    __slots__ = ("items", "_stream", "_encode", "_wake", "send_timeout")

    def __init__(self, stream: ByteSendStream, encode: Callable[[list], bytes] = join_frames, *,
                 send_timeout: Optional[float] = None) -> None:
        self.items: list = []
        self._stream = stream
        self._encode = encode
        self._wake = anyio.Event()
        self.send_timeout = send_timeout

    def put(self, item: Any) -> None:
        self.items.append(item)
        self._wake.set()

    def wake(self) -> None:
        """Make :meth:`run` look at its ``done`` condition again."""
        self._wake.set()

    async def run(self, done: Callable[[], bool]) -> None:
        """Send until the queue is empty and ``done()`` is true."""
        send, encode, timeout = self._stream.send, self._encode, self.send_timeout
        while True:
            if not self.items:
                if done():
                    return
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            items, self.items = self.items, []
            data = encode(items)
            if timeout is None:
                await send(data)
            else:
                with anyio.fail_after(timeout):
                    await send(data)


__all__ = [
    "FrameCodec", "FrameReader", "FrameWriter", "join_frames", "HEADER", "HEADER_SIZE",
    "RECEIVE_CHUNK", "STREAM_ENDED", "ProtocolError", "FrameTooLargeError", "ConnectionClosed",
]
