"""``SyncEngineClient``: a blocking wrapper of :class:`ipc.client.EngineClient` for scripts.

::

    with SyncEngineClient.connect("unix:///tmp/engine.sock") as eng:
        for out in eng.generate("Hello", SamplingParams(max_tokens=8)):
            print(out.text, end="")
        print(eng.complete("Hello", SamplingParams(max_tokens=8)).text)

    with SyncEngineClient.spawn(EngineConfig(model="random:tiny-llama")) as eng:
        ...

The async client runs on an event loop in a background thread (anyio's blocking portal); each
call is handed to it and waited for. One client may be used from several threads.
"""

from __future__ import annotations

import functools

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

from anyio.from_thread import BlockingPortal, start_blocking_portal

from engine.interface import Health, Prompt
from engine.params import RequestOutput, SamplingParams
from states import State

from .client import EngineClient
from .streams import RemoteStream

if TYPE_CHECKING:  # pragma: no cover
    from engine.config import EngineConfig


async def _next(stream: RemoteStream) -> tuple[bool, Optional[RequestOutput]]:
    try:
        return True, await stream.__anext__()
    except StopAsyncIteration:
        return False, None


class SyncRequestStream:
    """Iterator of one request's outputs. Leaving it early (``break`` then dropping it,
    ``close()``, or using it as a context manager) aborts the request."""

    def __init__(self, portal: BlockingPortal, stream: RemoteStream) -> None:
        self._portal = portal
        self._stream: Optional[RemoteStream] = stream
        self.request_id = stream.request_id

    def __iter__(self) -> "SyncRequestStream":
        return self

    def __next__(self) -> RequestOutput:
        stream = self._stream
        if stream is None:
            raise StopIteration
        try:
            more, out = self._portal.call(_next, stream)
        except BaseException:
            self.close()
            raise
        if not more:
            self.close()
            raise StopIteration
        assert out is not None
        return out

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None and not stream.finished:
            try:
                self._portal.call(stream.aclose)
            except RuntimeError:  # the portal is closed: so is the connection
                pass

    def __enter__(self) -> "SyncRequestStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        stream, self._stream = getattr(self, "_stream", None), None
        if stream is not None and not stream.finished:
            try:  # never block in a finalizer: just schedule the abort
                self._portal.start_task_soon(stream.aclose)
            except Exception:
                pass


class SyncEngineClient:
    """Blocking version of :class:`EngineClient`; create it with :meth:`connect` or
    :meth:`spawn` (context managers)."""

    def __init__(self, portal: BlockingPortal, client: EngineClient) -> None:
        self._portal = portal
        self.client = client

    @classmethod
    @contextmanager
    def connect(cls, address: str, token: Optional[str] = None, **kw: Any) -> Iterator["SyncEngineClient"]:
        """Connect to a serving engine (see :meth:`EngineClient.connect`)."""
        with start_blocking_portal() as portal:
            with portal.wrap_async_context_manager(EngineClient.connect(address, token, **kw)) as client:
                yield cls(portal, client)

    @classmethod
    @contextmanager
    def spawn(cls, config: "EngineConfig", **kw: Any) -> Iterator["SyncEngineClient"]:
        """Start a private engine process and connect (see :meth:`EngineClient.spawn`)."""
        with start_blocking_portal() as portal:
            with portal.wrap_async_context_manager(EngineClient.spawn(config, **kw)) as client:
                yield cls(portal, client)

    # ------------------------------------------------------------------ requests

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None) -> SyncRequestStream:
        """Submit now (what the client can tell is raised here); iterate for the outputs."""
        stream = self._portal.call(self.client.generate, prompt, params, request_id)
        return SyncRequestStream(self._portal, stream)

    def complete(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None) -> RequestOutput:
        """The whole completion as one :class:`RequestOutput` (text, token_ids, finish_reason,
        num_prompt_tokens, num_output_tokens)."""
        return self._portal.call(self.client.complete, prompt, params, request_id)

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        self._portal.call(self.client.abort, request_id, reason)

    # ------------------------------------------------------------------ the engine

    def health(self) -> Health:
        return self._portal.call(self.client.health)

    def drain(self, timeout: Optional[float] = None) -> None:
        self._portal.call(self.client.drain, timeout)

    def shutdown(self) -> None:
        self._portal.call(self.client.shutdown)

    def sleep(self, level: int = 1, mode: str = "abort", timeout: Optional[float] = None) -> None:
        """Sleep mode (see :meth:`EngineClient.sleep`)."""
        self._portal.call(self.client.sleep, level, mode, timeout)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self._portal.call(self.client.wake_up, tags)

    def update_weights(self, path: str) -> None:
        self._portal.call(self.client.update_weights, path)

    @property
    def is_sleeping(self) -> bool:
        return self.client.is_sleeping

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **options) -> str:
        return self._portal.call(functools.partial(self.client.apply_chat_template, messages,
                                                   add_generation_prompt, **options))

    @property
    def state(self) -> State:
        return self.client.state

    @property
    def model(self) -> str:
        return self.client.model

    @property
    def exit_code(self) -> Optional[int]:
        return self.client.exit_code


__all__ = ["SyncEngineClient", "SyncRequestStream"]
