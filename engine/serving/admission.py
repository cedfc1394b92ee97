"""``Admission``: everything a request must pass before the engine accepts it, and the
engine-wide limits on what strangers can queue.

Checked where the request enters (``AsyncEngine.submit``), before anything is queued:

* the request id, the params (:meth:`SamplingParams.validate`: every number range-checked;
  stop token ids inside the vocabulary) and the prompt's type;
* a text prompt's length in characters *before* it is tokenized: no prompt longer than
  ``max_model_len`` tokens of the vocabulary's longest token can fit, so it is refused at once;
* the engine-wide limits: requests waiting for a batch slot (``max_waiting_requests``) and prompt
  tokens held by unfinished requests (``max_queued_tokens``) -- beyond either, a retryable
  :class:`EngineOverloadedError`, and nothing is queued;
* a named client's share of them (``max_waiting_per_client``, ``max_queued_tokens_per_client``):
  one client -- an IPC connection, one user of an HTTP frontend -- cannot fill the engine-wide
  limits and have everyone else refused. The default client (in-process callers that name
  none: the program that owns the engine) has no share of its own.

Tokenization never runs on the event loop for long texts: a prompt of more than
:data:`INLINE_TOKENIZE_CHARS` characters is tokenized on a worker thread through the tokenizer's
GIL-releasing batch path, so ``/health`` and every other stream keep being served meanwhile.
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

import anyio
from anyio import to_thread
import msgspec

from engine.errors import BadRequestError, EngineOverloadedError
from engine.params import SamplingParams
from engine.request import DEFAULT_CLIENT

#: Text prompts up to this many characters are tokenized inline (well under a millisecond).
INLINE_TOKENIZE_CHARS = 4096
MAX_REQUEST_ID_LEN = 256
MAX_CLIENT_LEN = 512  # characters of a client's name


class Admission:
    def __init__(self, runner, *, max_waiting_requests: int, max_queued_tokens: int,
                 max_waiting_per_client: Optional[int] = None,
                 max_queued_tokens_per_client: Optional[int] = None,
                 tokenizer_threads: int = 2) -> None:
        self.runner = runner
        self.max_waiting = max_waiting_requests
        self.max_tokens = max_queued_tokens
        self.client_waiting = min(max_waiting_per_client or max_waiting_requests,
                                  max_waiting_requests)
        self.client_tokens = min(max_queued_tokens_per_client or max_queued_tokens,
                                 max_queued_tokens)
        self.tokens_in_flight = 0  # prompt tokens of accepted, unfinished requests
        self._tokens: dict[str, int] = {}
        # named clients only: request id -> its client; client -> [unfinished requests, their
        # prompt tokens] (a client's entry goes with its last unfinished request)
        self._owner: dict[str, str] = {}
        self._clients: dict[str, list[int]] = {}
        self._limiter = anyio.CapacityLimiter(tokenizer_threads)
        self._ids_type = (-1, None)  # (vocabulary size, the prompt ids' msgspec type for it)

    # -- checks (raise; nothing queued) ---------------------------------------------------------
    def check(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
              num_waiting: int, client: str = DEFAULT_CLIENT) -> None:
        if not isinstance(request_id, str) or not (0 < len(request_id) <= MAX_REQUEST_ID_LEN):
            raise BadRequestError(
                f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} chars")
        if type(client) is not str or len(client) > MAX_CLIENT_LEN:
            raise BadRequestError(f"client must be a string of at most {MAX_CLIENT_LEN} chars")
        if not isinstance(params, SamplingParams):
            raise BadRequestError("params must be SamplingParams")
        params.validate()
        params.check_vocab(self.runner.model_config.vocab_size, self.runner.config.max_logprobs)
        if self.runner.speculator is not None and (
                params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0):
            raise BadRequestError("invalid sampling params: presence, frequency and repetition "
                                  "penalties are not supported with speculative decoding")
        if isinstance(prompt, str):
            limit = self.max_prompt_chars
            if len(prompt) > limit:
                raise BadRequestError(
                    f"prompt has {len(prompt)} characters; no prompt of more than {limit} "
                    f"characters fits the context limit of {self.runner.max_model_len} tokens")
        elif not isinstance(prompt, list):
            raise BadRequestError("prompt must be a string or a list of token ids")
        if num_waiting >= self.max_waiting:
            raise EngineOverloadedError(
                f"engine is overloaded: {num_waiting} requests are waiting "
                f"(max_waiting_requests={self.max_waiting}); retry later")
        if self.tokens_in_flight >= self.max_tokens:
            raise EngineOverloadedError(
                f"engine is overloaded: {self.tokens_in_flight} prompt tokens are queued "
                f"(max_queued_tokens={self.max_tokens}); retry later")

    def check_client(self, client: str, num_running: int) -> None:
        """A named client's share: its waiting requests (``num_running`` of its unfinished ones
        are running) and its prompt tokens."""
        held = self._clients.get(client)
        if held is None:
            return
        if held[0] - num_running >= self.client_waiting:
            raise EngineOverloadedError(
                f"engine is overloaded for this client: {held[0] - num_running} of its requests "
                f"are waiting (max_waiting_per_client={self.client_waiting}); retry later")
        if held[1] >= self.client_tokens:
            raise EngineOverloadedError(self._client_tokens_error(held[1]))

    def _client_tokens_error(self, held: int) -> str:
        return (f"engine is overloaded for this client: {held} of its prompt tokens are queued "
                f"(max_queued_tokens_per_client={self.client_tokens}); retry later")

    @property
    def max_prompt_chars(self) -> int:
        return self.runner.max_model_len * max(1, self.runner.tokenizer.max_token_chars)

    def check_ids(self, ids: list[int], params: SamplingParams,
                  client: str = DEFAULT_CLIENT) -> list[int]:
        """The prompt's ids as the engine takes them (``truncate_prompt_tokens`` of them, from
        its ``truncation_side``): a new list of plain ints, whatever the caller does with its
        own list afterwards."""
        k = params.truncate_prompt_tokens
        if k is not None and k < len(ids):
            ids = ids[len(ids) - k:] if params.truncation_side == "left" else ids[:k]
        # NOTE: msgspec checks every id's type and range and copies the list in one C pass
        # (~25 us for a 1,500-token prompt, against ~65 for three C-level passes and a copy:
        # on the event loop, for each arrival of a burst of later turns in turn); a
        # bool, a float, a string or None is refused (msgspec is strict), an int subclass
        # becomes a plain int
        vocab, kind = self._ids_type
        if vocab != self.runner.model_config.vocab_size:  # (the runner loads after __init__)
            vocab = self.runner.model_config.vocab_size
            kind = list[Annotated[int, msgspec.Meta(ge=0, lt=vocab)]]
            self._ids_type = (vocab, kind)
        try:
            ids = msgspec.convert(ids, kind)
        except msgspec.ValidationError:
            raise BadRequestError(f"prompt token ids must be integers in [0, {vocab})") from None
        self.runner.check_prompt(len(ids), params.max_tokens)
        limit = self.runner.max_model_len
        if params.max_tokens_within_context and len(ids) + params.max_tokens > limit:
            raise BadRequestError(
                f"max_tokens is too large: {params.max_tokens}. This model's context is {limit} "
                f"tokens and the prompt has {len(ids)} ({params.max_tokens} > {limit} - "
                f"{len(ids)}); lower max_tokens or shorten the prompt")
        if self.tokens_in_flight + len(ids) > self.max_tokens and self.tokens_in_flight:
            raise EngineOverloadedError(
                f"engine is overloaded: {self.tokens_in_flight} prompt tokens are queued "
                f"(max_queued_tokens={self.max_tokens}); retry later")
        held = self._clients.get(client) if client != DEFAULT_CLIENT else None
        if held is not None and held[1] and held[1] + len(ids) > self.client_tokens:
            raise EngineOverloadedError(self._client_tokens_error(held[1]))
        return ids

    # -- tokenization ---------------------------------------------------------------------------
    def ids_now(self, prompt: Union[str, list[int]]) -> Optional[list[int]]:
        """The prompt's ids if they are cheap to get now; None: use :meth:`tokenize`."""
        if isinstance(prompt, list):
            return prompt  # (check_ids copies it)
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            return self.runner.tokenizer.encode(prompt)
        return None

    async def tokenize(self, text: str) -> list[int]:
        return await to_thread.run_sync(self.runner.tokenizer.encode, text, limiter=self._limiter)

    async def tokenize_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """For the engine's ``tokenize`` call: bounded like a prompt."""
        if not isinstance(text, str) or len(text) > self.max_prompt_chars:
            raise BadRequestError(f"text must be a string of at most {self.max_prompt_chars} characters")
        return await to_thread.run_sync(self.runner.tokenizer.encode, text, bool(add_special_tokens),
                                        limiter=self._limiter)

    async def detokenize(self, ids: list[int], each: bool, tokens: bool = False) -> list[str]:
        tok, vocab = self.runner.tokenizer, self.runner.model_config.vocab_size
        if not isinstance(ids, list) or any(type(t) is not int or not (0 <= t < vocab) for t in ids):
            raise BadRequestError(f"token ids must be integers in [0, {vocab})")
        if tokens:
            return tok.token_strings(ids)
        if each:
            return [tok.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
        return [await to_thread.run_sync(tok.decode, ids, limiter=self._limiter)]

    # -- accounting -----------------------------------------------------------------------------
    def opened(self, request_id: str, client: str) -> None:
        """``request_id`` is ``client``'s and unfinished (until :meth:`finished`)."""
        if client == DEFAULT_CLIENT:
            return
        self._owner[request_id] = client
        held = self._clients.get(client)
        if held is None:
            self._clients[client] = [1, 0]
        else:
            held[0] += 1

    def accepted(self, request_id: str, num_tokens: int) -> None:
        """Its prompt has ``num_tokens`` tokens (it goes to the core)."""
        self._tokens[request_id] = num_tokens
        self.tokens_in_flight += num_tokens
        client = self._owner.get(request_id)
        if client is not None:
            self._clients[client][1] += num_tokens

    def finished(self, request_id: str) -> None:
        """Its terminal output or error was delivered."""
        n = self._tokens.pop(request_id, 0)
        self.tokens_in_flight -= n
        client = self._owner.pop(request_id, None)
        if client is not None:
            held = self._clients[client]
            if held[0] == 1:
                del self._clients[client]
            else:
                held[0] -= 1
                held[1] -= n

    def unfinished_of(self, client: str) -> tuple[int, int]:
        """A named client's unfinished requests and their prompt tokens."""
        held = self._clients.get(client)
        return (held[0], held[1]) if held is not None else (0, 0)


__all__ = ["Admission", "INLINE_TOKENIZE_CHARS", "MAX_CLIENT_LEN", "MAX_REQUEST_ID_LEN"]
