"""enginecore's engine: the model runner, the scheduler, and the async engine loop."""

from .async_engine import AsyncEngine, EngineStats, Health, RequestStream
from .config import EngineConfig
from .errors import (BadRequestError, CheckpointError, EngineDeadError, EngineDrainingError,
                     EngineError, EngineShutdownError, InvalidTransitionError)
from .params import RequestOutput, SamplingParams
from .runner import ModelRunner

__all__ = [
    "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestStream", "Health",
    "EngineStats", "ModelRunner", "EngineError", "BadRequestError", "CheckpointError",
    "EngineDeadError", "EngineDrainingError", "EngineShutdownError", "InvalidTransitionError",
]
