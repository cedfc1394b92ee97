"""One client connection of the IPC server: its outbox of messages and outputs, the sink the
engine delivers a request's outputs through, the sender task that frames and writes them, and
the reader task that decodes the client's frames and hands them to the server."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

import anyio
import msgspec
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from engine.params import RequestOutput

from .errors import ConnectionClosed, FrameTooLargeError, ProtocolError
from .framing import FrameCodec, read_frame
from .messages import ClientMessage, Outputs, error_to_message

if TYPE_CHECKING:  # pragma: no cover
    from .server import IPCServer

log = logging.getLogger("enginecore.ipc")

_replace = msgspec.structs.replace
#: What a broken or closed client stream raises.
STREAM_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError,
                 ConnectionClosed)


class Connection:
    """One client: its outbox, its in-flight requests and its sender."""

    def __init__(self, server: "IPCServer", stream: ByteStream, cid: int) -> None:
        self.server = server
        self.stream = stream
        self.id = cid
        self.name = ""
        self.codec = FrameCodec(ClientMessage, max_frame=server.max_frame)
        self.outbox: deque = deque()
        self.inflight: dict[str, str] = {}  # client request id -> engine request id
        self.accepting = True   # False after a fatal error: nothing more is queued
        self.closing = False    # flush, wait for pending calls, then close
        self.fatal = False      # flush what is queued now, then close
        self.pending_calls = 0  # drain/shutdown calls still running
        self.overflow = False
        self._wake = anyio.Event()
        self._seq = itertools.count()
        self.scope: Optional[anyio.CancelScope] = None
        self.buffered = BufferedByteReceiveStream(stream)

    # ------------------------------------------------------------------ queueing (sync)

    def push(self, item: Any) -> None:
        """Queue a message or a RequestOutput for the sender (never blocks)."""
        if not self.accepting:
            return
        self.outbox.append(item)
        if len(self.outbox) > self.server.max_outbox and not self.overflow:
            self.overflow = True
            log.warning("ipc client %d: outbox over %d items (not reading?); closing",
                        self.id, self.server.max_outbox)
            self.accepting = False
            if self.scope is not None:
                self.scope.cancel()
        self._wake.set()

    def fail(self, exc: BaseException, **kw: Any) -> None:
        """Queue a fatal Error for ``exc``, then close after flushing."""
        self.push(error_to_message(exc, fatal=True, **kw))
        self.accepting = False
        self.fatal = True
        self._wake.set()

    def close(self) -> None:
        """Graceful close: flush everything, including replies of running calls."""
        self.closing = True
        self._wake.set()

    def make_sink(self, rid: str, erid: str):
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
                    self.server.engine_abort(erid, "output exceeds the frame limit")
                return self.codec.encode(error_to_message(exc, request_id=out.request_id, fatal=False))
            raise

    async def sender(self) -> None:
        stream, timeout = self.stream, self.server.send_timeout
        while True:
            if not self.outbox:
                if self.fatal or (self.closing and self.pending_calls == 0):
                    return
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            items = list(self.outbox)
            self.outbox.clear()
            data = self._encode(items)
            with anyio.fail_after(timeout):
                await stream.send(data)

    # ------------------------------------------------------------------ reading

    async def reader(self) -> None:
        buffered = self.buffered
        max_frame = self.server.max_frame
        while self.accepting and not self.closing:
            try:
                body = await read_frame(buffered, max_frame)
                msg = self.codec.decode(body)
            except ConnectionClosed:
                raise
            except ProtocolError as exc:  # incl. FrameTooLargeError
                log.info("ipc client %d: %s; closing", self.id, exc)
                self.fail(exc)
                return
            try:
                await self.server.dispatch(self, msg)
            except Exception as exc:  # a bug of ours: report it, keep the connection
                log.exception("ipc client %d: error handling %s", self.id, type(msg).__name__)
                self.push(error_to_message(exc, call_id=getattr(msg, "call_id", None),
                                           request_id=getattr(msg, "request_id", None), fatal=False))
