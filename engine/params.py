"""What callers hand in (``SamplingParams``) and get back (``RequestOutput``).

Both are msgspec Structs so the IPC layer carries them unchanged.
"""

from __future__ import annotations

from typing import Literal, Optional

import msgspec

from .errors import BadRequestError

FinishReason = Literal["stop", "length", "abort", "error"]

_MAX_STOP = 16


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """How to sample one request. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    min_tokens: int = 0

    def validate(self) -> "SamplingParams":
        """Raise :class:`BadRequestError` naming the first invalid field; return self."""
        def bad(msg: str) -> BadRequestError:
            return BadRequestError(f"invalid sampling params: {msg}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if self.top_k < 0:
            raise bad(f"top_k must be >= 0 (0 disables), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise bad(f"seed must be in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > _MAX_STOP or any(not s for s in self.stop):
            raise bad(f"stop must be at most {_MAX_STOP} non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens must be in [0, max_tokens]")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestOutput(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One streamed piece of a request's output.

    ``token_ids`` and ``text`` are the *new* tokens and text since the previous output;
    ``num_prompt_tokens`` / ``num_output_tokens`` are cumulative. Exactly one output per request
    has ``finished=True``; it carries ``finish_reason`` and, for "abort"/"error", ``reason``.
    """

    request_id: str
    token_ids: list[int] = []
    text: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    reason: Optional[str] = None
    logprobs: Optional[list[float]] = None


__all__ = ["SamplingParams", "RequestOutput", "FinishReason"]
