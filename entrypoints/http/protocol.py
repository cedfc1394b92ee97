"""OpenAI-compatible request and response bodies (pydantic models) and the error body.

Only what the engine can honour is accepted: ``best_of`` other than ``n``, ``suffix``, legacy
``functions`` and ``tool_choice: "auto"`` are refused with a 400 naming the parameter, rather
than silently ignored. Output constraints (``response_format``, ``structured_outputs``,
``guided_*``) and forced tool calls are read by ``structured.py`` (``attach``, after ``check``).
Unknown fields are ignored (clients send new parameters before servers know them). Non-OpenAI
extensions, as in vLLM (pass them with the ``openai`` client's ``extra_body``): ``top_k``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``min_p``, ``repetition_penalty``,
``allowed_token_ids``, ``prompt_logprobs``, ``bad_words``.

Types are strict and every number and list is bounded here, before anything reaches the engine
(which checks again): integers are JSON integers (``true`` is not 1, ``5.0`` is not 5), numbers
accept integers but not booleans or strings, booleans are ``true``/``false`` only; a value out of
its range is a 400 naming the parameter. The bounds are :data:`MAX_INT` (2**31 - 1) for counts and
token ids, ``[0, 2**63)`` for ``seed``, :data:`MAX_STOP` stop strings of at most
:data:`MAX_STOP_CHARS` characters, :data:`MAX_STOP_TOKEN_IDS` stop ids, :data:`MAX_MESSAGES` chat
messages of at most :data:`MAX_PARTS` content parts (:data:`MAX_TOTAL_PARTS` in all) and
:data:`MAX_TOOL_CALLS` tool calls, :data:`MAX_TOOLS` tools. ``raw_limits`` counts every list (and
the free-form JSON, :data:`MAX_SCHEMA_BYTES`) in the raw body before this schema parses it. Prompt
sizes in characters are checked by the frontend against its ``max_prompt_chars`` (``limits.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from engine.errors import BadRequestError
from engine.params import MAX_BAD_WORDS, SamplingParams


class RequestError(BadRequestError):
    """A request the frontend refuses before it reaches the engine (an OpenAI-style 400/404)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 status: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Union[str, int, None] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


MAX_INT = 2**31 - 1
MAX_STOP = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096
MAX_PARTS = 256
#: content parts of all messages together (each message: at most MAX_PARTS)
MAX_TOTAL_PARTS = 2 * MAX_MESSAGES
#: tools (as OpenAI allows) and legacy functions of a chat request; tool calls of one message
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
#: the JSON of a request's tools, functions, tool_choice and output constraints together, in
#: bytes: pydantic makes it Python objects (about 90 bytes a value), so it is bounded before
#: (``raw_limits``); a JSON schema as OpenAI's structured outputs allow it (5,000 properties,
#: 120,000 characters of names and values) takes a few hundred KiB
MAX_SCHEMA_BYTES = 1 << 20
MAX_NAME_CHARS = 256
#: choices per request (n), prompts per request, choices of all prompts together
MAX_N = 128
MAX_PROMPTS = 128
MAX_CHOICES = 256
MAX_ALLOWED = 1 << 17
MAX_LOGIT_BIAS = 300
#: token ids of one prompt (a completion's, or /detokenize's)
MAX_PROMPT_TOKENS = 1 << 20
#: strings of guided_choice, and characters of each
MAX_CHOICE = 256
MAX_CHOICE_CHARS = 1024


def _int(ge: int = 0, le: int = MAX_INT):
    return Annotated[int, Field(strict=True, ge=ge, le=le)]


def _num(ge: float, le: float, gt: Optional[float] = None):
    if gt is not None:
        return Annotated[float, Field(strict=True, gt=gt, le=le, allow_inf_nan=False)]
    return Annotated[float, Field(strict=True, ge=ge, le=le, allow_inf_nan=False)]


def _str(max_length: int, min_length: int = 0):
    return Annotated[str, Field(strict=True, min_length=min_length, max_length=max_length)]


TokenId = _int()
Name = _str(MAX_NAME_CHARS)
StopString = _str(MAX_STOP_CHARS, min_length=1)
#: Anything a client may send where we only look at whether it is there (tools, functions).
Opaque = Any


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @classmethod
    def for_prompt(cls, kind: Optional[str]) -> type:
        """The schema that parses a body whose prompt is of ``kind`` (``raw_limits.prompt_kind``)."""
        return cls


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class ResponseFormat(_Body):
    type: _str(64) = "text"
    json_schema: Optional[Opaque] = None  # {"name", "schema", "strict", "description"}


_Choice = Annotated[list[_str(MAX_CHOICE_CHARS)], Field(max_length=MAX_CHOICE)]


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[Name] = None
    max_tokens: Optional[_int(ge=1)] = None
    temperature: Optional[_num(0.0, 2.0)] = None
    top_p: Optional[_num(0.0, 1.0, gt=0.0)] = None
    seed: Optional[_int(ge=0, le=2**63 - 1)] = None
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)], None] = None
    n: Optional[_int(ge=1, le=MAX_N)] = 1
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[_num(-2.0, 2.0)] = None
    frequency_penalty: Optional[_num(-2.0, 2.0)] = None
    logit_bias: Optional[Annotated[dict[_str(32), _num(-100.0, 100.0)],
                                   Field(max_length=MAX_LOGIT_BIAS)]] = None
    user: Optional[_str(1024)] = None
    # extensions (vLLM-style); top_k -1 or 0: disabled
    top_k: Optional[_int(ge=-1)] = None
    min_tokens: Optional[_int()] = None
    ignore_eos: Optional[StrictBool] = None
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    min_p: Optional[_num(0.0, 1.0)] = None
    repetition_penalty: Optional[_num(0.01, 100.0)] = None
    allowed_token_ids: Optional[Annotated[list[TokenId], Field(max_length=MAX_ALLOWED)]] = None
    prompt_logprobs: Optional[_int()] = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    truncate_prompt_tokens: Optional[_int(ge=1)] = None
    bad_words: Optional[Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)]] = None
    # output constraints (structured.py): OpenAI's and vLLM's ways of asking for one
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[Opaque] = None
    guided_json: Optional[Opaque] = None
    guided_regex: Optional[_str(16 * 1024)] = None
    guided_choice: Optional[_Choice] = None
    guided_grammar: Optional[_str(16 * 1024)] = None

    def check_common(self, vocab_size: int, max_logprobs: int) -> None:
        """What the schema cannot tell: token ids against the vocabulary, logprob counts
        against the engine's ``max_logprobs`` (each error names its parameter)."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
        check_logprobs_k("prompt_logprobs", self.prompt_logprobs, max_logprobs)
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or []:
                if vocab_size and t >= vocab_size:
                    raise RequestError(f"{name}: {t} is not a token id of this model "
                                       f"(vocabulary size {vocab_size})", param=name)
        self._bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                t = int(key)
            except ValueError:
                raise RequestError(f"logit_bias: key {key!r} is not a token id",
                                   param="logit_bias") from None
            if not (0 <= t < (vocab_size or MAX_INT)):
                raise RequestError(f"logit_bias: token id {t} is out of vocabulary "
                                   f"(vocabulary size {vocab_size})", param="logit_bias")
            self._bias[t] = float(value)

    def sampling_params(self, max_tokens: int, **extra) -> SamplingParams:
        """The engine's SamplingParams (OpenAI defaults: temperature 1, top_p 1); every value
        is already in range (the schema, :meth:`check_common`)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=max(0, self.top_k or 0), seed=self.seed, stop=stop,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                min_tokens=min(self.min_tokens or 0, max_tokens),
                presence_penalty=float(self.presence_penalty or 0.0),
                frequency_penalty=float(self.frequency_penalty or 0.0),
                repetition_penalty=float(self.repetition_penalty or 1.0),
                min_p=float(self.min_p or 0.0), logit_bias=getattr(self, "_bias", {}),
                allowed_token_ids=list(self.allowed_token_ids or []),
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                bad_words=list(self.bad_words or []),
                structured=getattr(self, "_constraint", None), **extra,  # structured.attach
            ).validate()
        except BadRequestError as exc:
            raise RequestError(str(exc)) from None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def check_logprobs_k(param: str, k: Optional[int], max_logprobs: int) -> None:
    if k is not None and k > max_logprobs:
        raise RequestError(f"{param} must be at most {max_logprobs} (the server's --max-logprobs), "
                           f"got {k}", param=param)


_Ids = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
#: all prompts of one request together, in tokens (a batch of token-id lists)
MAX_BATCH_TOKENS = 1 << 22


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, _Ids, Annotated[list[StrictStr], Field(max_length=MAX_PROMPTS)],
                  Annotated[list[_Ids], Field(max_length=MAX_PROMPTS)]]
    max_tokens: Optional[_int(ge=0)] = None
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None
    logprobs: Optional[_int()] = None
    best_of: Optional[_int(ge=1, le=MAX_N)] = None

    def check(self, vocab_size: int = 0, max_logprobs: int = 20) -> list[Union[str, list[int]]]:
        """Validate what the schema cannot tell; return the prompts (one choice group each)."""
        self.check_common(vocab_size, max_logprobs)
        check_logprobs_k("logprobs", self.logprobs, max_logprobs)
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of < self.num_choices:
            raise RequestError("best_of must be at least n", param="best_of")
        if self.best_of is not None and self.best_of > self.num_choices and self.stream:
            raise RequestError("best_of > n cannot be streamed", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens 0 needs echo (scoring the prompt only)", param="max_tokens")
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], (str, list)):
            prompts = [prompt]  # one prompt: a string or a list of token ids
        else:
            prompts = prompt
        if not prompts or any(not p for p in prompts):
            raise RequestError("prompt must not be empty", param="prompt")
        if len(prompts) * self.num_candidates > MAX_CHOICES:
            raise RequestError(f"at most {MAX_CHOICES} choices (prompts x n) per request",
                               param="n")
        total = 0
        for i, p in enumerate(prompts):
            if isinstance(p, list):
                total += len(p)
                if vocab_size and max(p) >= vocab_size:
                    raise RequestError(f"prompt {i}: token id {max(p)} is out of vocabulary "
                                       f"(vocabulary size {vocab_size})", param="prompt")
        if total > MAX_BATCH_TOKENS:
            raise RequestError(f"the prompts have {total} tokens; at most {MAX_BATCH_TOKENS} "
                               f"per request", param="prompt")
        return prompts

    @classmethod
    def for_prompt(cls, kind: Optional[str]) -> type:
        """The schema with the prompt's one member when its kind is known (a long prompt):
        the same fields and checks, no union to try."""
        return _PROMPT_SCHEMAS.get(kind, cls) if cls is CompletionRequest else cls

    @property
    def num_candidates(self) -> int:
        """Completions generated per prompt: ``best_of`` (the best ``n`` are returned) or ``n``."""
        return max(self.best_of or 1, self.num_choices)

    def engine_params(self, max_tokens: int, index: int) -> SamplingParams:
        """Choice ``index``'s parameters: seeded from ``seed`` (seed + index) so runs repeat.
        Candidates of ``best_of`` are ranked by their summed logprobs, so they carry logprobs."""
        k = self.logprobs
        plp = self.prompt_logprobs
        if self.echo and (k is not None or max_tokens == 0):
            plp = max(plp or 0, k or 0)
        ranked = self.num_candidates > self.num_choices
        params = self.sampling_params(max_tokens, logprobs=k is not None or ranked,
                                      top_logprobs=k or 0, prompt_logprobs=plp,
                                      echo=bool(self.echo))
        if params.seed is not None and index:
            params.seed = (params.seed + index) % 2**63
        return params


class _OneText(CompletionRequest):
    prompt: StrictStr


class _OneIds(CompletionRequest):
    prompt: _Ids


class _Texts(CompletionRequest):
    prompt: Annotated[list[StrictStr], Field(max_length=MAX_PROMPTS)]


class _IdLists(CompletionRequest):
    prompt: Annotated[list[_Ids], Field(max_length=MAX_PROMPTS)]


#: Why: pydantic tries a union's members in turn, and a member that fails on each entry keeps
#: each entry, made a Python object, in its error: a batch of 1.6 M token ids (8 MiB) peaked at
#: +263 MB through the union, +113 MB parsed as a batch alone (the ids themselves are 59 MB).
_PROMPT_SCHEMAS = {"text": _OneText, "ids": _OneIds, "texts": _Texts, "id_lists": _IdLists}


class ContentPart(_Body):
    type: _str(64)
    text: Optional[StrictStr] = None


class ChatMessage(_Body):
    #: lists of a message this schema ignores (not rendered) but ``raw_limits`` bounds
    RAW_LISTS: ClassVar[dict[str, int]] = {"tool_calls": MAX_TOOL_CALLS}

    role: _str(64, min_length=1)  # any role the chat template renders
    content: Union[StrictStr, Annotated[list[ContentPart], Field(max_length=MAX_PARTS)], None] = None
    name: Optional[Name] = None

    def chars(self) -> int:
        """The characters of the content (what the chat template will render)."""
        if self.content is None:
            return 0
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(p.text or "") for p in self.content)

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise RequestError(f"content parts of type {part.type!r} are not supported",
                                   param=f"messages.[{index}].content")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[_int(ge=1)] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[_int()] = None
    tools: Optional[Annotated[list[Opaque], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Opaque] = None
    functions: Optional[Annotated[list[Opaque], Field(max_length=MAX_TOOLS)]] = None

    def check(self, vocab_size: int = 0, max_logprobs: int = 20) -> list[dict]:
        """Validate what the schema cannot tell; return the messages for the chat template."""
        self.check_common(vocab_size, max_logprobs)
        check_logprobs_k("top_logprobs", self.top_logprobs, max_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.functions:
            raise RequestError("functions (the legacy form) are not supported: use tools",
                               param="functions")
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(self.messages)]

    def engine_params(self, max_tokens: int, index: int) -> SamplingParams:
        params = self.sampling_params(max_tokens, logprobs=bool(self.logprobs),
                                      top_logprobs=self.top_logprobs or 0,
                                      prompt_logprobs=self.prompt_logprobs)
        if params.seed is not None and index:
            params.seed = (params.seed + index) % 2**63
        return params

    @property
    def tool_mode(self):
        """How the output becomes a tool call (structured.ToolMode), or None."""
        return getattr(self, "_tools", None)

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


__all__ = [
    "RequestError", "error_body", "CompletionRequest", "ChatCompletionRequest", "ChatMessage",
    "StreamOptions",
]
