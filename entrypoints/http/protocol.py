"""OpenAI-compatible request and response bodies (pydantic models) and the error body.

Only what the engine can honour is accepted: ``n``/``best_of`` other than 1, batch prompts,
``echo``, ``suffix``, ``logprobs``, penalties, ``logit_bias``, tools and JSON response formats
are refused with a 400 naming the parameter, rather than silently ignored. Unknown fields are
ignored (clients send new parameters before servers know them). Non-OpenAI extensions, as in
vLLM (pass them with the ``openai`` client's ``extra_body``): ``top_k``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``.

Types are strict and every number and list is bounded here, before anything reaches the engine
(which checks again): integers are JSON integers (``true`` is not 1, ``5.0`` is not 5), numbers
accept integers but not booleans or strings, booleans are ``true``/``false`` only; a value out of
its range is a 400 naming the parameter. The bounds are :data:`MAX_INT` (2**31 - 1) for counts and
token ids, ``[0, 2**63)`` for ``seed``, :data:`MAX_STOP` stop strings of at most
:data:`MAX_STOP_CHARS` characters, :data:`MAX_STOP_TOKEN_IDS` stop ids, :data:`MAX_MESSAGES` chat
messages of at most :data:`MAX_PARTS` content parts. Prompt sizes in characters are checked by the
frontend against its ``max_prompt_chars`` (``limits.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from engine.errors import BadRequestError
from engine.params import SamplingParams


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
MAX_NAME_CHARS = 256


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


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[Name] = None
    max_tokens: Optional[_int(ge=1)] = None
    temperature: Optional[_num(0.0, 2.0)] = None
    top_p: Optional[_num(0.0, 1.0, gt=0.0)] = None
    seed: Optional[_int(ge=0, le=2**63 - 1)] = None
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)], None] = None
    n: Optional[_int(ge=1, le=128)] = 1
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[_num(-2.0, 2.0)] = None
    frequency_penalty: Optional[_num(-2.0, 2.0)] = None
    logit_bias: Optional[Annotated[dict[_str(32), _num(-100.0, 100.0)], Field(max_length=300)]] = None
    user: Optional[_str(1024)] = None
    # extensions (vLLM-style); top_k -1 or 0: disabled
    top_k: Optional[_int(ge=-1)] = None
    min_tokens: Optional[_int()] = None
    ignore_eos: Optional[StrictBool] = None
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None

    def check_common(self) -> None:
        if self.n is not None and self.n != 1:
            raise RequestError("only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported (must be 0)", param=name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", param="stream_options")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (OpenAI defaults: temperature 1, top_p 1); every value
        is already in range (the schema)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=max(0, self.top_k or 0), seed=self.seed, stop=stop,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                min_tokens=min(self.min_tokens or 0, max_tokens),
            ).validate()
        except BadRequestError as exc:
            raise RequestError(str(exc)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_Ids = Annotated[list[TokenId], Field(max_length=1 << 20)]


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, _Ids, Annotated[list[StrictStr], Field(max_length=128)],
                  Annotated[list[_Ids], Field(max_length=128)]]
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None
    logprobs: Optional[_int(le=20)] = None
    best_of: Optional[_int(ge=1, le=128)] = None

    def check(self) -> Union[str, list[int]]:
        """Validate what the engine cannot do; return the one prompt."""
        self.check_common()
        if self.echo:
            raise RequestError("echo is not supported", param="echo")
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if self.logprobs is not None:
            raise RequestError("logprobs is not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise RequestError("only best_of=1 is supported", param="best_of")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError("batch prompts are not supported; send one prompt per request",
                                   param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        return prompt


class ContentPart(_Body):
    type: _str(64)
    text: Optional[StrictStr] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
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


class ResponseFormat(_Body):
    type: _str(64) = "text"


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[_int(ge=1)] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[_int(le=20)] = None
    tools: Optional[Annotated[list[Opaque], Field(max_length=128)]] = None
    tool_choice: Optional[Opaque] = None
    functions: Optional[Annotated[list[Opaque], Field(max_length=128)]] = None
    response_format: Optional[ResponseFormat] = None

    def check(self) -> list[dict]:
        """Validate what the engine cannot do; return the messages for the chat template."""
        self.check_common()
        if self.logprobs or self.top_logprobs:
            raise RequestError("logprobs is not supported", param="logprobs")
        if self.tools or self.functions:
            raise RequestError("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise RequestError("tool_choice is not supported", param="tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            raise RequestError("only response_format type 'text' is supported",
                               param="response_format")
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(self.messages)]

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --------------------------------------------------------------------------- responses
# Plain dicts (built here, serialised once): cheaper per streamed token than models.

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, created: int, model: str, text: str, finish_reason: Optional[str],
               use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str,
                     finish_reason: Optional[str]) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_completion(rid: str, created: int, model: str, text: str, finish_reason: Optional[str],
                    use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: Optional[str]) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


__all__ = [
    "RequestError", "error_body", "CompletionRequest", "ChatCompletionRequest", "ChatMessage",
    "StreamOptions",
]
