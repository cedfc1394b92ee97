"""``Frontend``: what the routes of one app share -- the :class:`~engine.interface.Engine` they
serve (taken as it is: an ``AsyncEngine`` in process, an ``ipc.EngineClient`` in a frontend
process), this process's limits and metrics, and the one flag the engine cannot tell itself:
that the frontend has given up on it (``dead``).

Health (``/health``: ``status``, ``state``, ``live``, ``ready``; e.g. ``"sleeping"``, live, not
ready while asleep) answers from the engine's state as last pushed to us
(``Engine.on_state_change``) and a probe bounded by :data:`HEALTH_PROBE_TIMEOUT`. A probe that is
slow -- the event loop was busy, the engine process is mid-step -- is not death: the answer then
comes from the last known state. Dead means the connection is lost (``dead`` set) or the engine
is FAILED.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence, Union

import anyio

from engine.errors import BadRequestError, EngineDeadError, EngineError
from engine.interface import Engine, Health, RequestStreamLike
from engine.loader.hf_hub import display_name
from engine.params import SamplingParams
from states import LIVE_STATES, State

from . import protocol as P
from .choices import TokenTable, now
from .limits import HttpLimits
from .metrics import Metrics

log = logging.getLogger("enginecore.http")

HEALTH_PROBE_TIMEOUT = 1.0
#: How long a frontend waits for what it fetches before serving (``Frontend.prefetch``).
PREFETCH_TIMEOUT = 10.0
#: Worker threads parsing large request bodies at once.
PARSE_THREADS = 2


class Frontend:
    def __init__(self, engine: Engine, limits: HttpLimits = HttpLimits(),
                 model_name: Union[str, Sequence[str], None] = None,
                 cache_info: Optional[Mapping[str, str]] = None) -> None:
        self.engine = engine
        self.limits = limits
        served = [model_name] if isinstance(model_name, str) else list(model_name or ())
        #: The served names (``--served-model-name``; else the model's own, engine/loader/hf_hub.py):
        #: all are listed; the first is the one responses report. ``default`` and the
        #: ``--model`` value are accepted as aliases.
        self.served: list[str] = served or [display_name(engine.model)]
        self.model: str = self.served[0]
        self.names: frozenset[str] = frozenset([*self.served, "default", engine.model])
        self.metrics = Metrics(engine, cache_info, self.model)
        self.created = now()
        #: Set by the frontend process when its connection to the engine is gone for good.
        self.dead: Optional[str] = None
        #: True once the engine was seen FAILED (it moves on to SHUTDOWN after its release).
        self.failed = engine.state is State.FAILED
        engine.on_state_change(self._on_state_change)
        self._parse_limiter: Optional[anyio.CapacityLimiter] = None
        self._token_table: Optional[TokenTable] = None
        self._table_lock: Optional[anyio.Lock] = None
        self._adds_special: Optional[bool] = None

    def _on_state_change(self, old: State, new: State) -> None:
        if new is State.FAILED:
            self.failed = True

    # -- what the routes read -----------------------------------------------------------------
    @property
    def state(self) -> State:
        return State.FAILED if self.dead is not None else self.engine.state

    @property
    def parse_limiter(self) -> anyio.CapacityLimiter:
        """Made on first use: a limiter belongs to the event loop the app runs in."""
        if self._parse_limiter is None:
            self._parse_limiter = anyio.CapacityLimiter(PARSE_THREADS)
        return self._parse_limiter

    async def token_table(self) -> TokenTable:
        """How logprobs show token ids: the engine's byte table, asked for once -- by one caller
        while the others wait (a burst's first logprobs requests each asked for the whole table
        over IPC, 151,936 entries: their submits waited up to 2.3 s, measured on an H100). The
        frontend process asks before it serves (``prefetch``)."""
        if self._token_table is None:
            if self._table_lock is None:  # (made on first use: it belongs to the app's loop)
                self._table_lock = anyio.Lock()
            async with self._table_lock:
                if self._token_table is None:
                    self._token_table = TokenTable(await self.engine.token_bytes())
        return self._token_table

    async def prefetch(self, timeout: float = PREFETCH_TIMEOUT) -> None:
        """What the first requests would otherwise fetch (the token table), before serving; a
        failure is logged, not fatal (the routes fetch it on first use)."""
        try:
            with anyio.fail_after(timeout):
                await self.token_table()
        except Exception as exc:  # an engine asleep or slow: served anyway
            log.warning("the token table was not fetched before serving (%s); the first "
                        "request with logprobs fetches it", exc)

    async def text_prompt(self, text: str, add_special_tokens: bool) -> Union[str, list[int]]:
        """What to submit for a text prompt: the text itself (the engine tokenizes it with the
        tokenizer's special tokens, its BOS), or -- when those are not wanted and the tokenizer
        has some -- its token ids without them (one call to the engine's tokenizer)."""
        if add_special_tokens:
            return text
        if self._adds_special is None:  # asked once: whether the engine adds any
            self._adds_special = bool(await self.engine.tokenize("", True))
        return await self.engine.tokenize(text, False) if self._adds_special else text

    @property
    def max_model_len(self) -> Optional[int]:
        return self.engine.max_model_len or None

    @property
    def max_prompt_chars(self) -> int:
        return self.limits.prompt_chars(self.max_model_len)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.names:
            raise P.RequestError(f"The model `{model}` does not exist; this server serves "
                                 f"`{self.model}`.", param="model", code="model_not_found",
                                 status=404)

    def check_prompt_chars(self, n: int, param: str) -> None:
        limit = self.max_prompt_chars
        if n > limit:
            raise P.RequestError(f"the prompt has {n} characters; at most {limit} are accepted "
                                 f"(context limit {self.max_model_len} tokens)", param=param,
                                 code="prompt_too_long")

    def default_max_tokens(self, chat: bool) -> int:
        # Completions: OpenAI's default of 16. Chat: until the context is full (the engine stops
        # a request at the context limit with finish_reason "length").
        return (self.max_model_len or 4096) if chat else 16

    # -- calls ----------------------------------------------------------------------------------
    def generate(self, prompt, params: SamplingParams, request_id: str,
                 client: str = "") -> RequestStreamLike:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        return self.engine.generate(prompt, params, request_id=request_id, client=client)

    async def chat_prompt(self, messages: list[dict], **options) -> str:
        """``messages`` rendered with the chat template (``options``: the request's
        ``protocol_chat.ChatTemplateFields.template_options``)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            return await self.engine.apply_chat_template(messages, **options)
        except EngineError as exc:
            if isinstance(exc, BadRequestError):  # the renderer's refusal of these messages
                raise P.RequestError(f"chat template failed: {exc}", param="messages") from None
            raise
        except Exception as exc:  # a template that fails on these messages
            raise P.RequestError(f"chat template failed: {exc}", param="messages") from None

    async def health(self) -> tuple[int, dict, Optional[Health]]:
        """(HTTP status, body, the engine's Health if the probe answered in time)."""
        if self.dead is not None:
            return 503, {"status": "dead", "detail": self.dead}, None
        h: Optional[Health] = None
        try:
            with anyio.move_on_after(HEALTH_PROBE_TIMEOUT):
                h = await self.engine.health()
        except Exception as exc:  # the engine refused the probe: trust its state, below
            log.debug("health probe failed: %r", exc)
        state = self.engine.state if h is None else h.state
        if self.failed:  # FAILED, then SHUTDOWN once released: dead all the same
            state = State.FAILED
        live = state in LIVE_STATES if h is None else bool(h.live)
        ready = (state is State.SERVING if h is None else bool(h.ready)) and not self.failed
        body = {"status": "ok" if live else ("dead" if state is State.FAILED else "unavailable"),
                "state": state.value, "live": live, "ready": ready}
        if h is None:
            body["probe"] = "timeout"
        return (200 if live else 503), body, h


def client_of(request) -> str:
    """The user an HTTP request is for, as the engine tells clients apart (its waiting requests
    take turns with other users', within a share of the admission limits): the peer's host, its
    port aside. NOTE: not an ``Authorization`` key -- the generation routes do not check one, and
    a key anyone may invent would let one host pass for any number of users."""
    peer = request.client
    return peer.host if peer is not None and peer.host else ""


__all__ = ["Frontend", "HEALTH_PROBE_TIMEOUT", "client_of"]
