"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs.

Sampling uses the exponential-race trick (argmax of p / E with E ~ Exp(1)), which needs no
host sync and lets a seeded request draw its noise from its own generator, so its result does
not depend on which other requests share the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

from engine.ops.triton import fused_sample

from .logits import LogitsPlan


class StepResult:
    """Per scheduled entry of a step: the new tokens (empty while a prefill is still chunking)
    and, when asked for, their logprobs."""

    __slots__ = ("tokens", "logprobs", "token_lps", "prompt_lps")

    def __init__(self, tokens: list[list[int]], logprobs: Optional[list[list[float]]]):
        self.tokens = tokens
        self.logprobs = logprobs
        #: per entry, for requests with logprobs: engine.sample.logprobs entries of the new tokens
        self.token_lps: Optional[list[list]] = None
        #: {entry: engine.sample.logprobs entries of prompt tokens} (prompt_logprobs)
        self.prompt_lps: dict[int, list] = {}


@dataclasses.dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32 (0 = greedy)
    top_k: torch.Tensor  # [N] long (0 = off)
    top_p: torch.Tensor  # [N] float32
    generators: list[Optional[torch.Generator]]  # per row; None = the shared default stream
    all_greedy: bool
    need_logprobs: bool  # the sampled tokens' logprobs from sample() (engine.sample.logprobs does more)
    min_p: Optional[torch.Tensor] = None  # [N] float32, None when no row uses it
    plan: Optional[LogitsPlan] = None  # penalties, biases, allow-lists (engine.sample.logits)
    # whether any row uses top-k / top-p: known on the host (the rows' values are), so the
    # sampler needs no device-to-host sync to skip the sort; None = look at the tensors
    any_top_k: Optional[bool] = None
    any_top_p: Optional[bool] = None
    # this step's seed for the unseeded rows' noise in the one-pass sampler
    # (engine/ops/triton/fused_sample.py); None: the torch path draws from torch's default generator
    noise_seed: Optional[int] = None


def build_sampling_batch(reqs: Sequence, generators: dict, device: torch.device) -> SamplingBatch:
    """The batch for one row per request of ``reqs`` (each ``Request.sampling_row`` was prepared
    at admission; ``generators``: request id -> its seeded generator)."""
    rows = [r.sampling_row for r in reqs]
    # one host tensor, one asynchronous copy: a blocking host-to-device copy would wait for
    # the step in flight (overlapped scheduling)
    vals = torch.from_numpy(np.array(rows, dtype=np.float64).reshape(-1, 3))
    vals = vals.to(device, non_blocking=True)
    return SamplingBatch(
        temperature=vals[:, 0].float(),
        top_k=vals[:, 1].long(),
        top_p=vals[:, 2].float(),
        generators=[generators.get(r.request_id) for r in reqs],
        all_greedy=all(r[0] == 0 for r in rows),
        need_logprobs=False,
        min_p=(torch.tensor([r.params.min_p for r in reqs], dtype=torch.float32).to(device, non_blocking=True)
               if any(r.params.min_p for r in reqs) else None),
        plan=LogitsPlan.build(reqs),
        any_top_k=any(r[1] > 0 for r in rows),
        any_top_p=any(r[2] < 1.0 for r in rows),
    )


def process(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits`` with the batch's penalties, biases and allow-lists applied (a copy), or
    ``logits`` itself when no row asks for any."""
    return logits if batch.plan is None else batch.plan.apply(logits)


def apply_penalty_free_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to fp32 ``logits`` [N, V] (greedy rows untouched)."""
    temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    logits = logits / temp[:, None]
    use_k = bool((batch.top_k > 0).any()) if batch.any_top_k is None else batch.any_top_k
    use_p = bool((batch.top_p < 1.0).any()) if batch.any_top_p is None else batch.any_top_p
    if use_k or use_p:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        if use_k:
            k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), torch.full_like(batch.top_k, vocab))
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if use_p:
            probs = sorted_logits.softmax(-1)
            cum = probs.cumsum(-1)
            # drop a token when the mass before it already reaches top_p (always keep the first);
            # rows without top-p keep all: their rounded mass can reach 1.0 before the tail, which
            # dropped tail tokens of a row only when another row of the step asked for top-p
            drop = ((cum - probs) >= batch.top_p[:, None]) & (batch.top_p < 1.0)[:, None]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, idx, sorted_logits)
    if batch.min_p is not None:  # drop tokens less likely than min_p x the most likely one
        probs = logits.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * batch.min_p[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximum); on CPU through numpy, whose argmax is vectorized:
    [8, 49152] fp32 23 us against torch's 550 us (one thread, measured)."""
    if x.device.type != "cpu":
        return x.argmax(-1)
    return torch.from_numpy(x.detach().contiguous().numpy().argmax(-1))


def sample(logits: torch.Tensor, batch: SamplingBatch,
           grammar: Optional[fused_sample.GrammarRows] = None
           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits: [N, V] fp32 → (tokens [N] long, logprobs of the chosen tokens [N] or None).
    ``grammar``: masks the one-pass sampler reads as it draws (only where :func:`one_pass`
    holds; the logits themselves stay unmasked, so no logprobs are asked)."""
    if grammar is not None:
        if not one_pass(logits, batch) or batch.need_logprobs:
            raise ValueError("grammar rows are read by the one-pass sampler alone")
        tokens = fused_sample.sample(logits, batch.temperature, batch.noise_seed, grammar,
                                     greedy=batch.all_greedy)
    elif batch.all_greedy:
        tokens = _argmax(logits)
    elif one_pass(logits, batch):
        tokens = fused_sample.sample(logits, batch.temperature, batch.noise_seed)
    else:
        greedy_tokens = _argmax(logits)
        probs = apply_penalty_free_filters(logits, batch).softmax(-1)
        noise = torch.empty_like(probs)
        for i, g in enumerate(batch.generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        unseeded = [i for i, g in enumerate(batch.generators) if g is None]
        if len(unseeded) == len(batch.generators):
            noise.exponential_()
        elif unseeded:
            rows = torch.tensor(unseeded).to(logits.device, non_blocking=True)
            noise[rows] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_()
        sampled = _argmax(probs / noise)
        tokens = torch.where(batch.temperature > 0, sampled, greedy_tokens)
    logprobs = None
    if batch.need_logprobs:
        logprobs = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def one_pass(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Whether :func:`engine.ops.triton.fused_sample.sample` draws this batch: temperature alone (no
    top-k / top-p / min-p), no seeded row, a noise seed given."""
    return (batch.noise_seed is not None and batch.any_top_k is False and batch.any_top_p is False
            and batch.min_p is None and all(g is None for g in batch.generators)
            and fused_sample.usable(logits))
