"""What callers hand in (``SamplingParams``) and get back (``RequestOutput``).

Both are msgspec Structs so the IPC layer carries them unchanged.
"""

from __future__ import annotations

from typing import Literal, Optional

import msgspec

from .errors import BadRequestError

FinishReason = Literal["stop", "length", "abort", "error"]

#: Bounds of what one request may ask for (each is also a cost the engine pays per token).
MAX_STOP = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKENS = 2**31 - 1
MAX_TOP_K = 2**31 - 1
_INT = int


def _is_int(v) -> bool:
    return type(v) is _INT  # bool is an int subclass: not a count


def _is_real(v) -> bool:
    return type(v) in (float, _INT)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """How to sample one request. ``temperature == 0`` means greedy.

    :meth:`validate` range-checks every field (the engine calls it on every request that enters,
    in process or over the wire): whatever a caller puts here ends that request with a
    ``BadRequestError`` or is served, never more."""

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

        if not _is_int(self.max_tokens) or not (1 <= self.max_tokens <= MAX_TOKENS):
            raise bad(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise bad(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or not (0 <= self.top_k <= MAX_TOP_K):
            raise bad(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**63)):
            raise bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if (not isinstance(self.stop, list) or len(self.stop) > MAX_STOP
                or any(type(s) is not str or not (0 < len(s) <= MAX_STOP_CHARS) for s in self.stop)):
            raise bad(f"stop must be at most {MAX_STOP} non-empty strings of at most "
                      f"{MAX_STOP_CHARS} characters")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise bad(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        if any(not _is_int(t) or not (0 <= t < 2**31) for t in ids):
            raise bad("stop_token_ids must be integers in [0, 2**31)")
        if type(self.ignore_eos) is not bool or type(self.logprobs) is not bool:
            raise bad("ignore_eos and logprobs must be booleans")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            raise bad(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        return self

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the params must exist in the model's vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise BadRequestError(f"invalid sampling params: stop_token_ids: {t} is not a "
                                      f"token id of this model (vocabulary size {vocab_size})")

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
