"""OpenAI-compatible request bodies (pydantic models) and the error body: the completions body
here, the chat body in ``protocol_chat.py``, what they share in ``protocol_base.py`` (all of it
importable from here).

Only what the engine can honour is accepted: ``best_of`` other than ``n``, ``suffix``, legacy
``functions``, ``tool_choice: "auto"`` and beam search are refused with a 400 naming the
parameter, rather than silently ignored. Output constraints (``response_format``,
``structured_outputs``, ``guided_*``) and forced tool calls are read by ``structured.py``
(``attach``, after ``check``). Unknown fields are ignored (clients send new parameters before
servers know them). Non-OpenAI extensions, as in vLLM (pass them with the ``openai`` client's
``extra_body``): ``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``min_p``,
``repetition_penalty``, ``allowed_token_ids``, ``prompt_logprobs``, ``bad_words``,
``truncate_prompt_tokens`` / ``truncation_side``, ``return_token_ids``; chat's ``echo``,
``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``, ``documents``.

Types are strict and every number and list is bounded here, before anything reaches the engine
(which checks again): integers are JSON integers (``true`` is not 1, ``5.0`` is not 5), numbers
accept integers but not booleans or strings, booleans are ``true``/``false`` only; a value out of
its range is a 400 naming the parameter. The bounds are :data:`MAX_INT` (2**31 - 1) for counts and
token ids, a 64-bit integer for ``seed``, :data:`MAX_STOP` stop strings of at most
:data:`MAX_STOP_CHARS` characters, :data:`MAX_STOP_TOKEN_IDS` stop ids, :data:`MAX_MESSAGES` chat
messages of at most :data:`MAX_PARTS` content parts (:data:`MAX_TOTAL_PARTS` in all) and
:data:`MAX_TOOL_CALLS` tool calls, :data:`MAX_TOOLS` tools. ``raw_limits`` counts every list (and
the free-form JSON, :data:`MAX_SCHEMA_BYTES`) in the raw body before this schema parses it. Prompt
sizes in characters are checked by the frontend against its ``max_prompt_chars`` (``limits.py``).

A completion's ``max_tokens`` (16 when not given, as OpenAI's) must fit the context with the
prompt: the engine refuses it otherwise (a 400 naming it), as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import Field, StrictBool, StrictStr

from engine.params import SamplingParams

from .protocol_base import *  # noqa: F401,F403 (the shared names, importable from here)
from .protocol_base import (MAX_CHOICES, MAX_N, MAX_PROMPT_TOKENS, MAX_PROMPTS,  # noqa: F401
                            RequestError, TokenId, _Body, _int, _num, _SamplingFields, _str,
                            check_logprobs_k)
from .protocol_chat import (ChatCompletionRequest, ChatMessage, ChatTemplateFields,  # noqa: F401
                            ContentPart, template_messages)


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
    add_special_tokens: StrictBool = True  # a text prompt gets the tokenizer's BOS (vLLM's default)

    def check(self, vocab_size: int = 0, max_logprobs: int = 20,
              max_model_len: int = 0) -> list[Union[str, list[int]]]:
        """Validate what the schema cannot tell; return the prompts (one choice group each)."""
        self.check_common(vocab_size, max_logprobs, max_model_len)
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
                                      echo=bool(self.echo), max_tokens_within_context=True)
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


__all__ = [
    "RequestError", "error_body", "CompletionRequest", "ChatCompletionRequest", "ChatMessage",
    "ChatTemplateFields", "StreamOptions", "template_messages",
]
