"""The client's side of its requests: the table of open request mailboxes the reader fills,
the check and encoding of a ``Generate`` frame, and joining a request's pieces."""

from __future__ import annotations

from typing import Annotated, Any, Callable, Optional

import msgspec

from engine.errors import BadRequestError
from engine.params import Logprobs, RequestOutput, SamplingParams
from engine.serving.mailbox import Mailbox

from .errors import FrameTooLargeError
from .framing import HEADER_SIZE, FrameCodec
from .messages import Generate

_replace = msgspec.structs.replace


class RequestTable:
    """Request id -> its mailbox; ``None`` for a request we aborted whose terminal piece has not
    arrived yet (its id stays reserved until then)."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: dict[str, Optional[Mailbox]] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._open

    def __len__(self) -> int:
        return len(self._open)

    def add(self, rid: str) -> Mailbox:
        ch = self._open[rid] = Mailbox()
        return ch

    def is_running(self, rid: str) -> bool:
        return self._open.get(rid) is not None

    def abandon(self, rid: str, ch: Mailbox) -> bool:
        """Mark ``rid`` aborted by us; False if it already ended (or is another request)."""
        if self._open.get(rid) is not ch:
            return False
        self._open[rid] = None
        return True

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One ``Outputs`` frame: each piece into its mailbox (synchronously, in order)."""
        table = self._open
        for out in outputs:
            rid = out.request_id
            if rid not in table:
                continue
            ch = table[rid]
            if out.finished:
                del table[rid]
            if ch is not None:
                ch.put(out)

    def fail(self, rid: Optional[str], error: Callable[[], BaseException]) -> bool:
        """End ``rid`` with ``error()``; False if it is not open."""
        if rid is None or rid not in self._open:
            return False
        ch = self._open.pop(rid)
        if ch is not None:
            ch.fail(error())
        return True

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        table, self._open = self._open, {}
        for ch in table.values():
            if ch is not None:
                ch.fail(error())


class GenerateEncoder:
    """Checks and frames ``Generate`` messages, so a request the engine would refuse as a
    protocol violation (which drops the whole connection) fails in the caller instead."""

    __slots__ = ("_codec", "_check", "vocab_size", "_ids")

    def __init__(self, codec: FrameCodec, vocab_size: int) -> None:
        self._codec = codec
        self._check = msgspec.msgpack.Decoder(Generate)
        self.vocab_size = vocab_size
        # every id an int (not a bool: msgspec is strict) in range, in one C pass
        self._ids = list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size or 2**31)]]

    def encode(self, rid: str, prompt: Any, params: SamplingParams,
               client: Optional[str] = None) -> bytes:
        if isinstance(prompt, list):
            try:
                prompt = msgspec.convert(prompt, self._ids)
            except msgspec.ValidationError:
                bound = f"[0, {self.vocab_size})" if self.vocab_size else "[0, 2**31)"
                raise BadRequestError(f"prompt token ids must be ints in {bound}") from None
        elif not isinstance(prompt, str):
            raise BadRequestError("prompt must be a string or a list of token ids")
        try:
            frame = self._codec.encode(Generate(request_id=rid, prompt=prompt, params=params,
                                                client=client))
        except FrameTooLargeError as exc:
            raise BadRequestError(f"request too large: {exc}") from None
        except (TypeError, ValueError, OverflowError) as exc:  # msgspec.EncodeError is a ValueError
            raise BadRequestError(f"cannot encode the request: {exc}") from None
        try:  # the engine's own schema (bounds included); cheap
            self._check.decode(memoryview(frame)[HEADER_SIZE:])
        except msgspec.ValidationError as exc:
            raise BadRequestError(f"invalid request: {exc}") from None
        return frame


async def join_outputs(stream: Any) -> RequestOutput:
    """Iterate ``stream`` to its end; its pieces joined in one :class:`RequestOutput`. Leaving
    early (an error, cancellation) cancels the stream."""
    text: list[str] = []
    ids: list[int] = []
    logprobs: Optional[list[float]] = None
    rows: list[Logprobs] = []
    prompt: Optional[Logprobs] = None
    last: Optional[RequestOutput] = None
    try:
        async for out in stream:
            text.append(out.text)
            ids.extend(out.token_ids)
            if out.logprobs is not None:
                logprobs = (logprobs or []) + list(out.logprobs)
            if out.token_logprobs is not None:
                rows.append(out.token_logprobs)
            if prompt is None:
                prompt = out.prompt_logprobs
            last = out
    finally:
        stream.cancel()
    assert last is not None and last.finished
    return _replace(last, token_ids=ids, text="".join(text), logprobs=logprobs,
                    token_logprobs=Logprobs.join(rows) if rows else None, prompt_logprobs=prompt)


__all__ = ["RequestTable", "GenerateEncoder", "join_outputs"]
