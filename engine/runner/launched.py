"""A launched step (engine/runner/model_runner.py ``ModelRunner.launch``): its result, or -- deferred, for
overlapped scheduling -- the host copy of its sampled tokens (and logprob rows) under way."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from engine.request import Request
from engine.sample import logprobs
from engine.sample.sampler import SamplingBatch, StepResult


def by_entry(entries: int, owners: list[int], tokens: list[int]) -> StepResult:
    """The sampled ``tokens`` (one per sample row, in row order; ``owners[k]``: the entry of row
    ``k``) grouped by entry."""
    out: list[list[int]] = [[] for _ in range(entries)]
    for k, i in enumerate(owners):
        out[i].append(tokens[k])
    return StepResult(out, None)


class Launched:
    """A launched step: its :class:`StepResult`, or (deferred) the pinned host copy of its
    sampled tokens (and logprob rows) under way, with the event that marks it done. Host
    memory only."""

    __slots__ = ("result", "entries", "owners", "rows", "host", "event", "n_tok", "lp_plan",
                 "flat", "fed")

    def __init__(self, result: Optional[StepResult]):
        self.result = result
        #: deferred, once waited for: the sampled tokens in row order
        self.flat: Optional[list[int]] = None
        #: the core's plan of the constrained entries fed from it (EngineCore._defer)
        self.fed: Optional[tuple] = None

    @classmethod
    def deferred(cls, entries: int, owners: list[int], packed: torch.Tensor, n_tok: int,
                 lp_plan=None) -> "Launched":
        """``packed``: the ``n_tok`` sampled tokens, then (with ``lp_plan``) the step's logprob
        rows as int32 words (``ModelRunner._packed_rows``)."""
        self = cls(None)
        self.entries, self.owners, self.n_tok, self.lp_plan = entries, owners, n_tok, lp_plan
        self.rows = {i: k for k, i in enumerate(owners)}  # entry -> its sampled row
        if packed.is_cuda:
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = packed, None
        return self

    @property
    def is_deferred(self) -> bool:
        return self.result is None

    @property
    def ready(self) -> bool:
        """Whether :meth:`wait` would return without waiting for the device."""
        return self.result is not None or self.event is None or self.event.query()

    def wait(self) -> StepResult:
        if self.result is None:
            # NOTE: ``synchronize`` gives the GIL up even when the copy is done (``query``
            # keeps it): a thread that wants the GIL -- the event loop delivering outputs --
            # then runs first, and this one waits for it to let go
            if self.event is not None and not self.event.query():
                self.event.synchronize()
            flat = self.host.numpy()
            self.flat = flat[: self.n_tok].tolist()
            self.result = by_entry(self.entries, self.owners, self.flat)
            if self.lp_plan is not None:
                words = flat[self.n_tok:].reshape(len(self.lp_plan.rows), -1)
                self.result.token_lps, self.result.prompt_lps, self.result.logprobs = \
                    logprobs.unpack(words, self.lp_plan, self.entries)
            self.host = self.event = self.lp_plan = None
        return self.result


class Forwarded(NamedTuple):
    """A step between :meth:`ModelRunner.forward` and :meth:`ModelRunner.sample_step`: the host's
    plan of it and its logits on the device. Transient: made and consumed within one
    ``EngineCore.step`` call, never kept (the device tensors are the step's activations)."""

    batch: Sequence[tuple[Request, int]]
    sample_rows: list[list[int]]  # per entry: its sampled rows
    plp: list  # prompt-logprob rows (engine.sample.logprobs.prompt_rows)
    owners: list[int]  # per sampled row: its entry
    logits_all: Optional[torch.Tensor]  # sampled rows, then prompt-logprob rows; None: no row
    logits: Optional[torch.Tensor]  # the sampled rows of logits_all
    sb: Optional[SamplingBatch]
    processed: Optional[torch.Tensor]  # the sampled rows' logits after logits processing
