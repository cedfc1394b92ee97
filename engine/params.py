"""What callers hand in (``SamplingParams``) and get back (``RequestOutput``).

Both are msgspec Structs so the IPC layer carries them unchanged.
"""

from __future__ import annotations

from typing import Annotated, Iterator, Literal, NamedTuple, Optional, Sequence

import msgspec
import numpy as np

from .errors import BadRequestError
from .structured.spec import StructuredOutputs

FinishReason = Literal["stop", "length", "abort", "error"]

#: Bounds of what one request may ask for (each is also a cost the engine pays per token).
MAX_STOP = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKENS = 2**31 - 1
MAX_TOP_K = 2**31 - 1
#: Hard ceilings of the logprob and logit-processor fields (the engine's ``max_logprobs`` is
#: usually far lower; the vocabulary bounds token ids).
MAX_LOGPROBS = 1024
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 128
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
    # -- appended (older frames decode with these defaults) --------------------------------
    top_logprobs: int = 0  # with logprobs: this many most likely alternatives per token
    prompt_logprobs: Optional[int] = None  # None: off; k: the prompt tokens' logprobs + top k
    echo: bool = False  # the first output carries the prompt's tokens and text
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] = []
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Optional[int] = None  # keep only k tokens (truncation_side)
    bad_words: list[str] = []  # never in the output (engine.sample.bad_words)
    #: the output's one constraint (JSON schema, JSON object, regex, choice or grammar)
    structured: Optional[StructuredOutputs] = None
    #: "raw": logprobs of the model's distribution; "processed": of the one sampled from
    #: (after penalties, biases, grammar masks, temperature, top-k/p, min-p)
    logprobs_mode: str = "raw"
    #: which end ``truncate_prompt_tokens`` keeps: "left" drops the prompt's first tokens
    #: (keeps the last k), "right" drops its last ones (keeps the first k)
    truncation_side: str = "left"
    #: True: a prompt whose tokens plus ``max_tokens`` exceed the context is refused
    #: (``BadRequestError`` naming max_tokens), as OpenAI servers answer an explicit max_tokens;
    #: False: the output stops at the context limit (finish_reason "length")
    max_tokens_within_context: bool = False
    #: the first output carries the prompt's token ids (``RequestOutput.prompt_token_ids``)
    return_prompt_token_ids: bool = False

    def validate(self) -> "SamplingParams":
        """Raise :class:`BadRequestError` naming the first invalid field; return self."""
        def bad(msg: str) -> BadRequestError:
            return BadRequestError(f"invalid sampling params: {msg}")

        # max_tokens 0: scoring only (the prompt's logprobs), so only with prompt_logprobs
        low = 0 if self.prompt_logprobs is not None else 1
        if not _is_int(self.max_tokens) or not (low <= self.max_tokens <= MAX_TOKENS):
            raise bad(f"max_tokens must be an integer in [{low}, {MAX_TOKENS}], got {self.max_tokens!r}")
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
        self._validate_extras(bad)
        return self

    def _validate_extras(self, bad) -> None:
        if not _is_int(self.top_logprobs) or not (0 <= self.top_logprobs <= MAX_LOGPROBS):
            raise bad(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs!r}")
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not (0 <= k <= MAX_LOGPROBS)):
            raise bad(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if any(type(v) is not bool for v in (self.echo, self.skip_special_tokens,
                                             self.include_stop_str_in_output)):
            raise bad("echo, skip_special_tokens and include_stop_str_in_output must be booleans")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 0.01, 100.0), ("min_p", 0.0, 1.0)):
            v = getattr(self, name)
            if not _is_real(v) or not (lo <= v <= hi):
                raise bad(f"{name} must be a number in [{lo}, {hi}], got {v!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (1 <= t <= MAX_TOKENS)):
            raise bad(f"truncate_prompt_tokens must be an integer in [1, {MAX_TOKENS}], got {t!r}")
        lb = self.logit_bias
        if not isinstance(lb, dict) or len(lb) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
        for t, v in lb.items():
            if not _is_int(t) or not (0 <= t < 2**31) or not _is_real(v) or not (-100 <= v <= 100):
                raise bad("logit_bias must map token ids in [0, 2**31) to numbers in [-100, 100]")
        ids = self.allowed_token_ids
        if not isinstance(ids, list) or len(ids) > MAX_ALLOWED_TOKEN_IDS:
            raise bad(f"allowed_token_ids must be a list of at most {MAX_ALLOWED_TOKEN_IDS} token ids")
        if any(not _is_int(t) or not (0 <= t < 2**31) for t in ids):
            raise bad("allowed_token_ids must be integers in [0, 2**31)")
        bw = self.bad_words
        if (not isinstance(bw, list) or len(bw) > MAX_BAD_WORDS
                or any(type(w) is not str or not (0 < len(w) <= MAX_STOP_CHARS) or not w.strip()
                       for w in bw)):
            raise bad(f"bad_words must be at most {MAX_BAD_WORDS} strings of 1 to {MAX_STOP_CHARS} "
                      f"characters, not only spaces")
        if self.logprobs_mode not in ("raw", "processed"):
            raise bad(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.truncation_side not in ("left", "right"):
            raise bad(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        if any(type(v) is not bool for v in (self.max_tokens_within_context,
                                             self.return_prompt_token_ids)):
            raise bad("max_tokens_within_context and return_prompt_token_ids must be booleans")
        st = self.structured
        if st is not None:
            if not isinstance(st, StructuredOutputs):
                raise bad("structured must be StructuredOutputs")
            st.validate()

    def check_vocab(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Token ids in the params must exist in the model's vocabulary; logprob counts are
        bounded by the engine's ``max_logprobs``."""
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            for t in getattr(self, name):
                if t >= vocab_size:
                    raise BadRequestError(f"invalid sampling params: {name}: {t} is not a "
                                          f"token id of this model (vocabulary size {vocab_size})")
        for name in ("top_logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > max_logprobs:
                raise BadRequestError(f"invalid sampling params: {name} must be at most "
                                      f"{max_logprobs} (the engine's max_logprobs), got {k}")

    @property
    def needs_logits_processing(self) -> bool:
        """Penalties, biases, bad words or an allow-list change this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.allowed_token_ids or self.repetition_penalty != 1.0 or self.bad_words)

    @property
    def output_dependent_logits(self) -> bool:
        """The logits processing depends on the tokens generated so far (penalties, bad words),
        so a step's rows differ per position: such requests are not speculated. (An output
        constraint is: its matcher fills each draft position's mask, engine/structured/.)"""
        return bool(self.presence_penalty or self.frequency_penalty or self.bad_words
                    or self.repetition_penalty != 1.0)

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
    # -- appended (older frames decode with these defaults) --------------------------------
    #: with ``params.logprobs``: one row per new token (its logprob, its top alternatives),
    #: packed (:class:`Logprobs`; token ids only -- the bytes are the tokenizer's)
    token_logprobs: Optional["Logprobs"] = None
    #: with ``params.prompt_logprobs`` (or ``params.echo`` with ``logprobs``), on the first output
    #: only: one row per prompt token (the first has no logprob: nothing predicts it)
    prompt_logprobs: Optional["Logprobs"] = None
    #: with ``params.echo``, on the first output only: the prompt as text
    prompt_text: Optional[str] = None
    #: the version of the weights that produced these tokens (``update_weights*``; 0: as loaded)
    weight_version: int = 0
    #: on the first output only: prompt tokens whose K/V came from the prefix cache
    num_cached_tokens: int = 0
    #: with ``params.return_prompt_token_ids``, on the first output only: the prompt's token ids
    #: (as the engine took them: after ``truncate_prompt_tokens``)
    prompt_token_ids: Optional[list[int]] = None


class TokenLogprob(NamedTuple):
    """One token's logprob (natural log, of the model's raw distribution; None for the first
    prompt token, which nothing predicts), its rank (1 = most likely; prompt tokens only, else
    None) and the most likely tokens with theirs. A view that :class:`Logprobs` unpacks."""

    token_id: int
    logprob: Optional[float]
    rank: Optional[int]
    top_ids: list[int]
    top_logprobs: list[float]


_ROW_HEAD = 3  # token id, logprob, rank; then k top ids, then k top logprobs


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """The logprobs of consecutive tokens, packed as the engine produced them: ``rows`` holds
    one row of ``3 + 2k`` little-endian 4-byte words per token -- token id (int32), logprob
    (float32; NaN: none), rank (int32; 0: not computed), ``k`` top ids (int32), ``k`` top
    logprobs (float32). One bytes object per output, so an output costs no Python object per
    alternative until something renders it, and crosses the wire as one binary blob."""

    k: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] = 0
    rows: bytes = b""

    @property
    def width(self) -> int:
        return _ROW_HEAD + 2 * self.k

    def __len__(self) -> int:
        return len(self.rows) // (4 * self.width)

    def _words(self) -> "np.ndarray":
        return np.frombuffer(self.rows, dtype="<i4").reshape(-1, self.width)

    def __getitem__(self, index):
        """A slice (step 1): the :class:`Logprobs` of those tokens; an int: one token's
        :class:`TokenLogprob`."""
        if not isinstance(index, slice):
            n = len(self)
            i = index + n if index < 0 else index
            if not 0 <= i < n:
                raise IndexError("Logprobs index out of range")
            return self[i:i + 1].entries()[0]
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("Logprobs slices take step 1")
        w = 4 * self.width
        return Logprobs(self.k, self.rows[start * w: max(start, stop) * w])

    @classmethod
    def join(cls, parts: "Sequence[Logprobs]") -> "Logprobs":
        """``parts`` one after another (all with the same ``k``)."""
        parts = [p for p in parts if p.rows]
        if not parts:
            return cls()
        k = parts[0].k
        if any(p.k != k for p in parts):
            raise ValueError("Logprobs.join: parts with different k")
        return cls(k, b"".join(p.rows for p in parts))

    @classmethod
    def first_prompt_token(cls, token_id: int, k: int) -> "Logprobs":
        """The row of a prompt's first token: no logprob, no alternatives."""
        row = np.zeros(_ROW_HEAD + 2 * k, dtype="<i4")
        row[0] = token_id
        row[1:2].view("<f4")[0] = np.nan
        return cls(k, row.tobytes())

    @property
    def token_ids(self) -> list[int]:
        return self._words()[:, 0].tolist()

    @property
    def logprobs(self) -> list[Optional[float]]:
        return [None if v != v else v for v in self._words()[:, 1].view("<f4").tolist()]

    def entries(self) -> list[TokenLogprob]:
        """Every token's :class:`TokenLogprob` (plain Python values)."""
        a = self._words()
        k = self.k
        ids, ranks = a[:, 0].tolist(), a[:, 2].tolist()
        lps = a[:, 1].view("<f4").tolist()
        top_ids = a[:, _ROW_HEAD:_ROW_HEAD + k].tolist()
        top_lps = a[:, _ROW_HEAD + k:].view("<f4").tolist()
        return [TokenLogprob(t, None, None, [], []) if lp != lp else
                TokenLogprob(t, lp, r or None, ti, tl)
                for t, lp, r, ti, tl in zip(ids, lps, ranks, top_ids, top_lps)]

    def __iter__(self) -> "Iterator[TokenLogprob]":
        return iter(self.entries())


__all__ = ["SamplingParams", "RequestOutput", "Logprobs", "TokenLogprob", "FinishReason",
           "StructuredOutputs"]
