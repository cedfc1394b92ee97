"""vLLM's utility routes: ``POST /tokenize`` (a prompt, or chat messages rendered with the chat
template as a chat request renders them: ``add_generation_prompt``, ``continue_final_message``,
``tools``, ``documents``, ``chat_template_kwargs``; ``add_special_tokens``, by default true for a
prompt and false for messages, as the generation routes take them; ``return_token_strs``:
the vocabulary's entries, e.g. "Ġhello", as transformers' ``convert_ids_to_tokens``),
``POST /detokenize`` and ``GET /version``. The engine's tokenizer answers (in a frontend process,
over IPC); ids are counted as a generation request's prompt would count them."""

from __future__ import annotations

from importlib import metadata
from typing import Annotated, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, StrictStr

from . import protocol as P
from .context import Frontend
from .errors import JSONBody, error_response


class TokenizeRequest(P.ChatTemplateFields):
    model: Optional[P.Name] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[Annotated[list[P.ChatMessage], Field(min_length=1, max_length=P.MAX_MESSAGES)]] = None
    #: default: true for a prompt, false for messages (as a chat request counts them; vLLM's)
    add_special_tokens: Optional[StrictBool] = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(P._Body):
    model: Optional[P.Name] = None
    tokens: Annotated[list[P.TokenId], Field(max_length=P.MAX_PROMPT_TOKENS)]


def version() -> str:
    try:
        return metadata.version("enginecore")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0+unknown"


def register(app: FastAPI, fe: Frontend, parse_body) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            body = await parse_body(request, TokenizeRequest, fe)
            fe.check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise P.RequestError("give exactly one of prompt and messages", param="prompt")
            if body.messages is not None:
                fe.check_prompt_chars(sum(m.chars() for m in body.messages)
                                      + body.template_chars(), "messages")
                msgs = P.template_messages(body.messages)
                text = await fe.chat_prompt(msgs, **body.template_options(msgs))
            else:
                fe.check_prompt_chars(len(body.prompt), "prompt")
                text = body.prompt
            special = body.add_special_tokens
            ids = await fe.engine.tokenize(text, body.messages is None if special is None else special)
            out = {"count": len(ids), "max_model_len": fe.max_model_len or 0, "tokens": ids,
                   "token_strs": None}
            if body.return_token_strs:
                out["token_strs"] = await fe.engine.detokenize(ids, tokens=True)
        except Exception as exc:
            return error_response(exc, fe.metrics)
        return JSONBody(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            body = await parse_body(request, DetokenizeRequest, fe)
            fe.check_model(body.model)
            vocab = fe.engine.tokenizer_info().vocab_size
            bad = [t for t in body.tokens if vocab and t >= vocab]
            if bad:
                raise P.RequestError(f"token id {bad[0]} is out of vocabulary (vocabulary size "
                                     f"{vocab})", param="tokens")
            text = (await fe.engine.detokenize(list(body.tokens)))[0]
        except Exception as exc:
            return error_response(exc, fe.metrics)
        return JSONBody({"prompt": text})

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version()}


__all__ = ["register", "version"]
