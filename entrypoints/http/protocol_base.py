"""What the OpenAI-compatible request bodies share (``protocol.py`` has the completions body,
``protocol_chat.py`` the chat body): the 400 error, the bounds, the strict field types, and the
sampling fields of both routes with their checks (:class:`_SamplingFields`).

vLLM's beam search (``use_beam_search``, ``length_penalty``) is refused with a 400 naming the
field: this engine does not implement it. ``seed`` takes any 64-bit integer, as vLLM does (a
negative one maps to a generator seed deterministically). ``truncate_prompt_tokens`` keeps k
prompt tokens (-1: the context's worth), from ``truncation_side`` ("left", the default: the
last k; "right": the first k). ``return_token_ids`` adds the prompt's and the output's token ids
to the response (``choices.py``); ``return_tokens_as_token_ids`` shows logprobs' tokens as
``"token_id:N"``. ``priority`` must be 0 (the scheduler has no priorities: vLLM's answer without
its priority policy); ``spaces_between_special_tokens: false`` is refused unless special tokens
are skipped anyway (the detokenizer has no such option; with skipped special tokens vLLM ignores
it too). ``add_special_tokens`` (declared per route: true for completions, false for chat, as
vLLM) is whether a text prompt gets the tokenizer's special tokens (its BOS).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

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
#: the JSON of a request's tools, functions, tool_choice, output constraints, messages' tool
#: calls and chat template arguments together, in
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
    seed: Optional[_int(ge=-2**63, le=2**63 - 1)] = None  # vLLM's range: a 64-bit integer
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
    truncate_prompt_tokens: Optional[_int(ge=-1)] = None  # -1: the context's worth
    truncation_side: Optional[Literal["left", "right"]] = None  # None: "left"
    return_token_ids: Optional[StrictBool] = None
    return_tokens_as_token_ids: Optional[StrictBool] = None  # logprobs' tokens as "token_id:N"
    spaces_between_special_tokens: StrictBool = True  # (false: refused, see check_common)
    priority: _int(ge=-2**63, le=2**63 - 1) = 0  # (only 0: no priority scheduling)
    # beam search (vLLM's): refused, see check_common
    use_beam_search: StrictBool = False
    length_penalty: Optional[_num(-1e6, 1e6)] = None
    bad_words: Optional[Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)]] = None
    # output constraints (structured.py): OpenAI's and vLLM's ways of asking for one
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[Opaque] = None
    guided_json: Optional[Opaque] = None
    guided_regex: Optional[_str(16 * 1024)] = None
    guided_choice: Optional[_Choice] = None
    guided_grammar: Optional[_str(16 * 1024)] = None

    def check_common(self, vocab_size: int, max_logprobs: int, max_model_len: int = 0) -> None:
        """What the schema cannot tell: token ids against the vocabulary, logprob counts
        against the engine's ``max_logprobs``, the truncation against the context (each error
        names its parameter)."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
        if self.use_beam_search:
            raise RequestError("use_beam_search is not supported: this server does not implement "
                               "beam search", param="use_beam_search")
        if self.length_penalty is not None and self.length_penalty != 1.0:
            raise RequestError("length_penalty applies to beam search, which this server does not "
                               "implement", param="length_penalty")
        if self.priority:
            raise RequestError("priority scheduling is not enabled on this server (requests are "
                               "served first come, first served): priority must be 0",
                               param="priority")
        if not self.spaces_between_special_tokens and not self.skip_special_tokens:
            raise RequestError("spaces_between_special_tokens: false is not supported: this "
                               "server's detokenizer writes special tokens as its tokenizer "
                               "decodes them", param="spaces_between_special_tokens")
        self._truncate = truncation(self.truncate_prompt_tokens, max_model_len)
        check_logprobs_k("prompt_logprobs", self.prompt_logprobs, max_logprobs)
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or []:
                if vocab_size and t >= vocab_size:
                    raise RequestError(f"{name}: {t} is not a token id of this model "
                                       f"(vocabulary size {vocab_size})", param=name)
        self._bias, bad = {}, []
        for key, value in (self.logit_bias or {}).items():
            t = int(key) if key.isascii() and key.isdigit() else -1
            if not (0 <= t < (vocab_size or MAX_INT)):
                bad.append(key)
            else:
                self._bias[t] = float(value)
        if bad:  # every one named, so one answer is enough to fix the request
            shown = ", ".join(repr(k) for k in bad[:32]) + (" ..." if len(bad) > 32 else "")
            raise RequestError(f"logit_bias: {len(bad)} key(s) are not token ids of this model "
                               f"(integers below the vocabulary size {vocab_size or MAX_INT}): "
                               f"{shown}", param="logit_bias")

    def sampling_params(self, max_tokens: int, **extra) -> SamplingParams:
        """The engine's SamplingParams (OpenAI defaults: temperature 1, top_p 1); every value
        is already in range (the schema, :meth:`check_common`)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        # the generator takes [0, 2**63): a negative seed is its residue (the same every time)
        seed = None if self.seed is None else self.seed % 2**63
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=max(0, self.top_k or 0), seed=seed, stop=stop,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                min_tokens=min(self.min_tokens or 0, max_tokens),
                presence_penalty=float(self.presence_penalty or 0.0),
                frequency_penalty=float(self.frequency_penalty or 0.0),
                repetition_penalty=float(self.repetition_penalty or 1.0),
                min_p=float(self.min_p or 0.0), logit_bias=getattr(self, "_bias", {}),
                allowed_token_ids=list(self.allowed_token_ids or []),
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                truncate_prompt_tokens=getattr(self, "_truncate", self.truncate_prompt_tokens),
                truncation_side=self.truncation_side or "left",
                return_prompt_token_ids=bool(self.return_token_ids),
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


def truncation(k: Optional[int], max_model_len: int) -> Optional[int]:
    """The prompt tokens ``truncate_prompt_tokens`` keeps (vLLM's rules): -1 is the context's
    worth; more than the context, or 0, is a 400."""
    if k is None:
        return None
    if k == -1:
        if not max_model_len:
            raise RequestError("truncate_prompt_tokens -1 needs the context length, which is not "
                               "known yet", param="truncate_prompt_tokens")
        return max_model_len
    if k == 0:
        raise RequestError("truncate_prompt_tokens must be -1 or at least 1",
                           param="truncate_prompt_tokens")
    if max_model_len and k > max_model_len:
        raise RequestError(f"truncate_prompt_tokens ({k}) is greater than the context length "
                           f"({max_model_len}); choose a smaller truncation size",
                           param="truncate_prompt_tokens")
    return k

