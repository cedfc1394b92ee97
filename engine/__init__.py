"""enginecore's engine: the model runner, the scheduler, and the async engine loop.

The exports are lazy (PEP 562): ``import engine.params`` / ``import ipc`` must not pull in torch,
so the heavy modules (async_engine, config, runner) load on first attribute access only.
``from engine import AsyncEngine, EngineConfig, SamplingParams`` works as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": ".serving.async_engine",
    "EngineStats": ".core.stats",
    "Health": ".interface",
    "Engine": ".interface",
    "RequestStream": ".serving.request_stream",
    "EngineConfig": ".config",
    "BadRequestError": ".errors",
    "CheckpointError": ".errors",
    "EngineDeadError": ".errors",
    "EngineDrainingError": ".errors",
    "EngineError": ".errors",
    "EnginePausedError": ".errors",
    "EngineShutdownError": ".errors",
    "EngineSleepingError": ".errors",
    "InvalidTransitionError": ".errors",
    "RequestOutput": ".params",
    "SamplingParams": ".params",
    "StructuredOutputs": ".params",
    "ModelRunner": ".runner.model_runner",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from engine.core.stats import EngineStats
    from engine.runner.model_runner import ModelRunner
    from engine.serving.async_engine import AsyncEngine
    from engine.serving.request_stream import RequestStream

    from .config import EngineConfig
    from .errors import (BadRequestError, CheckpointError, EngineDeadError, EngineDrainingError,
                         EngineError, EnginePausedError, EngineShutdownError,
                         EngineSleepingError, InvalidTransitionError)
    from .interface import Engine, Health
    from .params import RequestOutput, SamplingParams, StructuredOutputs


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Static imports only (tests/test_no_pickle.py rejects import_module with a variable name).
    if module == ".serving.async_engine":
        from .serving import async_engine as mod
    elif module == ".config":
        from . import config as mod
    elif module == ".errors":
        from . import errors as mod
    elif module == ".interface":
        from . import interface as mod
    elif module == ".params":
        from . import params as mod
    elif module == ".serving.request_stream":
        from .serving import request_stream as mod
    elif module == ".core.stats":
        from .core import stats as mod
    else:
        from .runner import model_runner as mod
    value = getattr(mod, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "AsyncEngine", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestStream", "Health",
    "EngineStats", "ModelRunner", "EngineError", "BadRequestError", "CheckpointError",
    "EngineDeadError", "EngineDrainingError", "EnginePausedError", "EngineShutdownError",
    "EngineSleepingError", "InvalidTransitionError",
]
