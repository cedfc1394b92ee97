"""One client connection of the IPC server: its outbox of messages and outputs, the sink the
engine delivers a request's outputs through, the sender that frames and writes them, and the
reader that decodes the client's frames and hands them to a dispatch function.

It knows nothing of the server: what it needs comes in as parameters (limits, the reader, a
callback that aborts an engine request, the dispatch function).
"""

from __future__ import annotations

import enum
import itertools
import logging
from typing import Any, Awaitable, Callable, Optional

import anyio
import msgspec
from anyio.abc import ByteStream

from engine.params import RequestOutput

from .errors import ConnectionClosed, FrameTooLargeError, ProtocolError
from .framing import FrameCodec, FrameReader, FrameWriter
from .messages import Outputs
from .wire_errors import error_to_message

log = logging.getLogger("enginecore.ipc")

_replace = msgspec.structs.replace
#: What a broken or closed client stream raises.
STREAM_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError,
                 ConnectionClosed)


class LinkState(enum.Enum):
    """Where a connection is; every change goes through :meth:`Connection._set`."""

    OPEN = "open"        # reading and sending
    CLOSING = "closing"  # the engine stopped: flush everything (incl. replies of running calls), close
    FAILING = "failing"  # a fatal Error is queued: flush what is queued, close; nothing more is queued
    CLOSED = "closed"    # cut or gone (outbox overflow, peer gone): nothing is queued or sent


class Connection:
    """One client: its outbox, its in-flight requests, its sender and reader.

    ``abort_request(engine_rid, reason)`` aborts an engine request from synchronous code (used
    when one of its outputs cannot be framed).
    """

    def __init__(self, stream: ByteStream, cid: int, codec: FrameCodec, reader: FrameReader, *,
                 peer: str = "", send_timeout: float = 30.0, max_outbox: int = 1 << 16,
                 abort_request: Callable[[str, str], None]) -> None:
        self.stream = stream
        self.id = cid
        self.peer = peer
        self.name = ""
        self.codec = codec
        self.reader = reader
        self.writer = FrameWriter(stream, self._encode, send_timeout=send_timeout)
        self.max_outbox = max_outbox
        self.abort_request = abort_request
        self.state = LinkState.OPEN
        self.inflight: dict[str, str] = {}  # client request id -> engine request id
        self.pending_calls = 0  # drain/shutdown calls still running (their replies are awaited)
        self.seq = itertools.count()
        self.scope: Optional[anyio.CancelScope] = None

    def _set(self, state: LinkState) -> None:
        self.state = state
        if state is LinkState.CLOSED:
            self.writer.items.clear()
            if self.scope is not None:
                self.scope.cancel()
        self.writer.wake()

    # ------------------------------------------------------------------ queueing (sync)

    def push(self, item: Any) -> None:
        """Queue a message or a RequestOutput for the sender (never blocks)."""
        if self.state is LinkState.FAILING or self.state is LinkState.CLOSED:
            return
        self.writer.put(item)
        if len(self.writer.items) > self.max_outbox:
            log.warning("ipc client %d (%s): outbox over %d items (not reading?); closing",
                        self.id, self.peer, self.max_outbox)
            self._set(LinkState.CLOSED)

    def fail(self, exc: BaseException, **kw: Any) -> None:
        """Queue a fatal Error for ``exc``, then close after flushing."""
        self.push(error_to_message(exc, fatal=True, **kw))
        if self.state is not LinkState.CLOSED:
            self._set(LinkState.FAILING)

    def close(self) -> None:
        """Graceful close: flush everything, including replies of running calls."""
        if self.state is LinkState.OPEN:
            self._set(LinkState.CLOSING)

    def gone(self) -> None:
        """The connection is over: nothing more is queued."""
        self._set(LinkState.CLOSED)

    def call_started(self) -> None:
        self.pending_calls += 1

    def call_done(self) -> None:
        self.pending_calls -= 1
        self.writer.wake()

    def make_sink(self, rid: str, erid: str) -> Callable[[Any], None]:
        inflight = self.inflight
        push = self.push

        def sink(item) -> None:
            if inflight.get(rid) != erid:
                return  # already ended for the client (e.g. its output could not be framed)
            if isinstance(item, RequestOutput):
                if item.finished:
                    inflight.pop(rid, None)
                push(_replace(item, request_id=rid))
            else:  # an exception: the request is over (e.g. EngineDeadError)
                inflight.pop(rid, None)
                push(error_to_message(item, request_id=rid, fatal=False))

        return sink

    # ------------------------------------------------------------------ sending

    def _encode(self, items: list) -> bytes:
        """Frames for ``items``: runs of consecutive outputs become one Outputs frame each."""
        msgs: list = []
        run: list = []
        for item in items:
            if type(item) is RequestOutput:
                run.append(item)
                continue
            if run:
                msgs.append(Outputs(outputs=run))
                run = []
            msgs.append(item)
        if run:
            msgs.append(Outputs(outputs=run))
        try:
            return self.codec.encode_many(msgs)
        except FrameTooLargeError:
            return b"".join(self._encode_one(m) for m in msgs)

    def _encode_one(self, msg: Any) -> bytes:
        try:
            return self.codec.encode(msg)
        except FrameTooLargeError as exc:
            if isinstance(msg, Outputs) and len(msg.outputs) > 1:
                half = len(msg.outputs) // 2
                return (self._encode_one(Outputs(outputs=msg.outputs[:half]))
                        + self._encode_one(Outputs(outputs=msg.outputs[half:])))
            if isinstance(msg, Outputs):  # one output alone exceeds the frame limit
                out = msg.outputs[0]
                log.error("ipc client %d: output of %r exceeds max_frame", self.id, out.request_id)
                erid = self.inflight.pop(out.request_id, None)
                if erid is not None:
                    self.abort_request(erid, "output exceeds the frame limit")
                return self.codec.encode(error_to_message(exc, request_id=out.request_id, fatal=False))
            raise

    def _sent_all(self) -> bool:
        st = self.state
        return (st is LinkState.FAILING or st is LinkState.CLOSED
                or (st is LinkState.CLOSING and self.pending_calls == 0))

    async def sender(self) -> None:
        """Send until the connection is done (``TimeoutError``: the peer stopped reading)."""
        await self.writer.run(self._sent_all)

    async def serve(self, dispatch: Callable[["Connection", Any], Awaitable[None]],
                    send_timeout: float) -> None:
        """The connection's sender and reader, until either ends (``send_timeout``: how long a
        peer that stops reading is given, for the log line)."""
        async with anyio.create_task_group() as tg:
            self.scope = tg.cancel_scope

            async def send_all() -> None:
                try:
                    await self.sender()
                except TimeoutError:
                    log.warning("ipc client %d (%s): not reading for %.0fs; closing", self.id,
                                self.peer, send_timeout)
                except STREAM_ERRORS:
                    pass
                tg.cancel_scope.cancel()

            async def read_all() -> None:
                try:
                    await self.reader_loop(dispatch)
                except STREAM_ERRORS:
                    tg.cancel_scope.cancel()  # the peer is gone: nobody to flush to

            tg.start_soon(send_all)
            tg.start_soon(read_all)

    # ------------------------------------------------------------------ reading

    async def reader_loop(self, dispatch: Callable[["Connection", Any], Awaitable[None]]) -> None:
        """Read and ``dispatch`` the client's messages while the connection is open; a bad frame
        fails the connection; a stream that ends raises :class:`ConnectionClosed`."""
        read = self.reader.read
        while self.state is LinkState.OPEN:
            try:
                msg = await read()
            except ProtocolError as exc:  # incl. FrameTooLargeError
                log.info("ipc client %d (%s): %s; closing", self.id, self.peer, exc)
                self.fail(exc)
                return
            try:
                await dispatch(self, msg)
            except Exception as exc:  # a bug of ours: report it, keep the connection
                log.exception("ipc client %d: error handling %s", self.id, type(msg).__name__)
                self.push(error_to_message(exc, call_id=getattr(msg, "call_id", None),
                                           request_id=getattr(msg, "request_id", None), fatal=False))


__all__ = ["Connection", "LinkState", "STREAM_ERRORS"]
