"""Client-side request streams: one request's queue of pieces (filled by the client's reader
task) and the async iterator over it, plus the small loop helpers the client uses to wake it."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional

import anyio

from engine.params import RequestOutput

if TYPE_CHECKING:  # pragma: no cover
    from .client import EngineClient


class _Channel:
    """One request's queue of pieces, shared by the reader (producer) and its iterator."""

    __slots__ = ("items", "waiter", "error")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: Any = None  # an asyncio Future (asyncio) or an anyio.Event (other loops)
        self.error: Optional[BaseException] = None


class RemoteStream:
    """Async iterator of one request's outputs (like :class:`engine.async_engine.RequestStream`).

    Errors the engine reports for the request are raised by ``__anext__``. Leaving it early
    (``break`` and dropping it, ``aclose()``, ``cancel()``) aborts the request."""

    __slots__ = ("request_id", "_client", "_ch", "_done", "__weakref__")

    def __init__(self, client: "EngineClient", request_id: str, channel: _Channel) -> None:
        self.request_id = request_id
        self._client = client
        self._ch = channel
        self._done = False

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> RequestOutput:
        ch = self._ch
        while True:
            if self._done:  # finished, failed, or cancelled
                raise StopAsyncIteration
            if ch.items:
                out = ch.items.popleft()
                if out.finished:
                    self._done = True
                return out
            if ch.error is not None:
                self._done = True
                err, ch.error = ch.error, None
                raise err
            loop = self._client._loop
            if loop is not None:  # asyncio: a bare future is the cheapest way to sleep
                waiter = ch.waiter = loop.create_future()
                await waiter
            else:  # pragma: no cover - other backends
                waiter = ch.waiter = anyio.Event()
                await waiter.wait()

    @property
    def finished(self) -> bool:
        return self._done

    async def aclose(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Abort the request (if still running) and stop iterating."""
        if not self._done:
            self._done = True
            self._client._abandon(self.request_id, self._ch)

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _thread_caller() -> Callable[[Callable[[], None]], None]:
    """A way to run a callable on the current event loop from another thread, without blocking."""
    import asyncio

    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # pragma: no cover - trio backend
        pass
    try:  # pragma: no cover - trio backend
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    except Exception:  # pragma: no cover
        return lambda fn: None


def _asyncio_loop() -> Any:
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # pragma: no cover - another backend
        return None


def _set_future(fut: Any) -> None:
    if not fut.done():  # a cancelled waiter is done
        fut.set_result(None)


def _set_event(event: anyio.Event) -> None:  # pragma: no cover - other backends
    event.set()
