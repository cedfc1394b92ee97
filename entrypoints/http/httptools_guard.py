"""uvicorn's httptools protocol (llhttp, in C) with the same protections as the h11 one.

Receiving bytes through h11 costs Python per byte and per event; llhttp parses in C. But llhttp
has no limit on a request head's size, and httptools accumulates a header's name and value in
its own buffers until the header ends, across reads -- one endless header value would grow
without bound (until the head timer, which at loopback speed is gigabytes). h11 refuses a head
over ``max_incomplete_event_size``; :class:`GuardedHttpTools` gives the same bound,
:data:`MAX_HEAD_BYTES`, by counting (no well-kept library does this for httptools):

* in the callbacks: the URL and every complete header (a chunked body's trailers too), since
  the message began;
* per read: a read in which the parser made no progress (no message begun, no head completed,
  no body byte, no message completed) is all head, trailer or framing bytes, so the bytes
  received since the last progress grow by its whole length; a read with progress restarts the
  count from what the callbacks counted after the progress (a lower bound: the count never
  exceeds the bytes truly held, so no head under the bound is refused, and what is held stays
  under the bound plus one read).

Past the bound: 400 and close, as uvicorn's h11 protocol answers an oversized head.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .conn_guard import MAX_HEAD_BYTES, ConnectionGuard, refusals

_INVALID = "Invalid HTTP request received."


class _HeadTooLarge(Exception):
    pass


class GuardedHttpTools(ConnectionGuard, HttpToolsProtocol):
    """uvicorn's httptools protocol with the head timer, the connection cap and the head-size
    bound (module docstring)."""

    _progress = False
    _counted = 0  # header bytes seen by the callbacks since the last progress
    _held = 0  # lower bound of the non-body bytes received since the last progress

    def data_received(self, data: bytes) -> None:
        self._progress = False
        super().data_received(data)  # a callback's _HeadTooLarge: answered 400 there
        if self.transport.is_closing():
            return
        self._held = self._counted if self._progress else self._held + len(data)
        if self._held > MAX_HEAD_BYTES:
            self._refuse()

    # the parser's callbacks
    def on_message_begin(self) -> None:
        self._made_progress()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._made_progress()
        super().on_headers_complete()
        if self._head_complete():
            self._disarm()

    def on_body(self, body: bytes) -> None:
        self._made_progress()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._made_progress()
        super().on_message_complete()

    # the count
    def _made_progress(self) -> None:
        self._progress = True
        self._counted = 0

    def _count(self, n: int) -> None:
        self._counted += n
        if self._counted > MAX_HEAD_BYTES:
            refusals.note("head too large")
            # httptools re-raises it as HttpParserCallbackError, an HttpParserError: uvicorn's
            # data_received answers 400 and closes
            raise _HeadTooLarge

    def _refuse(self) -> None:
        refusals.note("head too large")
        if self.cycle is not None and self.cycle.response_started \
                and not self.cycle.response_complete:
            self.transport.close()  # a response is on its way: no 400 into the middle of it
        else:
            self.send_400_response(_INVALID)


__all__ = ["GuardedHttpTools"]
