"""The two generation routes, ``/v1/completions`` and ``/v1/chat/completions``: parse, check
every field against the schema, the vocabulary and the server's limits (a 400 naming the field,
before anything is submitted), expand prompts x ``n`` into jobs, then :func:`serve_request`."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from . import protocol as P
from .choices import Job, Kind, new_id
from .context import Frontend
from .errors import error_response
from .serving import serve_request
from .structured import attach


def _continuous(body: P._SamplingFields) -> bool:
    """Usage on every chunk: with ``include_usage`` and ``continuous_usage_stats`` both (vLLM)."""
    opts = body.stream_options
    return bool(opts and opts.include_usage and opts.continuous_usage_stats)


async def completions(fe: Frontend, request: Request, parse_body) -> Response:
    arrival = time.monotonic()
    try:
        body = await parse_body(request, P.CompletionRequest, fe)
        fe.check_model(body.model)
        info = fe.engine.tokenizer_info()
        limit = fe.max_model_len
        prompts = body.check(info.vocab_size, info.max_logprobs, limit or 0)
        attach(body, chat=False)
        max_tokens = (body.max_tokens if body.max_tokens is not None
                      else fe.default_max_tokens(chat=False))
        submits: list = []
        for p in prompts:
            if isinstance(p, str):
                fe.check_prompt_chars(len(p), "prompt")
                submits.append(await fe.text_prompt(p, body.add_special_tokens))
                continue
            submits.append(None)
            n = min(len(p), body._truncate or len(p))
            if limit and n >= limit:
                raise P.RequestError(f"a prompt has {len(p)} tokens; the context limit is {limit}",
                                     param="prompt", code="prompt_too_long")
            if limit and n + max_tokens > limit:  # (a text prompt's: the engine's, once tokenized)
                raise P.RequestError(f"max_tokens is too large: {max_tokens}. This model's context "
                                     f"is {limit} tokens and a prompt has {n} ({max_tokens} > "
                                     f"{limit} - {n})", param="max_tokens")
        n = body.num_candidates
        jobs = [Job(i * n + c, i, p, body.engine_params(max_tokens, c),
                    None if isinstance(submits[i], str) else submits[i])
                for i, p in enumerate(prompts) for c in range(n)]
    except Exception as exc:
        return error_response(exc, fe.metrics)
    kind = Kind(False, new_id("cmpl"), fe.model, body.include_usage, _continuous(body))
    kind.return_ids = bool(body.return_token_ids)
    kind.ids_as_tokens = bool(body.return_tokens_as_token_ids)
    if body.num_candidates > body.num_choices:  # best_of: keep the best n of each prompt
        kind.keep_best(body.num_choices, show_logprobs=body.logprobs is not None)
    return await serve_request(fe, request, body, jobs, kind, arrival, echo=bool(body.echo),
                               want_prompt_lps=body.prompt_logprobs is not None)


async def chat_completions(fe: Frontend, request: Request, parse_body) -> Response:
    arrival = time.monotonic()
    try:
        body = await parse_body(request, P.ChatCompletionRequest, fe)
        fe.check_model(body.model)
        fe.check_prompt_chars(sum(m.chars() for m in body.messages) + body.template_chars(),
                              "messages")
        info = fe.engine.tokenizer_info()
        messages = body.check(info.vocab_size, info.max_logprobs, fe.max_model_len or 0)
        options = body.template_options(messages)
        attach(body, chat=True)
        n = body.requested_max_tokens
        max_tokens = n if n is not None else fe.default_max_tokens(chat=True)
        jobs = [Job(c, 0, "", body.engine_params(max_tokens, c)) for c in range(body.num_choices)]
        prompt = await fe.chat_prompt(messages, **options)
        submit = await fe.text_prompt(prompt, body.add_special_tokens)
        jobs = [j._replace(prompt=prompt, submit=None if submit is prompt else submit) for j in jobs]
    except Exception as exc:
        return error_response(exc, fe.metrics)
    kind = Kind(True, new_id("chatcmpl"), fe.model, body.include_usage, _continuous(body))
    kind.tools = body.tool_mode
    kind.return_ids = bool(body.return_token_ids)
    kind.ids_as_tokens = bool(body.return_tokens_as_token_ids)
    kind.role, kind.echoed = body.role, body.echoed
    kind.max_tokens_param = body.max_tokens_param
    return await serve_request(fe, request, body, jobs, kind, arrival,
                               want_prompt_lps=body.prompt_logprobs is not None)


__all__ = ["completions", "chat_completions"]
