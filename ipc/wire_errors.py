"""Errors <-> :class:`~ipc.messages.Error` frames: the frame an engine sends for an exception,
and the exception a client raises for a frame (the class the in-process engine would raise)."""

from __future__ import annotations

from engine.errors import EngineError
from states import InvalidTransitionError, State

from .errors import ErrorKind, FrameTooLargeError, spec_of, spec_of_kind
from .messages import FATAL_KINDS, MAX_ERROR_MESSAGE_LEN, MAX_NAME_LEN, Error


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_MESSAGE_LEN else text[: MAX_ERROR_MESSAGE_LEN - 3] + "..."


def error_to_message(
    exc: BaseException,
    *,
    request_id: str | None = None,
    call_id: int | None = None,
    fatal: bool | None = None,
) -> Error:
    """The :class:`Error` frame for ``exc`` (``fatal`` defaults to the kind's :data:`FATAL_KINDS`)."""
    spec = spec_of(exc)
    kind = spec.kind
    if kind is ErrorKind.INTERNAL and not isinstance(exc, (EngineError,)):
        text = f"{type(exc).__name__}: {exc}"
    else:
        text = str(exc)
    msg = Error(
        kind=kind,
        message=_clip(text),
        request_id=request_id,
        call_id=call_id,
        fatal=(kind in FATAL_KINDS) if fatal is None else fatal,
    )
    if spec.retryable:
        msg.retry_after = max(0.0, float(getattr(exc, "retry_after", 1.0)))
    elif kind is ErrorKind.INVALID_TRANSITION:
        state = getattr(exc, "state", None)
        msg.state = state if isinstance(state, State) else None
        trigger = getattr(exc, "trigger", None)
        msg.trigger = str(trigger)[:MAX_NAME_LEN] if trigger is not None else None
        allowed = getattr(exc, "allowed", None)
        if allowed is not None:
            msg.allowed = [str(a)[:MAX_NAME_LEN] for a in list(allowed)[:64]]
    return msg


def message_to_error(msg: Error) -> Exception:
    """The exception a client raises for ``msg``: the class the in-process engine would raise.

    The result carries ``request_id``, ``call_id`` and ``fatal`` attributes from the frame.
    """
    kind = msg.kind
    exc: Exception
    spec = spec_of_kind(kind)
    if spec.retryable:  # EngineDrainingError, EngineOverloadedError, EngineSleepingError
        exc = spec.exc(msg.message, retry_after=1.0 if msg.retry_after is None else msg.retry_after)
    elif kind is ErrorKind.INVALID_TRANSITION:
        if msg.state is not None and msg.trigger is not None:
            exc = InvalidTransitionError(msg.state, msg.trigger, msg.allowed or [])
        else:  # Not enough to rebuild the standard message: keep the engine's text.
            exc = InvalidTransitionError.__new__(InvalidTransitionError)
            RuntimeError.__init__(exc, msg.message)
            exc.state = msg.state  # type: ignore[assignment]
            exc.trigger = msg.trigger or ""
            exc.allowed = list(msg.allowed or [])
    elif kind is ErrorKind.TOO_LARGE:
        exc = FrameTooLargeError(message=msg.message)
    else:
        exc = spec.exc(msg.message)
    exc.request_id = msg.request_id  # type: ignore[attr-defined]
    exc.call_id = msg.call_id  # type: ignore[attr-defined]
    exc.fatal = msg.fatal  # type: ignore[attr-defined]
    return exc


__all__ = ["error_to_message", "message_to_error"]
