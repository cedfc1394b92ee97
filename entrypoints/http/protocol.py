"""OpenAI-compatible request and response bodies (pydantic models) and the error body.

Only what the engine can honour is accepted: ``n``/``best_of`` other than 1, batch prompts,
``echo``, ``suffix``, ``logprobs``, penalties, ``logit_bias``, tools and JSON response formats
are refused with a 400 naming the parameter, rather than silently ignored. Unknown fields are
ignored (clients send new parameters before servers know them). Non-OpenAI extensions, as in
vLLM (pass them with the ``openai`` client's ``extra_body``): ``top_k``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # extensions (vLLM-style)
    top_k: Optional[int] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None

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
        """The engine's SamplingParams (OpenAI defaults: temperature 1, top_p 1)."""
        if self.temperature is not None and not (0.0 <= self.temperature <= 2.0):
            raise RequestError("temperature must be between 0 and 2", param="temperature")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise RequestError("top_p must be in (0, 1]", param="top_p")
        if max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise RequestError("stop strings must be non-empty", param="stop")
        if len(stop) > 16:
            raise RequestError("at most 16 stop strings are supported", param="stop")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise RequestError("seed must be in [0, 2**63)", param="seed")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=self.top_k or 0, seed=self.seed, stop=stop,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                min_tokens=min(self.min_tokens or 0, max_tokens),
            ).validate()
        except BadRequestError as exc:
            raise RequestError(str(exc)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None

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
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None

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
    type: str = "text"


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
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
