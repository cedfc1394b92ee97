"""Every error the engine raises to its callers, in one module.

The IPC layer maps each class to an ``ErrorKind`` so a client raises the same type the
in-process engine would.
"""

from __future__ import annotations

from states import InvalidTransitionError


class EngineError(Exception):
    """Base class of the engine's own errors."""


class BadRequestError(EngineError, ValueError):
    """Invalid sampling parameters or prompt (e.g. longer than the model's context)."""


class EngineDrainingError(EngineError):
    """The engine is draining and accepts no new requests. Retry on another replica."""

    retryable = True

    def __init__(self, message: str = "engine is draining; not accepting new requests",
                 retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineOverloadedError(EngineError):
    """The engine's admission limits are reached (waiting requests or queued prompt tokens).
    Nothing was queued; retry later or on another replica."""

    retryable = True

    def __init__(self, message: str = "engine is overloaded; retry later", retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineSleepingError(EngineError):
    """The engine is asleep (sleep mode: its device memory is freed) and accepts no new
    requests until it is woken. Retry later or on another replica."""

    retryable = True

    def __init__(self, message: str = "engine is sleeping; not accepting new requests",
                 retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EnginePausedError(EngineError):
    """The engine is paused (``pause()``, e.g. for a weight update) and was told to refuse new
    requests meanwhile (``EngineConfig.reject_while_paused``). Retry after ``resume()``."""

    retryable = True

    def __init__(self, message: str = "engine is paused; not accepting new requests",
                 retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineShutdownError(EngineError):
    """The engine has shut down; nothing can be submitted or queried that needs the device."""


class EngineDeadError(EngineError):
    """The engine failed (an exception in a step, a lost device, or its process died)."""

    def __init__(self, message: str = "engine is dead", cause: BaseException | None = None):
        super().__init__(message if cause is None else f"{message}: {cause!r}")
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause


class CheckpointError(EngineError):
    """A model checkpoint could not be loaded: names the file and the problem."""

    def __init__(self, path: object, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


__all__ = [
    "EngineError", "BadRequestError", "EngineDrainingError", "EngineOverloadedError", "EngineSleepingError",
    "EngineShutdownError",
    "EngineDeadError", "CheckpointError", "InvalidTransitionError",
]
