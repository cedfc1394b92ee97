"""Client-side request streams: the async iterator over one request's mailbox (filled by the
client's reader task), plus the helper the client uses to reach its loop from other threads.

A stream knows nothing of the client: it gets the one thing it needs, a callback that aborts its
request (``abandon(request_id, mailbox)``), so the dependency runs one way (client -> streams).
"""

from __future__ import annotations

from typing import Callable

from engine.params import RequestOutput
from engine.serving.mailbox import Mailbox

#: ``abandon(request_id, mailbox)``: the iterator went away; abort the request (any thread).
Abandon = Callable[[str, Mailbox], None]


class RemoteStream:
    """Async iterator of one request's outputs (like :class:`engine.serving.request_stream.RequestStream`).

    Errors the engine reports for the request are raised by ``__anext__``. Leaving it early
    (``break`` and dropping it, ``aclose()``, ``cancel()``, a cancellation while it waits)
    aborts the request."""

    __slots__ = ("request_id", "_abandon", "_ch", "_done", "__weakref__")

    def __init__(self, request_id: str, channel: Mailbox, abandon: Abandon) -> None:
        self.request_id = request_id
        self._abandon = abandon
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
            try:
                await ch.wait()
            except BaseException:  # cancelled while waiting: the consumer left (as ``break``)
                self.cancel()
                raise

    @property
    def finished(self) -> bool:
        return self._done

    async def aclose(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Abort the request (if still running) and stop iterating."""
        if not self._done:
            self._done = True
            self._abandon(self.request_id, self._ch)

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def thread_caller() -> Callable[[Callable[[], None]], None]:
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
