"""The chat request body (``/v1/chat/completions``; ``/tokenize`` with messages renders them
the same way): the messages, and what the chat template is rendered with, as vLLM takes them.

The template gets each message's ``role``, ``content`` (text parts joined), ``name``,
``tool_call_id`` and ``tool_calls`` (an assistant's calls' ``arguments`` parsed from their
JSON text, as transformers' tool-use templates expect), the request's ``tools`` and
``documents``, and ``chat_template_kwargs`` (names the template reads, e.g. ``enable_thinking``);
``add_generation_prompt`` (default true) or ``continue_final_message`` (the last message left
open for the model to continue; not with ``add_generation_prompt``). A request's own
``chat_template`` is refused: the server renders with the model's. The answer's role is
"assistant" with the generation prompt, else the last message's; ``echo`` puts the last message's
content before the answer when their roles agree (``choices.py``).
"""

from __future__ import annotations

import json
from typing import Annotated, Optional, Union

from pydantic import Field, StrictBool, StrictStr

from engine.loader.tokenizer import RESERVED_TEMPLATE_NAMES
from engine.params import SamplingParams

from .protocol_base import (MAX_MESSAGES, MAX_PARTS, MAX_TOOL_CALLS, MAX_TOOLS, Name, Opaque,
                            RequestError, _Body, _int, _SamplingFields, _str, check_logprobs_k)

#: documents (RAG) of a chat request, and the string fields of one
MAX_DOCUMENTS = 256
MAX_DOCUMENT_FIELDS = 16
#: names in chat_template_kwargs (their values count as free-form JSON: raw_limits)
MAX_TEMPLATE_KWARGS = 64


class ContentPart(_Body):
    type: _str(64)
    text: Optional[StrictStr] = None


class ChatMessage(_Body):
    role: _str(64, min_length=1)  # any role the chat template renders
    content: Union[StrictStr, Annotated[list[ContentPart], Field(max_length=MAX_PARTS)], None] = None
    name: Optional[Name] = None
    tool_call_id: Optional[_str(256)] = None
    tool_calls: Optional[Annotated[list[Opaque], Field(max_length=MAX_TOOL_CALLS)]] = None

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

    def for_template(self, index: int) -> dict:
        """The message as the chat template reads it."""
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": self.text(index)}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = [_call_for_template(c, f"messages.[{index}].tool_calls.[{j}]")
                                 for j, c in enumerate(self.tool_calls)]
        return out


def _call_for_template(call, param: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError("a tool call must be {\"type\": \"function\", \"function\": {\"name\": "
                           "..., \"arguments\": ...}}", param=param)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # (nesting past the parser's depth: not JSON here)
            raise RequestError("a tool call's arguments must be JSON", param=f"{param}.function."
                               "arguments") from None
    return {**call, "function": {**fn, "arguments": args}}


_Document = Annotated[dict[_str(256), StrictStr], Field(max_length=MAX_DOCUMENT_FIELDS)]


class ChatTemplateFields(_Body):
    """How messages are rendered (shared with ``/tokenize``)."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: Optional[Annotated[list[Opaque], Field(max_length=MAX_TOOLS)]] = None
    documents: Optional[Annotated[list[_Document], Field(max_length=MAX_DOCUMENTS)]] = None
    chat_template_kwargs: Optional[Annotated[dict[_str(256), Opaque],
                                             Field(max_length=MAX_TEMPLATE_KWARGS)]] = None
    chat_template: Optional[StrictStr] = None

    def template_options(self, messages: list[dict]) -> dict:
        """``apply_chat_template``'s keyword arguments (each bad one a 400 naming it)."""
        if self.chat_template is not None:
            raise RequestError("chat_template is not accepted: this server renders with the "
                               "model's own chat template", param="chat_template")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be "
                               "true (send add_generation_prompt: false)",
                               param="continue_final_message")
        if self.continue_final_message and not (messages and messages[-1]["content"].strip()):
            raise RequestError("continue_final_message needs a last message with text content",
                               param="continue_final_message")
        kwargs = dict(self.chat_template_kwargs or {})
        for key in kwargs:
            if key in RESERVED_TEMPLATE_NAMES:
                raise RequestError(f"chat_template_kwargs may not set {key!r} (a request field, "
                                   f"or the renderer's own)", param=f"chat_template_kwargs.{key}")
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "tools": self.tools,
                "documents": self.documents, "template_kwargs": kwargs}

    def template_chars(self) -> int:
        """Characters the documents add to the rendered prompt."""
        return sum(len(k) + len(v) for d in self.documents or () for k, v in d.items())


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [m.for_template(i) for i, m in enumerate(messages)]


class ChatCompletionRequest(ChatTemplateFields, _SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[_int(ge=1)] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[_int()] = None
    tool_choice: Optional[Opaque] = None
    functions: Optional[Annotated[list[Opaque], Field(max_length=MAX_TOOLS)]] = None
    echo: StrictBool = False
    #: the tokenizer's special tokens (its BOS) added to the rendered prompt: off, as vLLM, since
    #: the chat template writes them itself
    add_special_tokens: StrictBool = False

    def check(self, vocab_size: int = 0, max_logprobs: int = 20,
              max_model_len: int = 0) -> list[dict]:
        """Validate what the schema cannot tell; return the messages for the chat template."""
        self.check_common(vocab_size, max_logprobs, max_model_len)
        check_logprobs_k("top_logprobs", self.top_logprobs, max_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.functions:
            raise RequestError("functions (the legacy form) are not supported: use tools",
                               param="functions")
        return template_messages(self.messages)

    def engine_params(self, max_tokens: int, index: int) -> SamplingParams:
        params = self.sampling_params(max_tokens, logprobs=bool(self.logprobs),
                                      top_logprobs=self.top_logprobs or 0,
                                      prompt_logprobs=self.prompt_logprobs,
                                      max_tokens_within_context=self.requested_max_tokens is not None)
        if params.seed is not None and index:
            params.seed = (params.seed + index) % 2**63
        return params

    @property
    def role(self) -> str:
        """The answer's role: "assistant" after a generation prompt, else the last message's."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echoed(self) -> str:
        """What ``echo`` puts before the answer: the last message's content, when its role is
        the answer's (vLLM's rule)."""
        last = self.messages[-1]
        return last.text(len(self.messages) - 1) if self.echo and last.role == self.role else ""

    @property
    def tool_mode(self):
        """How the output becomes a tool call (structured.ToolMode), or None."""
        return getattr(self, "_tools", None)

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


__all__ = ["ContentPart", "ChatMessage", "ChatTemplateFields", "ChatCompletionRequest",
           "template_messages", "MAX_DOCUMENTS", "MAX_TEMPLATE_KWARGS"]
