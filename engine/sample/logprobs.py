"""Logprobs for one step, for the whole batch on the device: one log-softmax and one top-k over
every row that some request asks about -- its sampled (or accepted speculative) tokens, and the
prompt tokens of a request with ``prompt_logprobs`` whose prefill chunk ran this step.

Logprobs are of the model's raw distribution (before temperature, penalties and biases), as
vLLM returns by default; a request with ``logprobs_mode="processed"`` gets those of the
distribution it is sampled from (:func:`source`; vLLM's ``processed_logprobs``). The device writes one int32 tensor of rows in the layout of
:class:`engine.params.Logprobs` (token id, logprob, rank, top ids, top logprobs); it comes to
the host in one copy (with the sampled tokens, see ``ModelRunner.execute``) and is cut into one
``Logprobs`` (one bytes object) per request: no Python object per alternative is made here.
The rank (1 = most likely) is computed for prompt tokens only (vLLM's ``prompt_logprobs`` show it).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from engine.params import Logprobs
from engine.sample.sampler import apply_penalty_free_filters

_HEAD = 3  # token id, logprob, rank (engine.params.Logprobs)


def prompt_rows(batch: Sequence, row_starts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(entry, packed row, prompt token it predicts)`` for prompt logprobs still missing.

    The row at position ``j`` predicts the token at ``j + 1``; a request holds the rows of
    positions ``1 .. req.num_prompt_lps`` already (a recompute after preemption adds none twice).
    """
    out = []
    for i, (req, n) in enumerate(batch):
        if req.params.prompt_logprobs is None:
            continue
        start = req.num_computed_tokens
        first, last = max(start, req.num_prompt_lps), min(start + n, req.num_prompt_tokens - 1)
        base = row_starts[i] - start
        out.extend((i, base + j, req.token_ids[j + 1]) for j in range(first, last))
    return out


class Plan(NamedTuple):
    """Which rows of a step's logits get logprobs: ``rows`` (indices into the logits), their
    ``spans`` per entry ``(entry, first, end, k)`` -- sampled tokens first (``n_out`` rows),
    then prompt tokens -- and the prompt rows' tokens (the sampled ones are known later)."""

    rows: list[int]
    spans: list[tuple[int, int, int, int]]
    n_out: int
    prompt_tokens: list[int]
    k: int  # the widest top-k asked for (the device computes this many for every row)


def plan(batch, sample_rows, counts: Sequence[int], plp, vocab_size: int) -> Optional[Plan]:
    """The rows of entries with ``logprobs`` (their first ``counts[i]`` sample rows: the new
    tokens) and of ``plp`` (:func:`prompt_rows`); None when no row is asked for."""
    rows: list[int] = []
    spans = []
    c = n_out = 0
    for i, (req, _) in enumerate(batch):
        n = counts[i]
        if n and req.params.logprobs:
            spans.append((i, n_out, n_out + n, req.params.top_logprobs))
            rows.extend(range(c, c + n))
            n_out += n
        c += len(sample_rows[i])
    for m, (i, _, _) in enumerate(plp):
        if spans and spans[-1][0] == i and spans[-1][1] >= n_out:
            spans[-1] = (i, spans[-1][1], n_out + m + 1, spans[-1][3])
        else:
            spans.append((i, n_out + m, n_out + m + 1, batch[i][0].params.prompt_logprobs))
        rows.append(c + m)
    if not rows:
        return None
    k = min(max(s[3] for s in spans), vocab_size)
    return Plan(rows, spans, n_out, [t for _, _, t in plp], k)


def source(batch, owners: Sequence[int], logits_all: torch.Tensor,
           processed: Optional[torch.Tensor], sb) -> torch.Tensor:
    """The logits logprobs are taken from: ``logits_all`` (raw), except the sampled rows of
    requests with ``logprobs_mode="processed"``: there the distribution sampled from --
    penalties, biases, allow-lists and grammar masks (``processed``), then temperature, top-k,
    top-p and min-p (greedy rows: no temperature); the tokens they exclude get -inf."""
    rows = [j for j, i in enumerate(owners) if batch[i][0].params.logprobs_mode == "processed"]
    if not rows or processed is None:
        return logits_all
    idx = _to(rows, logits_all.device)
    out = logits_all.float()
    out = out.clone() if out is logits_all else out
    out[idx] = apply_penalty_free_filters(processed.float(), sb)[idx]
    return out


def device_rows(logits: torch.Tensor, p: Plan, sampled: torch.Tensor) -> torch.Tensor:
    """The rows of ``p`` as one int32 tensor [len(rows), 3 + 2k] on the device; ``sampled``
    [n_out] (long, on the device): the tokens of the sampled rows.

    The log-softmax is taken as ``logit - logsumexp``: one pass for the normalizer, one top-k
    over the raw logits (the same order), no [N, V] tensor written."""
    sel, toks, raw, rank = _selected(logits, p, sampled)
    lse = sel.logsumexp(-1, keepdim=True)
    parts = [toks.int()[:, None], (raw - lse).view(torch.int32), rank]
    if p.k > 0:
        vals, idx = _topk_cpu(sel, p.k) if sel.device.type == "cpu" else sel.topk(p.k, dim=-1)
        parts += [idx.int(), (vals - lse).view(torch.int32)]
    return torch.cat(parts, 1)


def device_rows_invariant(logits: torch.Tensor, p: Plan, sampled: torch.Tensor) -> torch.Tensor:
    """:func:`device_rows` for deterministic mode: each row's logprobs from ``log_softmax``,
    whose CPU kernel reduces every row alone, in one pass, whatever the rows beside it
    (``logsumexp`` splits a lone row's sum across the threads but gives several rows one thread
    each: a row's normalizer then changed with the batch). The values are log_softmax's
    (``x - max - log(sum)``), as a training-side recomputation with ``log_softmax`` has them."""
    sel, toks, _, rank = _selected(logits, p, sampled)
    logp = torch.log_softmax(sel, -1)
    parts = [toks.int()[:, None], logp.gather(1, toks[:, None]).view(torch.int32), rank]
    if p.k > 0:
        idx = _top_ordered(sel, p.k)
        parts += [idx.int(), logp.gather(1, idx).view(torch.int32)]
    return torch.cat(parts, 1)


def _top_ordered(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's ``k`` largest, largest first, equal values by the lower index,
    so that a request's top k are the first k of any wider top k (``_topk_cpu``'s selection
    breaks ties by its pivots, which depend on the k asked: the widest in the step)."""
    if x.device.type != "cpu":
        return x.sort(dim=-1, descending=True, stable=True)[1][:, :k]
    a = x.detach().contiguous().numpy()
    thr = np.partition(a, a.shape[1] - k, axis=1)[:, a.shape[1] - k]  # each row's k-th largest
    out = np.empty((a.shape[0], k), dtype=np.int64)
    for r, row in enumerate(a):
        above = np.flatnonzero(row > thr[r])
        chosen = np.concatenate([above, np.flatnonzero(row == thr[r])[: k - above.size]])
        out[r] = chosen[np.lexsort((chosen, -row[chosen]))]
    return torch.from_numpy(out)


def _selected(logits: torch.Tensor, p: Plan, sampled: torch.Tensor):
    """The plan's rows (float32), their tokens, the tokens' raw logits and ranks (prompt rows)."""
    dev = logits.device
    rows = p.rows
    # host-to-device index copies are asynchronous: a blocking one would wait for the step in
    # flight (overlapped scheduling)
    sel = logits if rows == list(range(logits.shape[0])) else logits[_to(rows, dev)]
    sel = sel.float()
    toks = sampled
    if p.prompt_tokens:
        toks = torch.cat([sampled, _to(p.prompt_tokens, dev)])
    raw = sel.gather(1, toks[:, None])
    rank = torch.zeros((len(rows), 1), dtype=torch.int32, device=dev)
    if p.n_out < len(rows):
        rank[p.n_out:] = ((sel[p.n_out:] > raw[p.n_out:]).sum(-1, keepdim=True) + 1).int()
    return sel, toks, raw, rank


def _to(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _topk_cpu(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` on CPU through numpy's selection (``argpartition``, then a sort of
    the k per row): measured on [256, 512] fp32, one thread, 0.45 ms against torch's 0.93 ms --
    the largest host cost that logprobs add to a CPU step."""
    a = x.detach().contiguous().numpy()
    idx = np.argpartition(a, a.shape[1] - k, axis=1)[:, a.shape[1] - k:]
    v = np.take_along_axis(a, idx, 1)
    order = np.argsort(-v, axis=1, kind="stable")
    return (torch.from_numpy(np.take_along_axis(v, order, 1)),
            torch.from_numpy(np.take_along_axis(idx, order, 1)))


def unpack(words: np.ndarray, p: Plan, num_entries: int) -> tuple[list, dict, list]:
    """From the host copy of :func:`device_rows` ([rows, 3 + 2k] int32): per entry its new
    tokens' :class:`Logprobs` (None if it asked for none), ``{entry: prompt Logprobs}``, and
    per entry the new tokens' logprobs as floats (``RequestOutput.logprobs``; None likewise)."""
    K = p.k
    out: list[Optional[Logprobs]] = [None] * num_entries
    floats: list[Optional[list[float]]] = [None] * num_entries
    prompt: dict[int, Logprobs] = {}
    words = words.astype("<i4", copy=False)
    chosen = words[: p.n_out, 1].view("<f4").tolist()
    blob = words.tobytes()  # slicing bytes per entry is cheaper than a numpy slice each
    w = 4 * words.shape[1]
    for i, a, b, k in p.spans:
        k = min(k, K)
        if k == K:
            lp = Logprobs(k, blob[a * w: b * w])
        else:  # a narrower request: its own top k columns only
            block = words[a:b]
            block = np.concatenate([block[:, : _HEAD + k], block[:, _HEAD + K: _HEAD + K + k]], 1)
            lp = Logprobs(k, block.tobytes())
        if a < p.n_out:
            out[i] = lp
            floats[i] = chosen[a:b]
        else:
            prompt[i] = lp
    return out, prompt, floats


__all__ = ["prompt_rows", "Plan", "plan", "source", "device_rows", "device_rows_invariant", "unpack"]
