"""Checks of deterministic mode for users (docs/deterministic.md): is a request's output the same,
bit for bit, alone and inside a batch of others?

    from engine import EngineConfig, SamplingParams
    from engine.testing import check_batch_invariance

    report = check_batch_invariance(EngineConfig(model="default", deterministic=True),
                                    prompt_ids, SamplingParams(max_tokens=32, logprobs=True,
                                                               top_logprobs=5))
    assert report.identical, report.first_difference

Everything runs in this process, synchronously: one :class:`~engine.runner.model_runner.ModelRunner`
and :class:`~engine.core.engine_core.EngineCore`, stepped in a plain loop (no event loop).
:func:`run_workload` runs any list of requests and returns each one's :class:`Outcome` (tokens,
and the logprob rows as the engine packed them: the float32 bits), for comparisons between two
configurations (prefix caching on and off, a small KV cache, chunked prefill, overlap);
:func:`full_sequence_logprobs` recomputes a sequence's logprobs in one forward over the whole
sequence, as a trainer would.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional, Sequence

import msgspec
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.forward.step_inputs import packed_forward
from engine.memory.owner import Resource as R
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner

#: (request id, prompt token ids, params, steps to run before it is added)
Job = tuple[str, Sequence[int], SamplingParams, int]


@dataclasses.dataclass
class Outcome:
    """One request's output: its tokens, why it ended, and its logprob rows (``Logprobs.rows``
    of the new tokens and of the prompt: token ids, float32 logprobs, ranks, top ids and top
    logprobs, as bytes -- equal bytes are equal bits)."""

    tokens: list[int]
    finish_reason: Optional[str] = None
    logprobs: bytes = b""
    prompt_logprobs: bytes = b""

    def difference(self, other: "Outcome") -> Optional[str]:
        """Where ``other`` first differs from this one, in words; None if they are identical."""
        for i, (a, b) in enumerate(zip(self.tokens, other.tokens)):
            if a != b:
                return f"token {i}: {a} != {b}"
        if len(self.tokens) != len(other.tokens):
            return f"{len(self.tokens)} tokens != {len(other.tokens)}"
        for name in ("logprobs", "prompt_logprobs"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                at = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
                return f"{name}: the rows differ from byte {at} of {len(a)}"
        if self.finish_reason != other.finish_reason:
            return f"finish_reason {self.finish_reason!r} != {other.finish_reason!r}"
        return None


@dataclasses.dataclass
class InvarianceReport:
    identical: bool
    alone: Outcome
    batched: Outcome
    others: int  # requests beside it in the batched run
    first_difference: Optional[str] = None


def load(config: EngineConfig) -> tuple[ModelRunner, EngineCore]:
    """A loaded runner and its engine core (``runner.shutdown()`` releases both)."""
    runner = ModelRunner(config)
    runner.load()
    return runner, EngineCore(runner)


def run_jobs(core: EngineCore, jobs: Sequence[Job], max_steps: int = 1_000_000) -> dict[str, Outcome]:
    """Add each job once ``core`` has run its steps (the fourth field, counted from this call),
    step until every request has ended; each request's :class:`Outcome`."""
    pending = sorted(jobs, key=lambda j: j[3])
    out: dict[str, Outcome] = {}
    lps: dict[str, list] = {}
    steps = 0
    while pending or core.has_work():
        while pending and pending[0][3] <= steps:
            rid, ids, params, _ = pending.pop(0)
            core.add_request(rid, list(ids), params)
            out[rid] = Outcome([])
            lps[rid] = []
        for o in core.step():
            got = out[o.request_id]
            got.tokens += o.token_ids
            if o.token_logprobs is not None:
                lps[o.request_id].append(o.token_logprobs.rows)
            if o.prompt_logprobs is not None:
                got.prompt_logprobs += o.prompt_logprobs.rows
            if o.finished:
                got.finish_reason = o.finish_reason
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"the workload did not finish in {max_steps} steps")
    for rid, parts in lps.items():
        out[rid].logprobs = b"".join(parts)
    return out


def run_workload(config: EngineConfig, jobs: Sequence[Job]) -> dict[str, Outcome]:
    """:func:`run_jobs` on a freshly loaded engine of ``config``, released after."""
    runner, core = load(config)
    try:
        return run_jobs(core, jobs)
    finally:
        runner.shutdown()


def tensor_parallel_differences(config: EngineConfig, jobs: Sequence[Job],
                                world: int = 2) -> dict[str, str]:
    """``jobs`` on ``config`` with ``tensor_parallel_size`` 1 and ``world``: each request whose
    outcome differs, and how (empty: identical; deterministic mode promises it for every
    ``world`` dividing the KV heads)."""
    one = run_workload(msgspec.structs.replace(config, tensor_parallel_size=1), jobs)
    many = run_workload(msgspec.structs.replace(config, tensor_parallel_size=world), jobs)
    return {r: d for r in one if (d := one[r].difference(many[r])) is not None}


def mixed_jobs(n: int, vocab_size: int, *, seed: int = 0, prefix: Sequence[int] = (),
               max_prompt: int = 96, max_tokens: int = 24, first_step: int = 0) -> list[Job]:
    """``n`` requests of mixed shapes: prompts of 1 to ``max_prompt`` random tokens (every third
    one starting with ``prefix``), 1 to ``max_tokens`` tokens out, greedy or seeded sampling,
    some with logprobs; added over the first few steps from ``first_step`` on."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, max_prompt))]
        if i % 3 == 0 and prefix:
            ids = list(prefix) + ids[: max(1, len(ids) // 4)]
        sampled = i % 4 == 1
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens), ignore_eos=True,
                                temperature=0.8 if sampled else 0.0,
                                seed=rng.randrange(1 << 30) if sampled else None,
                                logprobs=i % 2 == 0, top_logprobs=rng.randint(0, 5) if i % 2 == 0 else 0)
        jobs.append((f"other-{i}", ids, params, first_step + rng.randint(0, 3)))
    return jobs


def check_batch_invariance(config: EngineConfig, prompt_ids: Sequence[int], params: SamplingParams,
                           others: int = 255, seed: int = 0,
                           other_jobs: Optional[Sequence[Job]] = None) -> InvarianceReport:
    """Run the request alone, then -- on the same engine, its prefix cache emptied -- amid
    ``others`` mixed requests (:func:`mixed_jobs`, some sharing its first half; or
    ``other_jobs``), added around it so that it is prefilled beside others' decodes; compare.
    Ask for ``logprobs`` (and ``top_logprobs``, ``prompt_logprobs``) in ``params`` to compare
    those too. Without ``config.deterministic`` the answer is what the default path gives."""
    runner, core = load(config)
    try:
        alone = run_jobs(core, [("target", prompt_ids, params, 0)])["target"]
        core.reset_kv()
        if other_jobs is None:
            other_jobs = mixed_jobs(others, runner.model_config.vocab_size, seed=seed,
                                    prefix=list(prompt_ids)[: len(prompt_ids) // 2])
        batched = run_jobs(core, [*other_jobs, ("target", prompt_ids, params, 2)])["target"]
    finally:
        runner.shutdown()
    diff = alone.difference(batched)
    return InvarianceReport(diff is None, alone, batched, len(other_jobs), diff)


@torch.inference_mode()
def full_sequence_logprobs(runner: ModelRunner, token_ids: Sequence[int]) -> torch.Tensor:
    """float32 log-softmax rows ``[len(token_ids), vocab]`` of one forward over the whole
    sequence (row j: the distribution of the token after ``token_ids[: j + 1]``): one prefill
    chunk on blocks ``0 ..`` of ``runner``'s cache, nothing cached, as a trainer recomputes
    them. ``runner`` is loaded and idle; what its cache held is overwritten."""
    n = len(token_ids)
    bs = runner.block_size
    if -(-n // bs) > runner.num_blocks:
        raise ValueError(f"{n} tokens need more than the cache's {runner.num_blocks} blocks")
    model = runner.resource(R.WEIGHTS)
    hidden = packed_forward(model, runner.resource(R.KV_CACHE).tensor,
                            runner.resource(R.MODEL_STATE), None, runner.device, bs,
                            [(list(token_ids), 0, list(range(-(-n // bs))), False)])
    return torch.log_softmax(model.logits(hidden).float(), -1)


def logprob_rows(outcome: Outcome, k: int) -> list[tuple[int, float]]:
    """(token id, logprob) of each new token from an :class:`Outcome`'s rows (``k``: the
    request's ``top_logprobs``)."""
    import numpy as np

    words = np.frombuffer(outcome.logprobs, dtype="<i4").reshape(-1, 3 + 2 * k)
    return list(zip(words[:, 0].tolist(), words[:, 1].view("<f4").tolist()))


__all__ = ["Outcome", "InvarianceReport", "Job", "load", "run_jobs", "run_workload", "mixed_jobs",
           "check_batch_invariance", "tensor_parallel_differences", "full_sequence_logprobs",
           "logprob_rows"]
