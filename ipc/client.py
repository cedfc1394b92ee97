"""``EngineClient``: the engine's in-process API (:class:`engine.AsyncEngine`), over the wire.

::

    async with EngineClient.connect("unix:///tmp/engine.sock", token=None) as eng:
        async for out in eng.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")
        print(await eng.health())

    async with EngineClient.spawn(EngineConfig(model="random:tiny-llama")) as eng:
        ...  # a private engine process, shut down (and reaped) on exit

Design:

* One reader task reads the socket in large chunks and decodes every complete frame in the
  buffer before it awaits again; an ``Outputs`` frame (one engine step) is dispatched in one
  synchronous loop: each piece is appended to its request's queue and wakes that request's
  consumer, if it waits -- no task switch, send or await per piece.
* One writer task owns the socket's write side. ``generate`` encodes its ``Generate`` frame at
  once (so invalid or oversize requests fail in the call, like the in-process engine) and queues
  it; everything queued while the writer was away goes out in one ``send``.
* Errors the engine reports for a request (draining, bad request, shutdown, dead) are raised by
  that request's iterator on its next ``__anext__``, so at the latest on the first one. The
  client also raises at once when it already knows the engine is draining, shut down or dead.
* Death: when the connection ends without a clean shutdown (EOF or reset: the engine process
  was killed, even by SIGKILL), every pending and later call raises
  :class:`~engine.errors.EngineDeadError` -- the socket's EOF arrives as soon as the process is
  gone, so this takes milliseconds, with or without frames in flight. A spawned engine's exit
  code is in the message (and in :attr:`EngineClient.exit_code`). After a clean shutdown
  (drain/shutdown by any client), calls raise :class:`~engine.errors.EngineShutdownError`, as
  the in-process engine does.
* Leaving a request's iterator early (``break`` and dropping it, ``aclose()``, garbage
  collection) sends ``Abort``; the engine frees the request's blocks.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Union

import anyio
import msgspec

from engine.errors import (BadRequestError, EngineDeadError, EngineDrainingError,
                           EngineShutdownError)
from engine.mailbox import Mailbox
from engine.params import RequestOutput, SamplingParams
from engine.tokenizer import render_chat_template
from states import InvalidTransitionError, State

from .errors import ConnectionClosed, FrameTooLargeError, ProtocolError
from .framing import HEADER, HEADER_SIZE, FrameCodec
from .messages import (
    DEFAULT_MAX_FRAME,
    MAX_NAME_LEN,
    MAX_REQUEST_ID_LEN,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Drain,
    EngineMessage,
    Error,
    Generate,
    Health,
    HealthRequest,
    Hello,
    Outputs,
    Shutdown,
    StateChanged,
    Welcome,
    message_to_error,
)
from .streams import RemoteStream, _thread_caller
from .transport import connect as open_stream

if TYPE_CHECKING:  # pragma: no cover
    from engine.config import EngineConfig

    from .spawn import EngineProcess

log = logging.getLogger("enginecore.ipc.client")

Prompt = Union[str, list[int]]

_STREAM_ENDED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
_RECV_CHUNK = 1 << 20
#: The longest a drain may wait (the wire's bound); ``drain(None)`` means "no deadline".
_MAX_DRAIN_TIMEOUT = 1e9
#: After the connection ends, how long to wait for a spawned engine's exit code.
_EXIT_CODE_GRACE = 0.3
_replace = msgspec.structs.replace


class _Call:
    """A call waiting for its answer (Health / Ack / Error with its call_id)."""

    __slots__ = ("event", "result", "error", "kind")

    def __init__(self, kind: str) -> None:
        self.event = anyio.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.kind = kind


class EngineClient:
    """A connection to an engine process, with :class:`engine.AsyncEngine`'s API.

    Create it with :meth:`connect` (an engine already serving) or :meth:`spawn` (start a private
    engine process); both are async context managers. Not thread-safe: use it from the event
    loop it was created in (:class:`ipc.sync_client.SyncEngineClient` wraps it for threads).
    """

    def __init__(self, stream: Any, welcome: Welcome, leftover: bytes = b"") -> None:
        self.welcome = welcome
        self._stream = stream
        self._state: State = welcome.state
        self._codec = FrameCodec(EngineMessage, max_frame=welcome.max_frame or DEFAULT_MAX_FRAME)
        self._max_frame = self._codec.max_frame
        self._check_generate = msgspec.msgpack.Decoder(Generate)
        self._buf = bytearray(leftover)
        self._streams: dict[str, Optional[Mailbox]] = {}  # None: aborted, terminal piece pending
        self._calls: dict[int, _Call] = {}
        self._outbox: list[bytes] = []
        self._wake = anyio.Event()
        self._call_ids = itertools.count(1)
        self._rid_prefix = uuid.uuid4().hex[:8] + "-"
        self._rids = itertools.count(1)
        self._loop_thread = threading.get_ident()
        self._call_soon_threadsafe = _thread_caller()
        self._failed = False        # the engine reported FAILED
        self._lost = False          # the connection ended; deciding how (see _lose)
        self._closed = False        # finished: every pending call has its error
        self._end: Optional[str] = None  # "closed" (by us) | "shutdown" | "dead"
        self._cause: Optional[BaseException] = None
        self._fatal: Optional[BaseException] = None  # a fatal Error frame from the engine
        self._user_closed = False
        self.process: Optional["EngineProcess"] = None  # set by spawn()

    # ------------------------------------------------------------------ opening

    @classmethod
    @asynccontextmanager
    async def connect(cls, address: str, token: Optional[str] = None, *,
                      client_name: str = "enginecore-client",
                      timeout: float = 10.0) -> AsyncIterator["EngineClient"]:
        """Connect to the engine serving on ``address`` (``unix:///path`` or
        ``tcp://host:port``) and do the handshake (within ``timeout`` seconds).

        Raises ``OSError`` if nobody listens, :class:`~ipc.errors.AuthError` /
        :class:`~ipc.errors.VersionError` / :class:`~ipc.errors.ProtocolError` if the engine
        refuses the handshake, ``TimeoutError`` if it does not answer."""
        stream = await open_stream(address)
        try:
            with anyio.fail_after(timeout):
                welcome, leftover = await _handshake(stream, token, client_name)
        except BaseException:
            await anyio.aclose_forcefully(stream)
            raise
        client = cls(stream, welcome, leftover)
        async with client._running():
            yield client

    @classmethod
    def spawn(cls, config: "EngineConfig", *, address: Optional[str] = None,
              token: Optional[str] = None, startup_timeout: float = 600.0,
              drain_timeout: float = 30.0, shutdown_timeout: float = 30.0,
              client_name: str = "enginecore-client"):
        """Start a private engine process for ``config`` and connect to it (async context
        manager). See :func:`ipc.spawn.spawn_engine`; on exit the engine is shut down and
        reaped, and :attr:`exit_code` tells how it ended."""
        from .spawn import spawn_engine

        return spawn_engine(cls, config, address=address, token=token,
                            startup_timeout=startup_timeout, drain_timeout=drain_timeout,
                            shutdown_timeout=shutdown_timeout, client_name=client_name)

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        error: Optional[BaseException] = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._reader)
                tg.start_soon(self._writer)
                try:
                    yield
                except GeneratorExit:  # pragma: no cover - the context was garbage collected
                    raise
                except BaseException as exc:  # re-raised below, not wrapped in a group
                    error = exc
                finally:
                    self._user_closed = True
                    tg.cancel_scope.cancel()
        finally:
            self._finish(None)
            with anyio.CancelScope(shield=True):
                await anyio.aclose_forcefully(self._stream)
        if error is not None:
            try:
                raise error
            finally:
                del error

    # ------------------------------------------------------------------ the API

    @property
    def state(self) -> State:
        """The engine's state, as last heard (``FAILED`` once the connection is lost)."""
        return self._state

    @property
    def model(self) -> str:
        return self.welcome.model

    @property
    def max_model_len(self) -> int:
        return self.welcome.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.welcome.vocab_size

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def exit_code(self) -> Optional[int]:
        """A spawned engine's exit code (negative: killed by that signal), None while it runs
        or when the engine was not spawned by this client."""
        return None if self.process is None else self.process.poll()

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None) -> RemoteStream:
        """Submit now; iterate the result for outputs.

        Raised here: what the client can tell by itself (bad params/prompt/id ->
        ``BadRequestError``; engine known to be draining/shut down/dead). Raised by the
        iterator, at the latest on its first ``__anext__``: what the engine refuses."""
        if self._lost:
            raise self._closed_error()
        if self._state is not State.SERVING:
            self._raise_unavailable("generate")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise BadRequestError("params must be SamplingParams")
        params.validate()
        if request_id is None:
            rid = f"{self._rid_prefix}{next(self._rids)}"
        else:
            rid = request_id
            if not isinstance(rid, str) or not (0 < len(rid) <= MAX_REQUEST_ID_LEN):
                raise BadRequestError(
                    f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} chars")
        streams = self._streams
        if rid in streams:
            raise BadRequestError(f"request_id {rid!r} is already in flight")
        frame = self._encode_generate(rid, prompt, params)
        ch = Mailbox()
        streams[rid] = ch
        self._outbox.append(frame)
        self._wake.set()
        return RemoteStream(self, rid, ch)

    async def complete(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None) -> RequestOutput:
        """Run one request to the end; its pieces joined in one :class:`RequestOutput`."""
        text: list[str] = []
        ids: list[int] = []
        logprobs: Optional[list[float]] = None
        last: Optional[RequestOutput] = None
        stream = self.generate(prompt, params, request_id)
        try:
            async for out in stream:
                text.append(out.text)
                ids.extend(out.token_ids)
                if out.logprobs is not None:
                    logprobs = (logprobs or []) + list(out.logprobs)
                last = out
        finally:
            stream.cancel()
        assert last is not None and last.finished
        return _replace(last, token_ids=ids, text="".join(text), logprobs=logprobs)

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        """Abort a request of this client (its iterator gets the final ``"abort"`` piece).
        Like the in-process engine, unknown ids and a stopped engine are not errors.
        (``reason`` is accepted for API parity; the engine records "aborted by client".)"""
        if self._lost or self._streams.get(request_id) is None:
            return
        self._send_nowait(self._codec.encode(Abort(request_id=request_id)))

    async def health(self) -> Health:
        """The engine's :class:`~ipc.messages.Health` (state, live, ready, running, waiting,
        kv_usage)."""
        msg = await self._call("health", lambda cid: HealthRequest(call_id=cid))
        self._state = msg.state if not self._failed else self._state
        return _replace(msg, call_id=None)

    async def drain(self, timeout: Optional[float] = None) -> None:
        """Stop admission everywhere, let running requests finish for up to ``timeout`` seconds
        (None: no deadline), abort the rest, shut the engine down. Returns when it is down."""
        t = _MAX_DRAIN_TIMEOUT if timeout is None else min(max(0.0, float(timeout)), _MAX_DRAIN_TIMEOUT)
        await self._call("drain", lambda cid: Drain(timeout=t, call_id=cid))

    async def shutdown(self) -> None:
        """``drain(0)``: abort everything in flight (terminal pieces are delivered), shut down."""
        await self._call("shutdown", lambda cid: Shutdown(call_id=cid))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's chat template, client-side (the template came
        in the handshake), exactly as ``engine.tokenizer.Tokenizer.apply_chat_template``."""
        w = self.welcome
        return render_chat_template(w.chat_template, messages, w.bos_token, w.eos_token,
                                    add_generation_prompt)

    # ------------------------------------------------------------------ internals: requests

    def _encode_generate(self, rid: str, prompt: Any, params: SamplingParams) -> bytes:
        if isinstance(prompt, str):
            pass
        elif isinstance(prompt, list):
            vocab = self.welcome.vocab_size
            for t in prompt:
                if type(t) is not int or t < 0 or (vocab and t >= vocab):
                    bound = f"[0, {vocab})" if vocab else "[0, 2**31)"
                    raise BadRequestError(f"prompt token ids must be ints in {bound}")
        else:
            raise BadRequestError("prompt must be a string or a list of token ids")
        try:
            frame = self._codec.encode(Generate(request_id=rid, prompt=prompt, params=params))
        except FrameTooLargeError as exc:
            raise BadRequestError(f"request too large: {exc}") from None
        except (TypeError, ValueError, OverflowError) as exc:  # msgspec.EncodeError is a ValueError
            raise BadRequestError(f"cannot encode the request: {exc}") from None
        # The engine treats a frame it cannot validate as a protocol violation and drops the
        # whole connection; check ours against the same schema first (cheap).
        try:
            self._check_generate.decode(memoryview(frame)[HEADER_SIZE:])
        except msgspec.ValidationError as exc:
            raise BadRequestError(f"invalid request: {exc}") from None
        return frame

    def _abandon(self, rid: str, ch: Mailbox) -> None:
        """The iterator of ``rid`` went away: abort the request (callable from any thread)."""
        if threading.get_ident() != self._loop_thread:
            try:
                self._call_soon_threadsafe(lambda: self._abandon(rid, ch))
            except RuntimeError:  # the loop is closed: so is the connection
                pass
            return
        streams = self._streams
        if streams.get(rid) is not ch:
            return  # finished or failed already
        streams[rid] = None  # keep the id reserved until its terminal piece arrives
        if not self._lost:
            self._send_nowait(self._codec.encode(Abort(request_id=rid)))

    def _send_nowait(self, frame: bytes) -> None:
        self._outbox.append(frame)
        self._wake.set()

    async def _call(self, kind: str, make: Callable[[int], Any]) -> Any:
        if self._lost:
            raise self._closed_error()
        cid = next(self._call_ids)
        call = _Call(kind)
        self._calls[cid] = call
        try:
            self._send_nowait(self._codec.encode(make(cid)))
            await call.event.wait()
        finally:
            self._calls.pop(cid, None)
        if call.error is not None:
            try:
                raise call.error
            finally:
                call = None  # type: ignore[assignment]  # no reference cycle via the traceback
        return call.result

    def _raise_unavailable(self, what: str):
        st = self._state
        if st is State.FAILED or self._failed:
            raise EngineDeadError("engine is dead")
        if st is State.DRAINING:
            raise EngineDrainingError()
        if st is State.SHUTDOWN:
            raise EngineShutdownError(f"engine is shut down; {what}() is not possible")
        raise InvalidTransitionError(st, what, ["serving"])

    # ------------------------------------------------------------------ internals: the wire

    async def _writer(self) -> None:
        stream = self._stream
        try:
            while not self._lost:
                if not self._outbox:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                out, self._outbox = self._outbox, []
                await stream.send(out[0] if len(out) == 1 else b"".join(out))
        except _STREAM_ENDED as exc:
            await self._lose(exc)
        except Exception as exc:  # pragma: no cover - a bug of ours
            log.exception("ipc client: writer failed")
            await self._lose(exc)

    async def _reader(self) -> None:
        cause: Optional[BaseException] = None
        try:
            await self._read_loop()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass
        except _STREAM_ENDED as exc:  # reset, broken pipe
            cause = exc
        except ProtocolError as exc:  # the engine sent something we cannot read
            log.error("ipc client: %s; closing the connection", exc)
            cause = exc
        except Exception as exc:  # pragma: no cover - a bug of ours
            log.exception("ipc client: reader failed")
            cause = exc
        await self._lose(cause)

    async def _read_loop(self) -> None:
        receive = self._stream.receive
        decode = self._codec.decode
        dispatch = self._dispatch
        unpack = HEADER.unpack_from
        max_frame = self._max_frame
        buf = self._buf
        while True:
            pos, n = 0, len(buf)
            if n >= HEADER_SIZE:
                with memoryview(buf) as view:
                    while n - pos >= HEADER_SIZE:
                        (size,) = unpack(buf, pos)
                        if size == 0:
                            raise ProtocolError("empty frame (length 0)")
                        if size > max_frame:
                            raise FrameTooLargeError(size, max_frame)
                        end = pos + HEADER_SIZE + size
                        if end > n:
                            break
                        msg = decode(view[pos + HEADER_SIZE:end])
                        pos = end
                        dispatch(msg)
                if pos:
                    del buf[:pos]
            buf += await receive(_RECV_CHUNK)

    def _dispatch(self, msg: Any) -> None:
        t = type(msg)
        if t is Outputs:
            streams = self._streams
            for out in msg.outputs:
                rid = out.request_id
                if rid not in streams:
                    continue
                ch = streams[rid]
                if out.finished:
                    del streams[rid]
                if ch is None:
                    continue  # aborted by us: nobody reads it
                ch.put(out)
        elif t is Error:
            self._on_error(msg)
        elif t is StateChanged:
            if msg.state is State.FAILED:
                self._failed = True
            self._state = msg.state
        elif t is Health or t is Ack:
            if t is Ack and msg.state is not None and not self._failed:
                self._state = msg.state
            call = self._calls.pop(msg.call_id, None) if msg.call_id is not None else None
            if call is not None:
                call.result = msg
                call.event.set()
        else:  # a second Welcome
            raise ProtocolError(f"unexpected {t.__name__} from the engine")

    def _on_error(self, msg: Error) -> None:
        if msg.call_id is not None and msg.call_id in self._calls:
            call = self._calls.pop(msg.call_id)
            call.error = message_to_error(msg)
            call.event.set()
            return
        rid = msg.request_id
        if rid is not None and rid in self._streams:
            ch = self._streams.pop(rid)
            if ch is not None:
                ch.fail(message_to_error(msg))
            return
        if msg.fatal:
            self._fatal = message_to_error(msg)
            log.error("ipc client: the engine closes the connection: %s", self._fatal)
        else:
            log.warning("ipc client: engine error %s: %s", msg.kind.name, msg.message)

    # ------------------------------------------------------------------ internals: the end

    async def _lose(self, cause: Optional[BaseException]) -> None:
        """The connection ended (or broke): fail every pending and later call."""
        if self._lost:
            return
        self._lost = True
        self._wake.set()  # the writer exits
        proc = self.process
        if proc is not None and not self._user_closed and proc.poll() is None:
            # The socket closes while the process exits; its exit code follows in a moment.
            with anyio.move_on_after(_EXIT_CODE_GRACE):
                while proc.poll() is None:
                    await anyio.sleep(0.01)
        self._finish(cause)

    def _finish(self, cause: Optional[BaseException]) -> None:
        if self._closed:
            return
        self._lost = self._closed = True
        self._cause = cause if cause is not None else self._fatal
        if self._user_closed and not self._end_known():
            self._end = "closed"
        elif self._state is State.SHUTDOWN and not self._failed:
            self._end = "shutdown"
        else:
            self._end = "dead"
            self._state = State.FAILED
        self._wake.set()
        streams, self._streams = self._streams, {}
        for ch in streams.values():
            if ch is not None:
                ch.fail(self._closed_error())
        calls, self._calls = self._calls, {}
        for call in calls.values():
            if self._end == "shutdown" and call.kind in ("drain", "shutdown"):
                call.result = None  # it did what was asked; the Ack was lost with the socket
            else:
                call.error = self._closed_error()
            call.event.set()

    def _end_known(self) -> bool:
        # A connection that already ended by itself keeps its reason even if we close later.
        return self._state is State.SHUTDOWN or self._failed

    def _closed_error(self) -> Exception:
        end = self._end
        if end is None:  # still deciding (see _lose)
            end = "shutdown" if self._state is State.SHUTDOWN and not self._failed else "dead"
        if end == "closed":
            return ConnectionClosed("the client is closed")
        if end == "shutdown":
            return EngineShutdownError("engine shut down")
        return EngineDeadError(self._death_message())

    def _death_message(self) -> str:
        parts = ["lost the connection to the engine" if not self._failed else "engine failed"]
        proc = self.process
        if proc is not None:
            code = proc.poll()
            parts.append(f"engine process {proc.pid} " + (
                "still running" if code is None else f"exited with code {_describe_code(code)}"))
            tail = proc.stderr_tail(3) if code not in (None, 0) and code > 0 else ""
            if tail:
                parts.append(f"last stderr: {tail}")
        cause = self._cause
        if cause is not None:
            parts.append(f"cause: {type(cause).__name__}: {cause}")
        return "; ".join(parts)

    def __repr__(self) -> str:
        return (f"<EngineClient model={self.model!r} state={self._state.value} "
                f"client_id={self.welcome.client_id}{' closed' if self._closed else ''}>")


def _describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


async def _handshake(stream: Any, token: Optional[str], client_name: str) -> tuple[Welcome, bytes]:
    """Send Hello, read the first frame: Welcome (returned with any bytes read past it) or a
    fatal Error (raised as its exception)."""
    codec = FrameCodec(EngineMessage)
    hello = Hello(protocol_version=PROTOCOL_VERSION, token=token,
                  client_name=client_name[:MAX_NAME_LEN])
    try:
        await stream.send(codec.encode(hello))
    except _STREAM_ENDED as exc:
        raise ConnectionClosed(f"connection closed during the handshake ({type(exc).__name__})") from None
    buf = bytearray()
    while True:
        if len(buf) >= HEADER_SIZE:
            (size,) = HEADER.unpack_from(buf, 0)
            if size == 0 or size > DEFAULT_MAX_FRAME:
                raise ProtocolError(f"bad frame length {size} in the engine's handshake reply")
            if len(buf) >= HEADER_SIZE + size:
                msg = codec.decode(bytes(buf[HEADER_SIZE:HEADER_SIZE + size]))
                rest = bytes(buf[HEADER_SIZE + size:])
                break
        try:
            buf += await stream.receive(_RECV_CHUNK)
        except _STREAM_ENDED as exc:
            raise ConnectionClosed(
                f"the engine closed the connection during the handshake ({type(exc).__name__})") from None
    if isinstance(msg, Error):
        raise message_to_error(msg)
    if not isinstance(msg, Welcome):
        raise ProtocolError(f"expected Welcome, got {type(msg).__name__}")
    if msg.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(f"engine answered with protocol version {msg.protocol_version}; "
                            f"this client speaks {PROTOCOL_VERSION}")
    return msg, rest


__all__ = ["EngineClient", "RemoteStream"]
