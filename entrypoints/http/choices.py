"""The response bodies: one choice per (prompt, n) pair, as OpenAI and vLLM shape them --
text or message, ``logprobs`` (completions: ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``; chat: ``content[]`` with ``token`` / ``logprob`` / ``bytes`` /
``top_logprobs``), vLLM's ``prompt_logprobs`` (null when not asked for: on each completion choice,
once on a chat response), with ``return_token_ids`` vLLM's ``prompt_token_ids`` and ``token_ids``
(streamed: the prompt's on a choice's first chunk, each chunk's new tokens), and ``usage`` with
``prompt_tokens_details.cached_tokens`` (prompt tokens the prefix cache held). Chat answers in
the request's role (``protocol_chat``); ``echo`` puts its echoed text before the answer (streamed:
one chunk after the role's). A chat chunk carries ``usage`` only with continuous usage stats.
Plain dicts, serialised once.

Token strings are the tokens' bytes decoded as UTF-8 (a token holding part of a character reads
as U+FFFD; chat's ``bytes`` carry the exact bytes).
"""

from __future__ import annotations

import struct
import time
import uuid
from typing import NamedTuple, Optional, Union

from engine.params import Logprobs, RequestOutput, SamplingParams, TokenLogprob

from .structured import ToolMode, new_call_id, split_call


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenTable:
    """Token ids as the bodies show them: each token's text (its bytes as UTF-8, a partial
    character as U+FFFD) and its bytes. Made once per frontend from the engine's byte table, so
    rendering a logprob is a list lookup. Ids past the tokenizer's table (a model's padded
    vocabulary) read as empty."""

    def __init__(self, pieces: list[bytes], texts: Optional[list[str]] = None) -> None:
        self.pieces = pieces
        self.texts = texts if texts is not None else [b.decode("utf-8", errors="replace")
                                                      for b in pieces]
        #: how a logprob names a token: its text (``as_ids``: "token_id:N", vLLM's
        #: ``return_tokens_as_token_ids``)
        self.label = self.text
        self._as_ids: Optional["TokenTable"] = None

    def as_ids(self) -> "TokenTable":
        """The same table, naming each token ``token_id:N`` (offsets still count its text)."""
        if self._as_ids is None:
            self._as_ids = TokenTable(self.pieces, self.texts)
            self._as_ids.label = lambda token_id: f"token_id:{token_id}"
        return self._as_ids

    def text(self, token_id: int) -> str:
        return self.texts[token_id] if token_id < len(self.texts) else ""

    def piece(self, token_id: int) -> bytes:
        return self.pieces[token_id] if token_id < len(self.pieces) else b""


#: one row of a :class:`~engine.params.Logprobs` without alternatives (k = 0): token id, logprob
#: (NaN: none), rank -- the packed layout its docstring gives
_ROW_K0 = struct.Struct("<ifi")


def unpack_logprobs(lps: Logprobs) -> list[TokenLogprob]:
    """``lps.entries()``; without alternatives (``logprobs: 0``, the common streamed case),
    unpacked by ``struct`` rather than numpy: a few microseconds less per streamed piece."""
    if lps.k:
        return lps.entries()
    return [TokenLogprob(t, None, None, [], []) if lp != lp else TokenLogprob(t, lp, r or None, [], [])
            for t, lp, r in _ROW_K0.iter_unpack(lps.rows)]


class Job(NamedTuple):
    """One choice to generate: ``index`` in the response, the prompt it continues (``submit``:
    what goes to the engine for it, when not the prompt itself -- a text prompt's token ids)."""

    index: int
    prompt_index: int
    prompt: Union[str, list[int]]
    params: SamplingParams
    submit: Union[str, list[int], None] = None


def completion_logprobs(entries, offset: int, table: TokenTable) -> tuple[dict, int]:
    """The completions ``logprobs`` object of ``entries`` (``engine.params.TokenLogprob``); text
    offsets count from ``offset``. Each top dict holds the top k and the chosen token (as vLLM
    does)."""
    text, label = table.text, table.label
    tokens, lps, tops, offs = [], [], [], []
    for e in entries:
        s = label(e.token_id)
        tokens.append(s)
        lps.append(e.logprob)
        if e.logprob is None:
            tops.append(None)
        else:
            d = {label(t): lp for t, lp in zip(e.top_ids, e.top_logprobs)}
            d.setdefault(s, e.logprob)
            tops.append(d)
        offs.append(offset)
        offset += len(text(e.token_id))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}, offset


def chat_logprobs(entries, table: TokenTable) -> list[dict]:
    label, piece = table.label, table.piece
    return [{"token": label(e.token_id), "logprob": e.logprob, "bytes": list(piece(e.token_id)),
             "top_logprobs": [{"token": label(t), "logprob": lp, "bytes": list(piece(t))}
                              for t, lp in zip(e.top_ids, e.top_logprobs)]}
            for e in entries]


def prompt_logprobs(entries, table: TokenTable) -> list[Optional[dict]]:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob, rank, decoded_token}}``
    (the prompt token and the top k), the first ``None``."""
    text = table.text
    out: list[Optional[dict]] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": text(e.token_id)}}
        for r, (t, lp) in enumerate(zip(e.top_ids, e.top_logprobs), 1):
            d.setdefault(str(t), {"logprob": lp, "rank": r, "decoded_token": text(t)})
        out.append(d)
    return out


class ChoiceState:
    """One choice as its outputs arrive: the pieces it streams, and the whole at the end."""

    def __init__(self, chat: bool, job: Job, echo: bool, want_prompt_lps: bool,
                 tools: Optional[ToolMode] = None) -> None:
        self.chat = chat
        self.tools = tools if chat else None  # the output is a forced tool call's
        self.call_id = new_call_id() if self.tools is not None else ""
        self._call_opened = False
        self.job = job
        self.echo = echo
        self.want_prompt_lps = want_prompt_lps
        self.first = True
        self.offset = 0
        self.num_prompt = 0
        self.num_output = 0
        self.num_cached = 0
        #: with return_token_ids: the prompt's ids (from the first output) and the output's
        self.want_ids = job.params.return_prompt_token_ids
        self.prompt_ids: Optional[list[int]] = None
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.lps: list[dict] = []  # completions: per-piece objects; chat: content entries
        self.prompt_lps: Optional[list] = None
        self.finish: Optional[str] = None
        self.cum_logprob = 0.0  # of the generated tokens (ranks best_of candidates)
        self.show_logprobs = bool(job.params.logprobs)
        self.index = job.index  # in the response (best_of renumbers the kept ones)
        #: how token ids are shown (set before the first output of a job with logprobs)
        self.table: Optional[TokenTable] = None

    @property
    def needs_table(self) -> bool:
        p = self.job.params
        return bool(p.logprobs) or (self.want_prompt_lps and p.prompt_logprobs is not None)

    def piece(self, out: RequestOutput) -> tuple[str, Optional[object]]:
        """(text, logprobs fragment) of ``out``; remembered for :meth:`whole`."""
        text = out.text
        got = unpack_logprobs(out.token_logprobs) if out.token_logprobs is not None else []
        if out.logprobs:
            self.cum_logprob += sum(out.logprobs)
        if self.want_ids:
            self.token_ids += out.token_ids
        if self.first:
            self.first = False
            self.num_cached = out.num_cached_tokens
            self.prompt_ids = out.prompt_token_ids
            plp = unpack_logprobs(out.prompt_logprobs) if out.prompt_logprobs is not None else None
            if self.echo:
                prompt = self.job.prompt
                text = (prompt if isinstance(prompt, str) else (out.prompt_text or "")) + text
                if self.job.params.logprobs and plp:
                    got = plp + got
            if self.want_prompt_lps and plp is not None:
                self.prompt_lps = prompt_logprobs(plp, self.table)
        self.num_prompt = out.num_prompt_tokens or self.num_prompt
        self.num_output = out.num_output_tokens or self.num_output
        if out.finished:
            self.finish = out.finish_reason or "stop"
        self.text.append(text)
        frag: Optional[object] = None
        if self.job.params.logprobs:
            if self.chat:
                frag = chat_logprobs(got, self.table)
                self.lps.extend(frag)
            else:
                frag, self.offset = completion_logprobs(got, self.offset, self.table)
                self.lps.append(frag)
        return text, frag

    def whole_logprobs(self):
        if not self.show_logprobs:
            return None
        if self.chat:
            return {"content": self.lps}
        merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for frag in self.lps:
            for key in merged:
                merged[key].extend(frag[key])
        return merged

    # -- forced tool calls (structured.py) --------------------------------------------------
    def _call(self, name: str, arguments: str) -> dict:
        return {"index": 0, "id": self.call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def tool_piece(self, text: str, finished: bool) -> Optional[list]:
        """The ``tool_calls`` delta of a streamed piece (None: nothing to send yet). A known
        name opens the call at once and streams the arguments; a name chosen by the output is
        sent with the whole call when it is complete."""
        mode = self.tools
        assert mode is not None
        if mode.name is not None:
            if not self._call_opened:
                self._call_opened = True
                return [self._call(mode.name, text)]
            return [{"index": 0, "function": {"arguments": text}}] if text else None
        if not finished:
            return None
        split = split_call(mode, "".join(self.text))
        return [self._call(*split)] if split is not None else None

    @property
    def finish_reason(self) -> str:
        """As answered: a forced call whose grammar completed ends with "tool_calls"."""
        finish = self.finish or "stop"
        if self.tools is not None and finish == "stop":
            return "tool_calls"
        return finish

    def whole(self, role: str = "assistant", echoed: str = "") -> dict:
        text = "".join(self.text)
        body: dict = {"index": self.index}
        finish = self.finish_reason
        if self.chat:
            split = split_call(self.tools, text) if self.tools is not None else None
            if split is not None:
                body["message"] = {"role": role, "content": echoed or None,
                                   "tool_calls": [self._call(*split)]}
                body["message"]["tool_calls"][0].pop("index")
            else:
                body["message"] = {"role": role, "content": echoed + text}
                finish = self.finish or "stop"
        else:
            body["text"] = text
        body["logprobs"] = self.whole_logprobs()
        body["finish_reason"] = finish
        if not self.chat:
            body["prompt_logprobs"] = self.prompt_lps
            if self.want_ids:
                body["prompt_token_ids"] = self.prompt_ids
        if self.want_ids:
            body["token_ids"] = self.token_ids
        return body


def total_usage(states: list[ChoiceState]) -> dict:
    """Prompt tokens once per prompt, completion tokens of every choice; a prompt's cached
    tokens as its first choice found them (the others are submitted after it, to hit its
    blocks: what one request with ``n`` choices would count)."""
    prompts: dict[int, int] = {}
    cached: dict[int, tuple[int, int]] = {}
    for s in states:
        p = s.job.prompt_index
        prompts[p] = max(prompts.get(p, 0), s.num_prompt)
        if p not in cached or s.job.index < cached[p][0]:
            cached[p] = (s.job.index, s.num_cached)
    return usage(sum(prompts.values()), sum(s.num_output for s in states),
                 sum(c for _, c in cached.values()))


class Kind:
    """What differs between /v1/completions and /v1/chat/completions."""

    def __init__(self, chat: bool, rid: str, model: str, include_usage: bool,
                 continuous_usage: bool = False) -> None:
        self.chat = chat
        self.rid = rid
        self.model = model
        self.created = now()
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage  # (vLLM: only with both)
        self.return_ids = False  # return_token_ids
        self.ids_as_tokens = False  # return_tokens_as_token_ids
        self.role = "assistant"  # chat: the answer's role
        self.echoed = ""  # chat: the text echo puts before the answer
        self.max_tokens_param = "max_tokens"  # the field a too-large max_tokens came in
        self.best: Optional[tuple[int, bool]] = None
        self.tools: Optional[ToolMode] = None  # chat: the output is a forced tool call

    def keep_best(self, n: int, show_logprobs: bool) -> None:
        """best_of: answer with the ``n`` candidates of each prompt of highest summed logprob."""
        self.best = (n, show_logprobs)

    def _selected(self, states: list[ChoiceState]) -> list[ChoiceState]:
        if self.best is None:
            return states
        n, show = self.best
        by_prompt: dict[int, list[ChoiceState]] = {}
        for s in states:
            by_prompt.setdefault(s.job.prompt_index, []).append(s)
        out = []
        for p in sorted(by_prompt):
            kept = sorted(by_prompt[p], key=lambda s: -s.cum_logprob)[:n]
            for r, s in enumerate(kept):
                s.index, s.show_logprobs = p * n + r, show
            out += kept
        return out

    def _obj(self, choices: list, use: Optional[dict] = None, stream: bool = True) -> dict:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if use is not None or (stream and self.include_usage and not self.chat):
            body["usage"] = use
        return body

    def chunk(self, index: int, text: Optional[str], logprobs, finish: Optional[str],
              role: bool = False, use: Optional[dict] = None, extra: Optional[dict] = None,
              tool_calls: Optional[list] = None, head: Optional[dict] = None) -> dict:
        """One SSE chunk of choice ``index``; ``extra``: more fields of the choice, ``head``:
        of the chunk (chat's ``prompt_token_ids``)."""
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = self.role
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta,
                      "logprobs": {"content": logprobs} if logprobs is not None else None,
                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
        if extra:
            choice.update(extra)
        body = self._obj([choice], use if self.continuous_usage else None)
        if head:
            body.update(head)
        return body

    def usage_chunk(self, use: dict) -> dict:
        return self._obj([], use)

    def whole(self, states: list[ChoiceState]) -> dict:
        body = self._obj([s.whole(self.role, self.echoed) for s in self._selected(states)],
                         total_usage(states), stream=False)
        if self.chat:
            body["prompt_logprobs"] = next((s.prompt_lps for s in states
                                            if s.prompt_lps is not None), None)
            if self.return_ids:
                body["prompt_token_ids"] = next((s.prompt_ids for s in states
                                                 if s.prompt_ids is not None), None)
        return body


__all__ = ["ChoiceState", "Job", "Kind", "TokenTable", "new_id", "now", "usage", "total_usage",
           "unpack_logprobs"]
