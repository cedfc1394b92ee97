"""``EngineClient``: the :class:`engine.interface.Engine` API over the wire.

::

    async with EngineClient.connect("unix:///tmp/engine.sock", token=None) as eng:
        async for out in eng.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")
        print(await eng.health())

    async with EngineClient.spawn(EngineConfig(model="random:tiny-llama")) as eng:
        ...  # a private engine process, shut down (and reaped) on exit

Semantics (the wire machinery is in :mod:`ipc.channel`):

* ``generate`` encodes its ``Generate`` frame at once, so invalid or oversize requests fail in
  the call, like the in-process engine; errors the engine reports for a request are raised by
  its iterator, at the latest on its first ``__anext__``. The client raises at once when it
  already knows the engine is draining, asleep, shut down or dead.
* When the connection ends without a clean shutdown (EOF or reset: the engine process was
  killed, even by SIGKILL), every pending and later call raises
  :class:`~engine.errors.EngineDeadError` within milliseconds; after a clean shutdown they raise
  :class:`~engine.errors.EngineShutdownError`; after our own close, ``ConnectionClosed``.
* Leaving a request's iterator early (``break`` and dropping it, ``aclose()``, garbage
  collection) sends ``Abort``; the engine frees the request's blocks.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional

import anyio
import msgspec

from engine.errors import BadRequestError
from engine.interface import Prompt, TokenizerInfo, unavailable_error
from engine.loader.tokenizer import render_chat_template
from engine.params import RequestOutput, SamplingParams
from engine.serving.pause import PAUSE_MODES
from engine.serving.sleep import MODES, check_tags
from states import State

from .channel import ClientChannel, ConnState
from .control import (AbortAll, CloseWeightTransfer, InitWeightTransfer, Pause, Resume,
                      UpdateWeightsFromDistributed, UpdateWeightsFromIpc, WeightInfoRequest)
from .handshake import HANDSHAKE_TIMEOUT, client_handshake
from .messages import (MAX_PATH_LEN, MAX_REQUEST_ID_LEN, Abort, Detokenize, Drain, Health,
                       HealthRequest, Shutdown, Sleep, Tokenize, UpdateWeights, Vocabulary, WakeUp)
from .requests import join_outputs
from .streams import RemoteStream
from .transport import connect as open_stream

if TYPE_CHECKING:  # pragma: no cover - annotations only; spawn is imported where it is used
    from engine.config import EngineConfig

#: The longest a drain may wait (the wire's bound); ``drain(None)`` means "no deadline".
_MAX_DRAIN_TIMEOUT = 1e9
_replace = msgspec.structs.replace


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no frame can carry it
        return False
    return True


class EngineClient(ClientChannel):
    """A connection to an engine process; an :class:`engine.interface.Engine`.

    Create it with :meth:`connect` (an engine already serving) or :meth:`spawn` (start a private
    engine process); both are async context managers. Not thread-safe: use it from the event
    loop it was created in (:class:`ipc.sync_client.SyncEngineClient` wraps it for threads).
    """

    @classmethod
    @asynccontextmanager
    async def connect(cls, address: str, token: Optional[str] = None, *,
                      client_name: str = "enginecore-client",
                      timeout: float = HANDSHAKE_TIMEOUT) -> AsyncIterator["EngineClient"]:
        """Connect to the engine serving on ``address`` (``unix:///path`` or
        ``tcp://host:port``) and do the handshake (within ``timeout`` seconds).

        Raises ``OSError`` if nobody listens, :class:`~ipc.errors.AuthError` /
        :class:`~ipc.errors.VersionError` / :class:`~ipc.errors.ProtocolError` if the engine
        refuses the handshake (a wrong token's answer may be held, up to half the default
        ``timeout``: ipc/auth.py), :class:`~engine.errors.EngineOverloadedError` (retryable) if
        it has too many connections, ``TimeoutError`` if it does not answer."""
        stream = await open_stream(address)
        try:
            with anyio.fail_after(timeout):
                welcome, codec, reader = await client_handshake(stream, token, client_name)
        except BaseException:
            await anyio.aclose_forcefully(stream)
            raise
        client = cls(stream, welcome, codec, reader)
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

    # ------------------------------------------------------------------ the Engine API

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
        return self.conn is not ConnState.OPEN

    @property
    def exit_code(self) -> Optional[int]:
        """A spawned engine's exit code (negative: killed by that signal), None while it runs
        or when the engine was not spawned by this client."""
        return None if self.process is None else self.process.poll()

    def tokenizer_info(self) -> TokenizerInfo:
        w = self.welcome
        return TokenizerInfo(w.chat_template, w.bos_token, w.eos_token, w.vocab_size,
                             20 if w.max_logprobs is None else w.max_logprobs)

    def on_state_change(self, listener: Callable[[State, State], None]) -> None:
        """Call ``listener(old, new)`` on every state change heard from the engine (and
        ``(old, FAILED)`` when the connection is lost)."""
        self._listeners.append(listener)

    async def wait_stopped(self) -> None:
        """Return once the engine has stopped or the connection has ended."""
        await self._stopped.wait()

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None, *, client: str = "") -> RemoteStream:
        """Submit now; iterate the result for outputs. ``client``: the user it is for (a
        client of its own on this connection: ``messages.Generate``); absent, this connection.

        Raised here: what the client can tell by itself (bad params/prompt/id ->
        ``BadRequestError``; engine known to be draining/shut down/dead). Raised by the
        iterator, at the latest on its first ``__anext__``: what the engine refuses."""
        if self.conn is not ConnState.OPEN:
            raise self._closed_error()
        if self._state is not State.SERVING and self._state is not State.PAUSED:
            raise unavailable_error(self._state, "generate", self.failure)  # paused: queued
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
        if rid in self._requests:
            raise BadRequestError(f"request_id {rid!r} is already in flight")
        frame = self._generate_frames.encode(rid, prompt, params, client or None)
        ch = self._requests.add(rid)
        self._writer.put(frame)
        return RemoteStream(rid, ch, self._abandon)

    async def complete(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None) -> RequestOutput:
        """Run one request to the end; its pieces joined in one :class:`RequestOutput`."""
        return await join_outputs(self.generate(prompt, params, request_id))

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        """Abort a request of this client; its iterator gets the final ``"abort"`` piece with
        ``reason``. Like the in-process engine, unknown ids and a stopped engine are not errors."""
        if self.conn is ConnState.OPEN and self._requests.is_running(request_id):
            self._writer.put(self._codec.encode(Abort(request_id=request_id, reason=reason[:256])))

    async def health(self) -> Health:
        """The engine's :class:`~engine.interface.Health`."""
        msg = await self._call("health", lambda cid: HealthRequest(call_id=cid))
        if self.failure is None:
            self._set_state(msg.state)
        return _replace(msg, call_id=None)

    async def drain(self, timeout: Optional[float] = None) -> None:
        """Stop admission everywhere, let running requests finish for up to ``timeout`` seconds
        (None: no deadline), abort the rest, shut the engine down. Returns when it is down."""
        t = _MAX_DRAIN_TIMEOUT if timeout is None else min(max(0.0, float(timeout)), _MAX_DRAIN_TIMEOUT)
        await self._call("drain", lambda cid: Drain(timeout=t, call_id=cid))

    async def shutdown(self) -> None:
        """``drain(0)``: abort everything in flight (terminal pieces are delivered), shut down."""
        await self._call("shutdown", lambda cid: Shutdown(call_id=cid))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, from the engine's tokenizer."""
        msg = await self._call("tokenize", lambda cid: Tokenize(
            call_id=cid, text=text, add_special_tokens=bool(add_special_tokens)))
        return list(msg.ids)

    async def detokenize(self, ids: list[int], each: bool = False,
                         tokens: bool = False) -> list[str]:
        """``[the text of ids]``, or with ``each`` one string per token, or with ``tokens`` each
        id's vocabulary entry."""
        msg = await self._call("detokenize", lambda cid: Detokenize(
            call_id=cid, ids=list(ids), each=bool(each), tokens=bool(tokens)))
        return list(msg.texts)

    async def token_bytes(self) -> list[bytes]:
        """Every token's bytes, by id (asked once, then kept: the tokenizer does not change)."""
        if self._token_bytes is None:
            if self._vocab_lock is None:  # one call in flight, the others wait for it
                self._vocab_lock = anyio.Lock()
            async with self._vocab_lock:
                if self._token_bytes is None:
                    msg = await self._call("token_bytes", lambda cid: Vocabulary(call_id=cid))
                    self._token_bytes = list(msg.pieces)
        return self._token_bytes

    # ------------------------------------------------------------------ sleep mode

    async def sleep(self, level: int = 1, mode: str = "abort", timeout: Optional[float] = None,
                    tags: Optional[list[str]] = None) -> None:
        """As :meth:`engine.AsyncEngine.sleep`: returns once the engine's device memory is freed
        (the client is told ``sleeping`` at once). ``timeout``: ``mode="wait"`` only; None or
        beyond the wire's bound (1e9 s): no limit."""
        if type(level) is not int or level not in (1, 2) or mode not in MODES:
            raise BadRequestError(f"sleep needs level 1 or 2 and mode 'abort' or 'wait'; got "
                                  f"level={level!r}, mode={mode!r}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
                raise BadRequestError(f"sleep timeout must be a number >= 0 or None, not {timeout!r}")
            timeout = None if timeout >= _MAX_DRAIN_TIMEOUT else float(timeout)
        wire = None if tags is None else list(check_tags(tags))
        await self._call("sleep", lambda cid: Sleep(level=level, mode=mode, timeout=timeout,
                                                    tags=wire, call_id=cid))

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both); ``serving`` once both are."""
        wire = None if tags is None else list(check_tags(tags))
        await self._call("wake_up", lambda cid: WakeUp(tags=wire, call_id=cid))

    @property
    def is_sleeping(self) -> bool:
        return self._state is State.SLEEPING

    async def update_weights(self, path: str, version: Optional[int] = None) -> None:
        """Load the checkpoint at ``path`` -- on the engine's machine -- into a sleeping engine's
        weights; a refused one raises ``BadRequestError`` and the old weights stay."""
        if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH_LEN or "\0" in path or (
                not path.isascii() and not _utf8(path)):
            raise BadRequestError(f"path must be a non-empty UTF-8 string of at most "
                                  f"{MAX_PATH_LEN} characters, without NUL")
        _check_version(version)
        await self._call("update_weights", lambda cid: UpdateWeights(path=path, version=version,
                                                                     call_id=cid))

    # ------------------------------------------------------------------ RL loops (ipc/control.py)

    async def pause(self, mode: str = "abort", timeout: Optional[float] = None) -> None:
        """As :meth:`engine.AsyncEngine.pause`: returns once nothing steps any more."""
        if mode not in PAUSE_MODES:
            raise BadRequestError(f"pause mode must be one of {list(PAUSE_MODES)}, not {mode!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout <= _MAX_DRAIN_TIMEOUT):
            raise BadRequestError(f"pause timeout must be a number >= 0 or None, not {timeout!r}")
        await self._call("pause", lambda cid: Pause(mode=mode, timeout=timeout, call_id=cid))

    async def resume(self) -> None:
        await self._call("resume", lambda cid: Resume(call_id=cid))

    def is_paused(self) -> bool:
        return self._state is State.PAUSED

    async def abort_all(self, reason: str = "abort_all") -> int:
        """Every request in flight in the engine (every client's) ends at the next step
        boundary with its partial output; how many there were."""
        if not isinstance(reason, str) or len(reason) > 256:
            raise BadRequestError("reason must be a string of at most 256 characters")
        msg = await self._call("abort_all", lambda cid: AbortAll(reason=reason, call_id=cid))
        return msg.count or 0

    async def weight_info(self) -> list[tuple[str, tuple[int, ...], str]]:
        msg = await self._call("weight_info", lambda cid: WeightInfoRequest(call_id=cid))
        return [(n, tuple(s), d) for n, s, d in msg.weights]

    async def init_weight_transfer(self, backend: str, address: str, port: int, rank: int,
                                   world_size: int, timeout: float = 300.0) -> None:
        """The engine (on its machine) joins the trainer's group: see engine.weight_transfer."""
        await self._call("init_weight_transfer", lambda cid: _checked(InitWeightTransfer(
            backend=backend, address=address, port=port, rank=rank, world_size=world_size,
            timeout=float(timeout), call_id=cid)))

    async def update_weights_from_distributed(self, metadata, version: Optional[int] = None,
                                              bucket_bytes: int = 256 * 2**20) -> None:
        _check_version(version)
        meta = [(n, list(s), d) for n, s, d in metadata]
        await self._call("update_weights_from_distributed", lambda cid: _checked(
            UpdateWeightsFromDistributed(metadata=meta, version=version,
                                         bucket_bytes=bucket_bytes, call_id=cid)))

    async def update_weights_from_ipc(self, handles, version: Optional[int] = None) -> None:
        """The engine opens a trainer's CUDA IPC handles on its GPU: see engine.weight_ipc."""
        _check_version(version)
        await self._call("update_weights_from_ipc", lambda cid: _checked(
            UpdateWeightsFromIpc(handles=handles, version=version, call_id=cid)))

    async def close_weight_transfer(self) -> None:
        await self._call("close_weight_transfer", lambda cid: CloseWeightTransfer(call_id=cid))

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  **options) -> str:
        """Render ``messages`` with the model's chat template, client-side (the template came
        in the handshake), exactly as ``engine.loader.tokenizer.Tokenizer.apply_chat_template``
        (``options``: ``render_chat_template``'s; nothing crosses the wire)."""
        w = self.welcome
        return render_chat_template(w.chat_template, messages, w.bos_token, w.eos_token,
                                    add_generation_prompt, **options)


    def __repr__(self) -> str:
        return (f"<EngineClient model={self.model!r} state={self._state.value} "
                f"client_id={self.welcome.client_id} {self.conn.value}>")


def _check_version(version) -> None:
    if version is not None and (type(version) is not int or not 0 <= version < 2**63):
        raise BadRequestError(f"version must be an integer >= 0, not {version!r}")


def _checked(msg):
    """``msg`` as the engine will decode it: a bad field is a BadRequestError here, naming it."""
    try:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg))
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"{type(msg).__name__}: {exc}") from None


__all__ = ["EngineClient", "ConnState", "RemoteStream"]
