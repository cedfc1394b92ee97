"""``serve_ipc``: serve an engine to many clients over the wire protocol.

One task per connection reads and dispatches frames; one sender per connection owns the
stream's write side (ipc/connection.py). The engine's sink gets one step's outputs in one go, so
the sender finds the whole step in its outbox and writes it as one ``Outputs`` frame.

Isolation: a malformed, oversize or unexpected frame, a failed handshake, a peer that stops
reading (``send_timeout``) or lets its outbox grow past ``max_outbox`` closes only that
connection. Closing a connection, for whatever reason, aborts its unfinished requests.

Hostile peers: at most ``max_connections`` connections at once, handshaken or not (beyond it a
new one gets a fatal ``Error(OVERLOADED)`` and is closed at once); a failed ``accept`` (out of
file descriptors, ...) backs off and retries, logged as summaries (ipc/accept.py); a right
token is admitted at once, the answers to failed authentications are held per peer and in all
(a bounded number at a time), logged with the peer (ipc/auth.py).

Request ids are scoped to their connection (the engine sees ``c<conn>-<n>``): clients can
neither collide with nor abort each other's requests. Each connection is a client of the
engine's (``c<conn>``: turns with other clients' waiting requests, a share of the admission
limits), and so is each user it names in ``Generate.client`` (``c<conn>/<name>``).

``serve_ipc`` returns when the engine has stopped (a drain, shutdown or failure), after each
connection's pending replies are flushed; or when cancelled. It touches no signal and never
shuts the engine down itself.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import anyio
from anyio.abc import ByteStream, Listener, TaskStatus
import msgspec

from engine.errors import BadRequestError
from engine.interface import Engine, Prompt
from engine.params import SamplingParams
from states import State

from .accept import SummaryLog, accept_forever
from .auth import AuthThrottle
from .connection import STREAM_ERRORS, Connection
from .control import CONTROL_REQUESTS, ControlReply, run_control
from .errors import ConnectionClosed, ProtocolError
from .framing import FrameCodec, FrameReader
from .handshake import HANDSHAKE_TIMEOUT, describe_model, hello_error
from .messages import (DEFAULT_MAX_FRAME, HANDSHAKE_MAX_FRAME, PROTOCOL_VERSION, Abort, Ack,
                       ClientMessage, Detokenize, Drain, Error, ErrorKind, Generate, HealthRequest,
                       Shutdown, Sleep, StateChanged, Tokenize, Tokens, UpdateWeights, Vocabulary,
                       WakeUp, Welcome)
from .transport import (check_token, listener_address, open_listener, parse_address, peer_of,
                        remove_socket, socket_inode)
from .wire_errors import error_to_message

log = logging.getLogger("enginecore.ipc")

#: Generate frames dispatched between two turns of the event loop (others' frames, the steps).
GENERATES_PER_TURN = 32


@runtime_checkable
class ServedEngine(Engine, Protocol):
    """An :class:`~engine.interface.Engine` with the server's fast path: ``submit`` delivers a
    request's outputs (or the exception that ends it) to ``sink`` on the event-loop thread, a
    step's at a time; returns the prompt's token count. ``client``: whose request it is."""

    def submit(self, prompt: Prompt, params: SamplingParams, request_id: str,
               sink: Callable[[Any], None], client: str = "") -> int: ...


class IPCServer:
    """Serves one engine on one address. Use :func:`serve_ipc` unless you need the object.

    ``listener``: one already bound (``transport.preflight_listen``) for ``address``."""

    def __init__(
        self,
        engine: ServedEngine,
        address: str,
        token: Optional[str] = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        *,
        listener: Optional[Listener[ByteStream]] = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        send_timeout: float = 30.0,
        max_outbox: int = 1 << 16,
        max_inflight: int = 1 << 14,
        max_connections: int = 256,
        close_grace: float = 5.0,
        auth_throttle: Optional[AuthThrottle] = None,
        log_interval: float = 10.0,
    ) -> None:
        parse_address(address)  # fail early on a bad address
        FrameCodec(max_frame=max_frame)  # and on a bad limit
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.engine = engine
        self.address = address
        self.token = token or None
        self.max_frame = max_frame
        self.handshake_timeout = handshake_timeout
        self.send_timeout = send_timeout
        self.max_outbox = max_outbox
        self.max_inflight = max_inflight
        self.max_connections = max_connections
        self.close_grace = close_grace
        self.auth = auth_throttle or AuthThrottle()
        self.connections: dict[int, Connection] = {}  # handshaken
        self.live = 0  # accepted and not closed yet, handshaken or not
        self.bound_address: Optional[str] = None
        self.accept_log = SummaryLog(log, "ipc: accept failed", interval=log_interval)
        self.refusal_log = SummaryLog(log, "ipc: refused a connection", interval=log_interval)
        self.auth_log = SummaryLog(log, "ipc: failed authentication", interval=log_interval)
        self._listener = listener
        self._ids = itertools.count(1)
        self._active = False
        self._tg: Optional[anyio.abc.TaskGroup] = None
        self._all_closed = anyio.Event()
        self._info: Optional[dict] = None  # Welcome's model description, once loaded
        self._generates = 0  # Generate frames dispatched (a turn for others every few)

    # ------------------------------------------------------------------ lifetime

    async def serve(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = self._listener or await open_listener(self.address, self.token)
        inode = socket_inode(self.address)
        self.bound_address = listener_address(listener, self.address)
        self._active = True
        self.engine.on_state_change(self._on_state_change)
        try:
            async with listener, anyio.create_task_group() as tg:
                self._tg = tg
                accept_scope = anyio.CancelScope()

                async def accept() -> None:
                    with accept_scope:
                        await accept_forever(listener, self._on_accept, self.accept_log)

                tg.start_soon(accept)
                log.info("ipc: serving on %s", self.bound_address)
                task_status.started(self.bound_address)
                await self.engine.wait_stopped()
                log.info("ipc: engine stopped (%s); closing %d connection(s)",
                         self.engine.state, len(self.connections))
                accept_scope.cancel()
                self._all_closed = anyio.Event()
                for conn in list(self.connections.values()):
                    conn.close()
                if self.connections:
                    with anyio.move_on_after(self.close_grace):
                        await self._all_closed.wait()
                tg.cancel_scope.cancel()
        finally:
            self._active = False
            remove_socket(self.address, inode=inode)

    def _on_state_change(self, old: State, new: State) -> None:
        if not self._active:
            return  # the engine has no way to unregister; a stopped server ignores it
        msg = StateChanged(state=new, previous=old)
        for conn in list(self.connections.values()):
            conn.push(msg)

    def engine_abort(self, engine_rid: str, reason: str) -> None:
        """Abort from synchronous code (in the server's task group)."""
        if self._tg is not None and self._active:
            self._tg.start_soon(self.engine.abort, engine_rid, reason)

    # ------------------------------------------------------------------ accepting

    def _on_accept(self, stream: ByteStream) -> None:
        assert self._tg is not None
        if self.live >= self.max_connections:
            self._tg.start_soon(self._refuse, stream)
            return
        self.live += 1
        self._tg.start_soon(self._handle, stream)

    async def _refuse(self, stream: ByteStream) -> None:
        _, peer = peer_of(stream)
        self.refusal_log.note("max_connections", f"too many connections (max "
                              f"{self.max_connections}); refused {peer}")
        err = Error(kind=ErrorKind.OVERLOADED, fatal=True, retry_after=1.0,
                    message=f"too many connections (max {self.max_connections})")
        with anyio.move_on_after(0.5):
            try:
                await stream.send(FrameCodec().encode(err))
            except STREAM_ERRORS:
                pass
        await anyio.aclose_forcefully(stream)

    # ------------------------------------------------------------------ one connection

    async def _handle(self, stream: ByteStream) -> None:
        cid = next(self._ids)
        key, peer = peer_of(stream)
        codec = FrameCodec(ClientMessage, max_frame=self.max_frame)
        conn = Connection(stream, cid, codec, FrameReader(stream, codec, max_frame=HANDSHAKE_MAX_FRAME),
                          peer=peer, send_timeout=self.send_timeout, max_outbox=self.max_outbox,
                          abort_request=self.engine_abort)
        try:
            if await self._handshake(conn, key):
                self.connections[cid] = conn
                await conn.serve(self.dispatch, self.send_timeout)
        except Exception:  # never let one connection take the server down
            log.exception("ipc client %d (%s): unexpected error", cid, peer)
        finally:
            self.live -= 1
            self.connections.pop(cid, None)
            if not self.connections:
                self._all_closed.set()
            conn.gone()
            with anyio.CancelScope(shield=True):
                erids, conn.inflight = list(conn.inflight.values()), {}
                for erid in erids:
                    try:
                        await self.engine.abort(erid, "client disconnected")
                    except Exception:  # the engine is stopping or dead: nothing left to abort
                        pass
                await stream.aclose()

    async def _handshake(self, conn: Connection, key: str) -> bool:
        try:
            with anyio.fail_after(self.handshake_timeout):
                msg = await conn.reader.read()
        except TimeoutError:
            return await self._reject(conn, Error(kind=ErrorKind.PROTOCOL, message="handshake timeout",
                                                  fatal=True))
        except ConnectionClosed:
            return False
        except ProtocolError as exc:
            return await self._reject(conn, error_to_message(exc, fatal=True))
        err = hello_error(msg)
        if err is not None:
            return await self._reject(conn, err)
        if self.token is not None and not await self._authenticate(conn, key, msg.token):
            return False
        conn.name = msg.client_name
        conn.reader.max_frame = self.max_frame
        welcome = Welcome(protocol_version=PROTOCOL_VERSION, state=self.engine.state,
                          max_frame=self.max_frame, client_id=conn.id, **self._model_info())
        try:
            with anyio.fail_after(self.send_timeout):
                await conn.stream.send(conn.codec.encode(welcome))
        except (TimeoutError, *STREAM_ERRORS):
            return False
        return True

    async def _authenticate(self, conn: Connection, key: str, token: Optional[str]) -> bool:
        """The token first (constant time): a right one is admitted at once, whatever the
        throttle has counted; only a failure's answer is held (ipc/auth.py)."""
        if check_token(self.token, token):
            return True
        denied = await self.auth.deny(key)
        self.auth_log.note(key, f"client {conn.id} from {conn.peer}: missing or wrong token "
                           f"({denied.failures} failure(s) from {key} in the last "
                           f"{self.auth.window:.0f} s)")
        message = "missing or wrong token"
        if denied.retry_after is not None:  # too many failures held already: answered at once
            message += "; too many failed authentications, try later"
        await self._reject(conn, Error(kind=ErrorKind.AUTH, fatal=True, message=message,
                                       retry_after=denied.retry_after))
        return False

    def _model_info(self) -> dict:
        """Welcome's description of the model (kept once loaded)."""
        if self._info is not None:
            return self._info
        info = describe_model(self.engine)
        if self.engine.state in (State.SERVING, State.DRAINING):
            self._info = info  # loaded: it will not change any more
        return info

    async def _reject(self, conn: Connection, err: Error) -> bool:
        """Send a fatal handshake error (best effort); always False."""
        with anyio.move_on_after(min(self.send_timeout, 5.0)):
            try:
                await conn.stream.send(conn.codec.encode(err))
            except STREAM_ERRORS:
                pass
        return False

    # ------------------------------------------------------------------ requests

    async def dispatch(self, conn: Connection, msg: Any) -> None:
        t = type(msg)
        if t is Generate:
            self._generate(conn, msg)
            # NOTE: a client's pipelined Generates arrive many to a receive (1 MiB: thousands of
            # frames) and its reader dispatches every complete frame before it awaits again: a
            # flood of 16k held the event loop for seconds (a submit costs tens of us), while
            # other connections' frames and the engine's steps waited. A turn every few frames.
            self._generates += 1
            if not self._generates % GENERATES_PER_TURN:
                await anyio.lowlevel.checkpoint()
        elif t is Abort:
            erid = conn.inflight.get(msg.request_id)
            if erid is not None:
                await self.engine.abort(erid, msg.reason or "aborted by client")
            if msg.call_id is not None:
                conn.push(Ack(call_id=msg.call_id, request_id=msg.request_id))
        elif t is HealthRequest:
            conn.push(msgspec.structs.replace(await self.engine.health(), call_id=msg.call_id))
        elif t is Drain:
            self._call(conn, msg.call_id, self.engine.drain, msg.timeout)
        elif t is Shutdown:
            self._call(conn, msg.call_id, self.engine.shutdown)
        elif t is Sleep:  # sleep mode (engine/serving/sleep.py): the frame's fields are bounded already
            self._call(conn, msg.call_id, self.engine.sleep, msg.level, msg.mode, msg.timeout,
                       msg.tags)
        elif t is WakeUp:
            self._call(conn, msg.call_id, self.engine.wake_up, msg.tags)
        elif t is UpdateWeights:
            self._call(conn, msg.call_id, self.engine.update_weights, msg.path, msg.version)
        elif t in CONTROL_REQUESTS:  # pause, abort-all, weights from a trainer (control.py)
            self._call(conn, msg.call_id, run_control, self.engine, msg)
        elif t is Tokenize:
            self._call(conn, msg.call_id, self.engine.tokenize, msg.text, msg.add_special_tokens,
                       answer="ids")
        elif t is Detokenize:
            self._call(conn, msg.call_id, self.engine.detokenize, msg.ids, msg.each, msg.tokens, answer="texts")
        elif t is Vocabulary:
            self._call(conn, msg.call_id, self.engine.token_bytes, answer="pieces")
        else:  # a second Hello
            conn.fail(ProtocolError(f"unexpected {t.__name__} after the handshake"))

    def _generate(self, conn: Connection, msg: Generate) -> None:
        rid = msg.request_id
        if rid in conn.inflight:
            conn.push(error_to_message(BadRequestError(f"request_id {rid!r} is already in flight"),
                                       request_id=rid))
            return
        if len(conn.inflight) >= self.max_inflight:
            conn.push(error_to_message(BadRequestError(
                f"too many requests in flight on this connection (max {self.max_inflight})"),
                request_id=rid))
            return
        erid = f"c{conn.id}-{next(conn.seq)}"
        client = f"c{conn.id}" if msg.client is None else f"c{conn.id}/{msg.client}"
        conn.inflight[rid] = erid
        try:
            self.engine.submit(msg.prompt, msg.params, erid, conn.make_sink(rid, erid), client)
        except Exception as exc:  # refusals (draining, overloaded: retryable, with retry_after)
            conn.inflight.pop(rid, None)
            conn.push(error_to_message(exc, request_id=rid, fatal=False))

    def _call(self, conn: Connection, call_id: Optional[int], fn, *args: Any,
              answer: Optional[str] = None) -> None:
        """Run a long engine call (drain, sleep, ...) without blocking the connection's reader
        (``answer``: send the result back as this field of a Tokens)."""
        assert self._tg is not None
        conn.call_started()
        async def run() -> None:
            try:
                result = await fn(*args)
            except Exception as exc:
                conn.push(error_to_message(exc, call_id=call_id, fatal=False))
            else:
                if type(result) is ControlReply:
                    conn.push(msgspec.structs.replace(result, call_id=call_id))
                elif answer is not None:
                    conn.push(Tokens(call_id=call_id, **{answer: result}))
                elif call_id is not None:
                    conn.push(Ack(call_id=call_id, state=self.engine.state))
            finally:
                conn.call_done()

        # In the server's task group: the call outlives the connection that asked for it.
        self._tg.start_soon(run)


async def serve_ipc(
    engine: ServedEngine,
    address: str,
    token: Optional[str] = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    *,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """Serve ``engine`` on ``address`` (``unix:///path`` or ``tcp://host:port``) until the
    engine stops or the caller cancels.

    ``token``: required in every client's Hello, on every kind of address (and mandatory for a
    non-loopback TCP host). ``max_frame``: the largest frame accepted or sent. With
    ``await tg.start(serve_ipc, ...)`` the caller gets the concrete address (TCP port 0
    resolved) once the listener is up. ``options``: see :class:`IPCServer` -- ``listener`` (one
    bound by ``transport.preflight_listen``), ``handshake_timeout`` (10 s), ``send_timeout``
    (30 s: a client that stops reading is dropped), ``max_outbox`` (65,536 queued items),
    ``max_inflight`` (16,384 requests per connection), ``max_connections`` (256, handshaken or
    not), ``close_grace`` (5 s to flush replies when the engine stops), ``auth_throttle``,
    ``log_interval`` (10 s between summary log lines of floods).
    """
    server = IPCServer(engine, address, token, max_frame, **options)
    await server.serve(task_status=task_status)


__all__ = ["serve_ipc", "IPCServer", "ServedEngine"]
