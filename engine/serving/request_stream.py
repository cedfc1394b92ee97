"""``RequestStream``: what ``AsyncEngine.generate`` returns — one request's outputs as an async
iterator, fed by the engine loop through a sink that does not keep the stream alive."""

from __future__ import annotations

from asyncio import get_running_loop
from typing import Callable, Union

from engine.params import RequestOutput

from .mailbox import Mailbox
from .output_merge import merge_outputs

#: Where the engine loop delivers a request's outputs (or the error that ends it).
Sink = Callable[[Union[RequestOutput, BaseException]], None]


class RequestStream:
    """Async iterator of one request's outputs. Leaving it early (``break``, ``aclose()``, a
    cancellation while it waits, or dropping it) aborts the request and frees its blocks.

    A consumer that fell behind gets what is pending as one piece (:func:`merge_outputs`): the
    same tokens and text in the same order, in fewer pieces; the terminal one is always last."""

    def __init__(self, request_id: str, abort: Callable[[str, str], None]):
        """``abort(request_id, reason)``: how to abort the request if it is left early (the
        engine's non-blocking abort)."""
        self.request_id = request_id
        self._abort = abort
        self._box = Mailbox()
        self._done = False

    def sink(self) -> Sink:
        # NOTE: the sink must not reference the stream itself, or the engine would keep an
        # abandoned stream alive and dropping it could not abort the request.
        return self._box.put

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        box = self._box
        items = box.items
        try:
            while not items:  # the engine always sends a terminal item or an error
                try:
                    future = box._waiter = get_running_loop().create_future()
                except RuntimeError:  # pragma: no cover - not asyncio (trio)
                    await box.wait()
                else:
                    await future
        except BaseException:  # cancelled while waiting (a task group, a timeout): the consumer
            self.cancel()  # has left, as with ``break`` -- not a request running on unread
            raise  # until the stream object happens to be collected
        item = items.popleft()
        if isinstance(item, BaseException):
            self._close()
            raise item
        if items and not isinstance(items[0], BaseException):  # fell behind: one piece for all
            parts = [item]
            while items and not isinstance(items[0], BaseException):
                parts.append(items.popleft())
            item = merge_outputs(parts)
        if item.finished:
            self._close()
        return item

    def _close(self) -> None:
        self._done = True
        self._box.close()

    async def aclose(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        if not self._done:
            self._close()
            self._abort(self.request_id, "client stopped reading")

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
