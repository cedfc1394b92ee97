"""``serve_ipc``: serve an :class:`engine.AsyncEngine` to many clients over the wire protocol.

One task per connection reads and dispatches frames; one sender task per connection owns the
stream's write side (both in ipc/connection.py). Outputs reach a connection through a sink that the engine calls on the
event-loop thread, all of one step's outputs in one go (``AsyncEngine._dispatch``), so the
sender -- which only runs after that -- finds the whole step in its outbox and writes it as one
``Outputs`` frame (several pending frames go out in one ``send``).

Isolation: a malformed, oversize or unexpected frame, a failed handshake, a peer that stops
reading (``send_timeout``) or lets its outbox grow past ``max_outbox`` closes only that
connection. Closing a connection, for whatever reason, aborts its unfinished requests.

Request ids are the client's, scoped to its connection: the engine sees ``c<conn>-<n>`` and the
outputs are renamed back, so clients can neither collide with nor abort each other's requests.

``serve_ipc`` returns when the engine has stopped (SHUTDOWN, after a drain, shutdown or
failure -- also one a client asked for), after each connection's pending replies are flushed;
or when cancelled. It never installs signal handlers and never shuts the engine down itself.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional

import anyio
import msgspec
from anyio.abc import ByteStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from engine.errors import BadRequestError
from states import State

from .connection import STREAM_ERRORS, Connection
from .errors import ConnectionClosed, ProtocolError
from .framing import FrameCodec, read_frame
from .messages import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    MAX_CHAT_TEMPLATE_LEN,
    MAX_NAME_LEN,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Drain,
    Error,
    ErrorKind,
    Generate,
    HealthRequest,
    Hello,
    Shutdown,
    StateChanged,
    Welcome,
    error_to_message,
)
from .transport import (
    check_token,
    listener_address,
    open_listener,
    parse_address,
    remove_socket,
    socket_inode,
)

log = logging.getLogger("enginecore.ipc")



class IPCServer:
    """Serves one engine on one address. Use :func:`serve_ipc` unless you need the object."""

    def __init__(
        self,
        engine: Any,
        address: str,
        token: Optional[str] = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        *,
        handshake_timeout: float = 10.0,
        send_timeout: float = 30.0,
        max_outbox: int = 1 << 16,
        max_inflight: int = 1 << 14,
        close_grace: float = 5.0,
    ) -> None:
        parse_address(address)  # fail early on a bad address
        FrameCodec(max_frame=max_frame)  # and on a bad limit
        self.engine = engine
        self.address = address
        self.token = token
        self.max_frame = max_frame
        self.handshake_timeout = handshake_timeout
        self.send_timeout = send_timeout
        self.max_outbox = max_outbox
        self.max_inflight = max_inflight
        self.close_grace = close_grace
        self.connections: dict[int, Connection] = {}
        self.bound_address: Optional[str] = None
        self._ids = itertools.count(1)
        self._active = False
        self._tg: Optional[anyio.abc.TaskGroup] = None
        self._stopped = anyio.Event()
        self._info: Optional[dict] = None  # Welcome's model description, once known

    # ------------------------------------------------------------------ lifetime

    async def serve(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await open_listener(self.address, self.token)
        inode = socket_inode(self.address)
        self.bound_address = listener_address(listener, self.address)
        self._active = True
        self._register_state_listener()
        try:
            async with listener, anyio.create_task_group() as tg:
                self._tg = tg
                accept_scope = anyio.CancelScope()

                async def accept() -> None:
                    with accept_scope:
                        await listener.serve(self._handle, task_group=tg)

                tg.start_soon(accept)
                log.info("ipc: serving on %s", self.bound_address)
                task_status.started(self.bound_address)
                await self._wait_engine_stopped()
                log.info("ipc: engine stopped (%s); closing %d connection(s)",
                         self._engine_state(), len(self.connections))
                accept_scope.cancel()
                for conn in list(self.connections.values()):
                    conn.close()
                with anyio.move_on_after(self.close_grace):
                    while self.connections:
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        finally:
            self._active = False
            remove_socket(self.address, inode=inode)
            self._stopped.set()

    async def _wait_engine_stopped(self) -> None:
        wait = getattr(self.engine, "wait_stopped", None)
        if wait is not None:
            await wait()
            return
        while self._engine_state() is not State.SHUTDOWN:  # pragma: no cover - other engines
            await anyio.sleep(0.05)

    def _engine_state(self) -> State:
        return self.engine.state

    def _register_state_listener(self) -> None:
        register = getattr(self.engine, "on_state_change", None)
        if register is None:  # pragma: no cover - other engines
            return
        connections = self.connections

        def on_change(old: State, new: State) -> None:
            if not self._active:
                return  # the engine has no way to unregister; a stopped server ignores it
            msg = StateChanged(state=new, previous=old)
            for conn in list(connections.values()):
                conn.push(msg)

        register(on_change)

    def engine_abort(self, engine_rid: str, reason: str) -> None:
        """Abort from synchronous code (in the server's task group)."""
        if self._tg is not None and self._active:
            self._tg.start_soon(self.engine.abort, engine_rid, reason)

    # ------------------------------------------------------------------ one connection

    async def _handle(self, stream: ByteStream) -> None:
        cid = next(self._ids)
        conn = Connection(self, stream, cid)
        try:
            if await self._handshake(conn):
                self.connections[cid] = conn
                await self._run(conn)
        except Exception:  # never let one connection take the server down
            log.exception("ipc client %d: unexpected error", cid)
        finally:
            self.connections.pop(cid, None)
            conn.accepting = False
            with anyio.CancelScope(shield=True):
                erids, conn.inflight = list(conn.inflight.values()), {}
                for erid in erids:
                    try:
                        await self.engine.abort(erid, "client disconnected")
                    except Exception:  # the engine is stopping or dead: nothing left to abort
                        pass
                await stream.aclose()

    async def _handshake(self, conn: Connection) -> bool:
        buffered = BufferedByteReceiveStream(conn.stream)
        try:
            with anyio.fail_after(self.handshake_timeout):
                body = await read_frame(buffered, HANDSHAKE_MAX_FRAME)
            msg = conn.codec.decode(body)
        except TimeoutError:
            await self._reject(conn, Error(kind=ErrorKind.PROTOCOL, message="handshake timeout", fatal=True))
            return False
        except ConnectionClosed:
            return False
        except ProtocolError as exc:
            await self._reject(conn, error_to_message(exc, fatal=True))
            return False
        if not isinstance(msg, Hello):
            await self._reject(conn, Error(kind=ErrorKind.PROTOCOL, fatal=True,
                                           message=f"expected Hello, got {type(msg).__name__}"))
            return False
        if msg.protocol_version != PROTOCOL_VERSION:
            await self._reject(conn, Error(
                kind=ErrorKind.VERSION, fatal=True,
                message=f"protocol version {msg.protocol_version} not supported; "
                        f"this engine speaks {PROTOCOL_VERSION}"))
            return False
        if not check_token(self.token, msg.token):
            log.warning("ipc client %d: bad token", conn.id)
            await self._reject(conn, Error(kind=ErrorKind.AUTH, fatal=True,
                                           message="missing or wrong token"))
            return False
        conn.name = msg.client_name
        welcome = Welcome(protocol_version=PROTOCOL_VERSION, state=self._engine_state(),
                          max_frame=self.max_frame, client_id=conn.id, **self._model_info())
        try:
            with anyio.fail_after(self.send_timeout):
                await conn.stream.send(conn.codec.encode(welcome))
        except (TimeoutError, *STREAM_ERRORS):
            return False
        # Bytes the client pipelined right after its Hello are in ``buffered``: keep reading
        # through the same buffer.
        conn.buffered = buffered
        return True

    def _model_info(self) -> dict:
        """Welcome's description of the model (computed once; absent parts are left out)."""
        if self._info is not None:
            return self._info
        engine = self.engine
        model = getattr(getattr(engine, "config", None), "model", "")
        info: dict = {"model": str(model)[:MAX_NAME_LEN]}
        tok = getattr(engine, "tokenizer", None)
        runner = getattr(engine, "runner", None)
        try:
            if tok is not None:
                template = getattr(tok, "chat_template", None)
                if isinstance(template, str) and len(template) <= MAX_CHAT_TEMPLATE_LEN:
                    info["chat_template"] = template
                elif template is not None:
                    log.warning("ipc: chat template not sent (not a string or too long)")
                for key in ("bos_token", "eos_token"):
                    text = getattr(tok, key, None)
                    if isinstance(text, str) and len(text) <= MAX_NAME_LEN:
                        info[key] = text
            max_len = getattr(runner, "max_model_len", 0)
            vocab = getattr(getattr(runner, "model_config", None), "vocab_size", None)
            if vocab is None:
                vocab = getattr(tok, "vocab_size", 0)
            info["max_model_len"] = max(0, int(max_len or 0))
            info["vocab_size"] = max(0, int(vocab or 0))
        except Exception:  # never fail a handshake over a description
            log.exception("ipc: cannot describe the model in Welcome")
        if self._engine_state() in (State.SERVING, State.DRAINING):
            self._info = info  # loaded: it will not change any more
        return info

    async def _reject(self, conn: Connection, err: Error) -> None:
        with anyio.move_on_after(min(self.send_timeout, 5.0)):
            try:
                await conn.stream.send(conn.codec.encode(err))
            except STREAM_ERRORS:
                pass

    async def _run(self, conn: Connection) -> None:
        async with anyio.create_task_group() as tg:
            conn.scope = tg.cancel_scope

            async def send_all() -> None:
                try:
                    await conn.sender()
                except TimeoutError:
                    log.warning("ipc client %d: not reading for %.0fs; closing", conn.id, self.send_timeout)
                except STREAM_ERRORS:
                    pass
                tg.cancel_scope.cancel()

            async def read_all() -> None:
                try:
                    await conn.reader()
                except STREAM_ERRORS:
                    tg.cancel_scope.cancel()  # the peer is gone: nobody to flush to

            tg.start_soon(send_all)
            tg.start_soon(read_all)

    # ------------------------------------------------------------------ requests

    async def dispatch(self, conn: Connection, msg: Any) -> None:
        t = type(msg)
        if t is Generate:
            self._generate(conn, msg)
        elif t is Abort:
            erid = conn.inflight.get(msg.request_id)
            if erid is not None:
                await self.engine.abort(erid, "aborted by client")
            if msg.call_id is not None:
                conn.push(Ack(call_id=msg.call_id, request_id=msg.request_id))
        elif t is HealthRequest:
            conn.push(msgspec.structs.replace(await self.engine.health(), call_id=msg.call_id))
        elif t is Drain:
            self._call(conn, msg.call_id, self.engine.drain, msg.timeout)
        elif t is Shutdown:
            self._call(conn, msg.call_id, self.engine.shutdown)
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
        erid = f"c{conn.id}-{next(conn._seq)}"
        conn.inflight[rid] = erid
        try:
            self._submit(msg.prompt, msg.params, erid, conn.make_sink(rid, erid))
        except Exception as exc:
            conn.inflight.pop(rid, None)
            conn.push(error_to_message(exc, request_id=rid, fatal=False))

    def _submit(self, prompt, params, erid: str, sink) -> None:
        submit = getattr(self.engine, "submit", None)
        if submit is not None:
            submit(prompt, params, erid, sink)
            return
        # An engine with only ``generate``: one task per request forwards its stream.
        stream = self.engine.generate(prompt, params, request_id=erid)  # pragma: no cover

        async def forward() -> None:  # pragma: no cover
            try:
                async for out in stream:
                    sink(out)
            except Exception as exc:
                sink(exc)

        assert self._tg is not None  # pragma: no cover
        self._tg.start_soon(forward)  # pragma: no cover

    def _call(self, conn: Connection, call_id: Optional[int], fn, *args: Any) -> None:
        """Run a long engine call (drain/shutdown) without blocking the connection's reader."""
        assert self._tg is not None
        conn.pending_calls += 1

        async def run() -> None:
            try:
                await fn(*args)
            except Exception as exc:
                conn.push(error_to_message(exc, call_id=call_id, fatal=False))
            else:
                if call_id is not None:
                    conn.push(Ack(call_id=call_id, state=self._engine_state()))
            finally:
                conn.pending_calls -= 1
                conn._wake.set()

        # In the server's task group: the call outlives the connection that asked for it.
        self._tg.start_soon(run)


async def serve_ipc(
    engine: Any,
    address: str,
    token: Optional[str] = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    *,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """Serve ``engine`` on ``address`` (``unix:///path`` or ``tcp://host:port``) until the
    engine stops or the caller cancels.

    ``token``: required in every client's Hello (and mandatory for a non-loopback TCP host).
    ``max_frame``: the largest frame accepted or sent. With ``await tg.start(serve_ipc, ...)``
    the caller gets the concrete address (TCP port 0 resolved) once the listener is up.
    ``options``: ``handshake_timeout`` (10 s), ``send_timeout`` (30 s: a client that stops
    reading is dropped), ``max_outbox`` (65,536 queued items), ``max_inflight`` (16,384
    requests per connection), ``close_grace`` (5 s to flush replies when the engine stops).
    """
    server = IPCServer(engine, address, token, max_frame, **options)
    await server.serve(task_status=task_status)


__all__ = ["serve_ipc", "IPCServer"]
