"""The request side of :class:`engine.AsyncEngine`: admission of new requests, aborts, and the
inbox that carries both to the engine loop, which applies it between steps.

A mixin, like :class:`engine.serving.sleep.SleepAPI`: it uses the engine's ``lifecycle``, ``core``,
``admission``, ``_sinks`` (request id -> where its outputs go), ``_pending`` (outputs held
until the step thread waits for the device, see ``_hold``), ``_handed`` and ``_held_lock``
(outputs a launch took from ``_pending`` on the step thread, on their way to the loop:
``_deliver_handed``), ``_inbox``, ``_tokenizing``
(accepted requests whose long prompt is tokenized on a worker thread -> abort reason),
``_tg``, ``_loop_thread``, ``grammars`` and ``_wake()``.

A request with an output constraint whose grammar is not cached waits for its compile (on a
worker thread, :class:`engine.structured.grammars.GrammarService`) *before* it reaches the
core: it holds no batch slot meanwhile, and requests without constraints never wait for it.

Producers (API calls, on the event loop or, for aborts, any thread) only append to the inbox;
the consumer (``_apply_inbox``) runs on the loop.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple, Optional, Union
import uuid

from engine.core.engine_core import EngineCore
from engine.errors import BadRequestError
from engine.params import RequestOutput, SamplingParams
from states import State

from .request_stream import RequestStream, Sink

log = logging.getLogger("enginecore.engine")

#: States in which the loop steps requests (SLEEPING: those finishing before the device is freed).
STEPPING = (State.SERVING, State.SLEEPING, State.DRAINING)


class _Add(NamedTuple):
    """Inbox: add an accepted request (its prompt tokenized, its grammar compiled) to the core."""
    request_id: str
    ids: list[int]
    params: SamplingParams
    grammar: object = None  # params.structured compiled (engine/structured/grammars.py)


class _Abort(NamedTuple):
    """Inbox: abort a request."""
    request_id: str
    reason: str



InboxItem = Union[_Add, _Abort]


class IntakeAPI:
    def generate(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None) -> RequestStream:
        """Submit now (errors are raised here, at once); iterate the result for outputs."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = RequestStream(rid, self._abort_nowait)
        try:
            self.submit(prompt, params or SamplingParams(), rid, stream.sink())
        except BaseException:
            stream._close()  # refused: nothing was accepted, nothing to abort
            raise
        return stream

    def submit(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str,
               sink: Sink) -> Optional[int]:
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
        waiting = len(self._sinks) - (core.num_running if core is not None else 0)
        self.admission.check(request_id, prompt, params, waiting)
        ids = self.admission.ids_now(prompt)
        if ids is not None:
            ids = self.admission.check_ids(ids, params)
        st = params.structured
        grammar = self.grammars.cached(st) if st is not None else None
        if ids is None or (st is not None and grammar is None):
            self._sinks[request_id] = sink
            self._tokenizing[request_id] = None
            assert self._tg is not None
            self._tg.start_soon(self._prepare_then_add, request_id,
                                prompt if ids is None else ids, params)
            return None if ids is None else len(ids)
        self._sinks[request_id] = sink
        self._accept(request_id, ids, params, grammar)
        return len(ids)

    def _accept(self, request_id: str, ids: list[int], params: SamplingParams,
                grammar=None) -> None:
        self.admission.accepted(request_id, len(ids))
        self._inbox.append(_Add(request_id, ids, params, grammar))
        self._wake()

    async def _prepare_then_add(self, request_id: str, prompt: Union[str, list[int]],
                                params: SamplingParams) -> None:
        """Tokenize a long text prompt and compile the output constraint's grammar, off the
        event loop; then add the request (or end it: an error, an abort meanwhile)."""
        grammar = None
        try:
            if isinstance(prompt, str):
                ids = await self.admission.tokenize(prompt)
                if self._sinks.get(request_id) is None:
                    return  # the engine died meanwhile: the sink already has its error
                ids = self.admission.check_ids(ids, params)
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
                sink(exc)
        else:
            self._accept(request_id, ids, params, grammar)
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

    def _apply_inbox(self, core: EngineCore) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if type(item) is _Add:
                try:
                    core.add_request(item.request_id, item.ids, item.params, item.grammar)
                except Exception as exc:  # this request's own input: it ends, the engine serves on
                    log.warning("request %s refused at admission: %s", item.request_id, exc)
                    self._dispatch([RequestOutput(
                        request_id=item.request_id, finished=True, finish_reason="error",
                        reason=str(exc), num_prompt_tokens=len(item.ids))])
            else:
                out = core.abort(item.request_id, item.reason)
                if out is not None:
                    self._dispatch([out])

    def _abort_preparing(self, reason: str) -> None:
        """A drain's deadline: requests still tokenizing or waiting for their grammar end now
        with "abort" (their worker finds the request gone and drops its result)."""
        for rid in list(self._tokenizing):
            self._tokenizing.pop(rid)
            self._dispatch([RequestOutput(request_id=rid, finished=True, finish_reason="abort",
                                          reason=reason)])

    def _hold(self, outputs: list[RequestOutput]) -> None:
        """Keep ``outputs`` until ``_flush_pending`` (the loop has it run once the next step is
        launched and the step thread waits for the device) or the next ``_dispatch``."""
        self._flush_pending()
        self._pending = outputs

    def _flush_pending(self) -> None:
        # what a launch handed over first (older), then what is held; under the lock: on a
        # failure (_fail_streams) the step thread may be handing _pending over meanwhile
        with self._held_lock:
            handed = list(self._handed)
            self._handed.clear()
            pending, self._pending = self._pending, []
        for outputs in handed:
            self._deliver(outputs)
        if pending:
            self._deliver(pending)

    def _deliver_handed(self) -> None:
        """On the loop, posted by a launch (``AsyncEngine._loop``): deliver what it handed over
        (unless a flush did already)."""
        while True:
            with self._held_lock:
                if not self._handed:
                    return
                outputs = self._handed.popleft()
            self._deliver(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # held outputs are older: they go first (in a step burst they are the step thread's,
        # and what the loop dispatches then is of requests outside the core)
        if self._pending and not self._bursting:
            self._flush_pending()
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        sinks = self._sinks
        for out in outputs:
            sink = sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del sinks[out.request_id]
                self.admission.finished(out.request_id)
            sink(out)
