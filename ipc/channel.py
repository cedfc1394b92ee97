"""The client's connection to an engine: its reader and writer tasks, the dispatch of the
engine's frames, the pending calls, and how the connection ended -- one :class:`ConnState`,
decided in one place (:meth:`ClientChannel._end`). :class:`ipc.client.EngineClient` is the
Engine API on top of it.

* The reader (:meth:`ipc.framing.FrameReader.run`) decodes every complete frame in its buffer
  before it awaits the socket again; an ``Outputs`` frame (one engine step) is dispatched in one
  synchronous loop into the requests' mailboxes -- no task switch, send or await per piece.
* The writer (:class:`ipc.framing.FrameWriter`) sends everything queued meanwhile in one ``send``.
* The end: closed by us (calls raise ``ConnectionClosed``), the engine shut down
  (``EngineShutdownError``), or dead -- EOF or reset without a clean shutdown, e.g. the engine
  process was killed (``EngineDeadError``, with a spawned engine's exit code).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
import enum
import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional
import uuid

import anyio

from engine.errors import EngineDeadError, EngineShutdownError
from engine.serving.mailbox import Mailbox
from states import State

from .calls import Calls, death_message
from .errors import ConnectionClosed, ProtocolError
from .framing import STREAM_ENDED, FrameWriter
from .control import ControlReply
from .messages import Abort, Ack, Error, Health, Outputs, StateChanged, Tokens, Welcome
from .requests import GenerateEncoder, RequestTable
from .streams import thread_caller
from .wire_errors import message_to_error

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from .spawn import EngineProcess

log = logging.getLogger("enginecore.ipc.client")

#: After the connection ends, how long to wait for a spawned engine's exit code.
_EXIT_CODE_GRACE = 0.3
_CLEAN_END = (anyio.EndOfStream, anyio.ClosedResourceError)


class ConnState(enum.Enum):
    """How far the connection got: open, or how it ended."""

    OPEN = "open"
    CLOSED_BY_USER = "closed"  # our context exited first
    SHUTDOWN = "shutdown"      # the engine shut down cleanly, then closed the connection
    DEAD = "dead"              # lost without a clean shutdown (killed, failed, protocol error)


class ClientChannel:
    """One connection to an engine, after its handshake (see the module docstring)."""

    def __init__(self, stream: Any, welcome: Welcome, codec: Any, reader: Any) -> None:
        self.welcome = welcome
        self._stream = stream
        self._state: State = welcome.state
        self._codec = codec
        self._reader = reader
        self._writer = FrameWriter(stream)
        self._generate_frames = GenerateEncoder(codec, welcome.vocab_size)
        self._requests = RequestTable()
        self._calls = Calls()
        self._rid_prefix = uuid.uuid4().hex[:8] + "-"
        self._rids = itertools.count(1)
        self._loop_thread = threading.get_ident()
        self._call_soon_threadsafe = thread_caller()
        self._listeners: list[Callable[[State, State], None]] = []
        self._stopped = anyio.Event()
        self.conn = ConnState.OPEN
        #: Why the engine (or the connection to it) died: None unless it did.
        self.failure: Optional[BaseException] = None
        self._cause: Optional[BaseException] = None  # what ended the connection, if it broke
        self._death_reason = ""  # for DEAD: "engine failed" or "lost the connection ..."
        self.process: Optional["EngineProcess"] = None  # set by spawn()
        self._token_bytes: Optional[list[bytes]] = None  # EngineClient.token_bytes, once asked
        self._vocab_lock: Optional[anyio.Lock] = None  # one token_bytes call in flight

    # ------------------------------------------------------------------ opening

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        error: Optional[BaseException] = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read)
                tg.start_soon(self._write)
                try:
                    yield
                except GeneratorExit:  # pragma: no cover - the context was garbage collected
                    raise
                except BaseException as exc:  # re-raised below, not wrapped in a group
                    error = exc
                finally:
                    self._end(self._how_ended(by_user=True), None)
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.aclose_forcefully(self._stream)
        if error is not None:
            try:
                raise error
            finally:
                del error


    def _abandon(self, rid: str, ch: Mailbox) -> None:
        """The iterator of ``rid`` went away: abort the request (callable from any thread)."""
        if threading.get_ident() != self._loop_thread:
            try:
                self._call_soon_threadsafe(lambda: self._abandon(rid, ch))
            except RuntimeError:  # the loop is closed: so is the connection
                pass
            return
        if self._requests.abandon(rid, ch) and self.conn is ConnState.OPEN:
            self._writer.put(self._codec.encode(Abort(request_id=rid)))

    async def _call(self, kind: str, make: Callable[[int], Any]) -> Any:
        if self.conn is not ConnState.OPEN:
            raise self._closed_error()
        cid, call = self._calls.open(kind)
        self._writer.put(self._codec.encode(make(cid)))
        return await self._calls.wait(cid, call)

    def _set_state(self, new: State) -> None:
        old, self._state = self._state, new
        if new is not old:
            for listener in list(self._listeners):
                listener(old, new)
        if new is State.SHUTDOWN:
            self._stopped.set()

    # ------------------------------------------------------------------ internals: the wire

    async def _write(self) -> None:
        try:
            await self._writer.run(lambda: self.conn is not ConnState.OPEN)
        except STREAM_ENDED as exc:
            await self._lose(exc)
        except Exception as exc:  # pragma: no cover - a bug of ours
            log.exception("ipc client: writer failed")
            await self._lose(exc)

    async def _read(self) -> None:
        cause: Optional[BaseException] = None
        try:
            await self._reader.run(self._dispatch)
        except ConnectionClosed as exc:  # a clean EOF has no cause; a reset or a cut frame has
            if self._reader.pending or not isinstance(exc.__cause__, _CLEAN_END):
                cause = exc
        except ProtocolError as exc:  # the engine sent something we cannot read
            log.error("ipc client: %s; closing the connection", exc)
            cause = exc
        except Exception as exc:  # pragma: no cover - a bug of ours
            log.exception("ipc client: reader failed")
            cause = exc
        await self._lose(cause)

    def _dispatch(self, msg: Any) -> None:
        t = type(msg)
        if t is Outputs:
            self._requests.deliver(msg.outputs)
        elif t is Error:
            self._on_error(msg)
        elif t is StateChanged:
            if msg.state is State.FAILED and self.failure is None:
                self.failure = EngineDeadError("engine failed")
            if self.failure is None or msg.state is State.FAILED:
                self._set_state(msg.state)
        elif t is Health or t is Ack or t is Tokens or t is ControlReply:
            if t is Ack and msg.state is not None and self.failure is None:
                self._set_state(msg.state)
            self._calls.answer(msg.call_id, msg)
        else:  # a second Welcome
            raise ProtocolError(f"unexpected {t.__name__} from the engine")

    def _on_error(self, msg: Error) -> None:
        if self._calls.fail(msg.call_id, message_to_error(msg)) or self._requests.fail(
                msg.request_id, lambda: message_to_error(msg)):
            return
        if msg.fatal:
            self._cause = message_to_error(msg)
            log.error("ipc client: the engine closes the connection: %s", self._cause)
        else:
            log.warning("ipc client: engine error %s: %s", msg.kind.name, msg.message)

    # ------------------------------------------------------------------ internals: the end

    def _how_ended(self, by_user: bool) -> ConnState:
        if self.failure is not None:
            return ConnState.DEAD
        if self._state is State.SHUTDOWN:
            return ConnState.SHUTDOWN
        return ConnState.CLOSED_BY_USER if by_user else ConnState.DEAD

    async def _lose(self, cause: Optional[BaseException]) -> None:
        """The connection ended by itself (EOF, reset, bad frame)."""
        if self.conn is not ConnState.OPEN:
            return
        proc = self.process
        if proc is not None and proc.poll() is None and self._how_ended(False) is ConnState.DEAD:
            # The socket closes while the process exits; its exit code follows in a moment.
            with anyio.move_on_after(_EXIT_CODE_GRACE):
                while proc.poll() is None and self.conn is ConnState.OPEN:
                    await anyio.sleep(0.01)
        self._end(self._how_ended(False), cause)

    def _end(self, how: ConnState, cause: Optional[BaseException]) -> None:
        """The one place the connection's end is decided: fail every pending and later call."""
        if self.conn is not ConnState.OPEN:
            return
        self.conn = how
        if cause is not None and self._cause is None:
            self._cause = cause
        if how is ConnState.DEAD:
            self._death_reason = ("engine failed" if self._state is State.FAILED
                                  else "lost the connection to the engine")
            if self.failure is None:
                self.failure = EngineDeadError(self._death_message())
            self._set_state(State.FAILED)
        self._stopped.set()
        self._writer.items.clear()
        self._writer.wake()
        self._requests.fail_all(self._closed_error)
        # A drain/shutdown whose Ack was lost with the socket did what it was asked.
        self._calls.end(self._closed_error, done_kinds=("drain", "shutdown")
                        if how is ConnState.SHUTDOWN else ())

    def _closed_error(self) -> Exception:
        if self.conn is ConnState.CLOSED_BY_USER:
            return ConnectionClosed("the client is closed")
        if self.conn is ConnState.SHUTDOWN:
            return EngineShutdownError("engine shut down")
        return EngineDeadError(self._death_message())

    def _death_message(self) -> str:
        return death_message(self._death_reason, self.process, self._cause)


__all__ = ["ClientChannel", "ConnState"]
