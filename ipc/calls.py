"""The client's calls waiting for their answer (Health / Ack / Error with their ``call_id``),
and the text of the error a client raises when its engine is dead."""

from __future__ import annotations

import itertools
import signal
from typing import Any, Callable, Iterable, Optional

import anyio


class Call:
    """One call waiting for its answer."""

    __slots__ = ("event", "result", "error", "kind")

    def __init__(self, kind: str) -> None:
        self.event = anyio.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.kind = kind


class Calls:
    """Pending calls by ``call_id``: :meth:`open`, then :meth:`wait`; the reader resolves them
    with :meth:`answer` / :meth:`fail`, the end of the connection with :meth:`end`."""

    __slots__ = ("_pending", "_ids")

    def __init__(self) -> None:
        self._pending: dict[int, Call] = {}
        self._ids = itertools.count(1)

    def open(self, kind: str) -> tuple[int, Call]:
        cid = next(self._ids)
        call = self._pending[cid] = Call(kind)
        return cid, call

    async def wait(self, cid: int, call: Call) -> Any:
        try:
            await call.event.wait()
        finally:
            self._pending.pop(cid, None)
        if call.error is not None:
            try:
                raise call.error
            finally:
                call = None  # type: ignore[assignment]  # no reference cycle via the traceback
        return call.result

    def answer(self, cid: Optional[int], result: Any) -> bool:
        call = self._pending.pop(cid, None) if cid is not None else None
        if call is None:
            return False
        call.result = result
        call.event.set()
        return True

    def fail(self, cid: Optional[int], error: BaseException) -> bool:
        call = self._pending.pop(cid, None) if cid is not None else None
        if call is None:
            return False
        call.error = error
        call.event.set()
        return True

    def end(self, error: Callable[[], BaseException], done_kinds: Iterable[str] = ()) -> None:
        """The connection ended: calls of ``done_kinds`` succeed, every other one fails."""
        pending, self._pending = self._pending, {}
        for call in pending.values():
            if call.kind not in done_kinds:
                call.error = error()
            call.event.set()


def describe_exit_code(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def death_message(reason: str, process: Any, cause: Optional[BaseException]) -> str:
    """``reason``; a spawned engine ``process``'s exit code and last stderr line; ``cause``."""
    parts = [reason or "lost the connection to the engine"]
    if process is not None:
        code = process.poll()
        parts.append(f"engine process {process.pid} " + (
            "still running" if code is None else f"exited with code {describe_exit_code(code)}"))
        tail = process.stderr_tail(3) if code is not None and code > 0 else ""
        if tail:
            parts.append(f"last stderr: {tail}")
    if cause is not None:
        parts.append(f"cause: {type(cause).__name__}: {cause}")
    return "; ".join(parts)


__all__ = ["Call", "Calls", "death_message", "describe_exit_code"]
