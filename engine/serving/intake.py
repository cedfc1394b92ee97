"""The request side of :class:`engine.AsyncEngine`: admission of new requests, aborts, and the
inbox that carries both to the engine loop, which applies it between steps (``loop.py``).

A mixin, like :class:`engine.serving.sleep.SleepAPI`: it uses the engine's ``lifecycle``, ``core``,
``admission``, ``_sinks`` (request id -> where its outputs go), ``_inbox``, ``_tokenizing``
(accepted requests whose long prompt is tokenized on a worker thread -> abort reason),
``_tg``, ``_loop_thread``, ``grammars``, ``_wake()`` and ``_dispatch()`` (``loop.py``).

A request with an output constraint whose grammar is not cached waits for its compile (in the
compile server's process, :class:`engine.structured.grammars.GrammarService`) *before* it reaches the
core: it holds no batch slot meanwhile, and requests without constraints never wait for it.

Producers (API calls, on the event loop or, for aborts, any thread) only append to the inbox;
the consumer (``EngineLoop._apply_inbox``) runs on the loop.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple, Optional, Union
import uuid

from engine.errors import BadRequestError
from engine.params import RequestOutput, SamplingParams
from engine.request import DEFAULT_CLIENT
from states import State

from .request_stream import RequestStream, Sink

log = logging.getLogger("enginecore.engine")

#: States in which the loop holds requests (SLEEPING: those finishing before the device is freed;
#: PAUSED: frozen, finishing, or queued until resume, ``pause.py``).
STEPPING = (State.SERVING, State.PAUSED, State.SLEEPING, State.DRAINING)


class _Add(NamedTuple):
    """Inbox: add an accepted request (its prompt tokenized, its grammar compiled) to the core."""
    request_id: str
    ids: list[int]
    params: SamplingParams
    grammar: object = None  # params.structured compiled (engine/structured/grammars.py)
    client: str = DEFAULT_CLIENT  # whose request (the scheduler's turns; admission's shares)


class _Abort(NamedTuple):
    """Inbox: abort a request."""
    request_id: str
    reason: str



InboxItem = Union[_Add, _Abort]


class IntakeAPI:
    def generate(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None, *,
                 client: str = DEFAULT_CLIENT) -> RequestStream:
        """Submit now (errors are raised here, at once); iterate the result for outputs.

        ``client``: who the request is for. Waiting requests are admitted round-robin across
        clients (FIFO within one), and a named client (not the default, which every caller
        naming none shares) may hold only its share of the admission limits
        (``max_waiting_per_client``, ``max_queued_tokens_per_client``)."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = RequestStream(rid, self._abort_nowait)
        try:
            self.submit(prompt, params or SamplingParams(), rid, stream.sink(), client=client)
        except BaseException:
            stream._close()  # refused: nothing was accepted, nothing to abort
            raise
        return stream

    def submit(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str,
               sink: Sink, client: str = DEFAULT_CLIENT) -> Optional[int]:
        """Lower-level ``generate``: outputs go to ``sink`` (called on the event-loop thread).

        What can be told at once is raised here (not serving, bad id/params/prompt, overloaded:
        see :mod:`engine.serving.admission`); then the request is accepted and ``sink`` gets exactly one
        terminal item. Returns the number of prompt tokens, or None for a long text whose
        tokens are counted on a worker thread (a prompt found too long there ends with a
        ``BadRequestError`` delivered to ``sink``)."""
        self._require_accepting()
        if request_id in self._sinks:
            raise BadRequestError(f"request_id {request_id!r} is already in flight")
        core = self.core
        admission = self.admission
        waiting = len(self._sinks) - (core.num_running if core is not None else 0)
        admission.check(request_id, prompt, params, waiting, client)
        if client != DEFAULT_CLIENT:  # its share (the default client has none)
            admission.check_client(client, core.scheduler.running_of(client) if core else 0)
        ids = admission.ids_now(prompt)
        if ids is not None:
            ids = admission.check_ids(ids, params, client)
        st = params.structured
        if st is not None:
            self.grammars.check(st)
        grammar = self.grammars.cached(st) if st is not None else None
        admission.opened(request_id, client)
        self._sinks[request_id] = sink
        if ids is None or (st is not None and grammar is None):
            self._tokenizing[request_id] = None
            assert self._tg is not None
            self._tg.start_soon(self._prepare_then_add, request_id,
                                prompt if ids is None else ids, params, client)
            return None if ids is None else len(ids)
        self._accept(request_id, ids, params, grammar, client)
        return len(ids)

    def _accept(self, request_id: str, ids: list[int], params: SamplingParams,
                grammar=None, client: str = DEFAULT_CLIENT) -> None:
        self.admission.accepted(request_id, len(ids))
        self._inbox.append(_Add(request_id, ids, params, grammar, client))
        self._wake()

    async def _prepare_then_add(self, request_id: str, prompt: Union[str, list[int]],
                                params: SamplingParams, client: str) -> None:
        """Tokenize a long text prompt and compile the output constraint's grammar, off the
        event loop; then add the request (or end it: an error, an abort meanwhile)."""
        grammar = None
        try:
            if isinstance(prompt, str):
                ids = await self.admission.tokenize(prompt)
                if self._sinks.get(request_id) is None:
                    return  # the engine died meanwhile: the sink already has its error
                ids = self.admission.check_ids(ids, params, client)
            else:
                ids = prompt
            if params.structured is not None and self._tokenizing.get(request_id) is None:
                grammar = await self.grammars.compiled(params.structured)
            if self._sinks.get(request_id) is None:
                return  # ended meanwhile (the engine died, or a drain deadline aborted it)
            aborted = self._tokenizing.get(request_id)
            if aborted is not None:
                self._dispatch([RequestOutput(request_id=request_id, finished=True,
                                              finish_reason="abort", reason=aborted)])
                return
        except Exception as exc:
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                self.admission.finished(request_id)
                sink(exc)
        else:
            self._accept(request_id, ids, params, grammar, client)
        finally:
            self._tokenizing.pop(request_id, None)
            self._wake()

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        self._abort_nowait(request_id, reason)

    def _abort_nowait(self, request_id: str, reason: str) -> None:
        if request_id in self._tokenizing:
            self._tokenizing[request_id] = reason  # not in the core yet: ended when tokenized
            return
        if request_id in self._sinks and self.lifecycle.state in STEPPING:
            self._inbox.append(_Abort(request_id, reason))
            if threading.get_ident() == self._loop_thread:
                self._wake()
