"""Logprobs for one step, for the whole batch on the device: one log-softmax and one top-k over
every row that some request asks about -- its sampled (or accepted speculative) tokens, and the
prompt tokens of a request with ``prompt_logprobs`` whose prefill chunk ran this step.

Logprobs are of the model's raw distribution (before temperature, penalties and biases), as
vLLM returns by default. A row's entry is ``(token_id, logprob, rank, top_ids, top_logprobs)``;
the rank (1 = most likely) is computed for prompt tokens only (vLLM's ``prompt_logprobs`` show it).
"""

from __future__ import annotations

from typing import Sequence

import torch

Entry = tuple[int, float, int, list[int], list[float]]


def prompt_rows(batch: Sequence, row_starts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(entry, packed row, prompt token it predicts)`` for prompt logprobs still missing.

    The row at position ``j`` predicts the token at ``j + 1``; a request holds the entries of
    positions ``1 .. len(req.prompt_lps)`` already (a recompute after preemption adds none twice).
    """
    out = []
    for i, (req, n) in enumerate(batch):
        if req.params.prompt_logprobs is None:
            continue
        start = req.num_computed_tokens
        first, last = max(start, len(req.prompt_lps)), min(start + n, req.num_prompt_tokens - 1)
        base = row_starts[i] - start
        out.extend((i, base + j, req.token_ids[j + 1]) for j in range(first, last))
    return out


def compute(logits: torch.Tensor, rows: list[int], tokens: list[int], ks: list[int],
            ranked: int = 0) -> list[Entry]:
    """Entries for ``rows`` of ``logits`` [*, V] (fp32) and the tokens they produced; ranks
    for rows from ``ranked`` on (the others get rank 0: not computed).

    The log-softmax is taken as ``logit - logsumexp``: one pass for the normalizer, one top-k
    over the raw logits (the same order), no [N, V] tensor written."""
    if not rows:
        return []
    dev = logits.device
    sel = logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows, device=dev)]
    sel = sel.float()
    lse = sel.logsumexp(-1, keepdim=True)
    raw = sel.gather(1, torch.tensor(tokens, device=dev)[:, None])
    chosen_l = (raw - lse).squeeze(1).tolist()
    rank_l = [0] * ranked
    if ranked < len(rows):
        rank_l += ((sel[ranked:] > raw[ranked:]).sum(-1) + 1).tolist()
    k = min(max(ks), sel.shape[1])
    if k > 0:
        vals, idx = sel.topk(k, dim=-1)
        vals_l, idx_l = (vals - lse).tolist(), idx.tolist()
    else:
        vals_l = idx_l = [[] for _ in rows]
    return [(tokens[m], chosen_l[m], rank_l[m] or None,
             idx_l[m] if ks[m] == k else idx_l[m][:ks[m]],
             vals_l[m] if ks[m] == k else vals_l[m][:ks[m]]) for m in range(len(rows))]


def for_step(batch, sample_rows, tokens, logits_all: torch.Tensor, plp) -> tuple[list, dict]:
    """Per entry: the entries of its new tokens (requests with ``logprobs``; else []), and
    ``{entry: [prompt entries]}``. ``logits_all`` holds the sample rows, in order, then the
    rows of ``plp`` (from :func:`prompt_rows`)."""
    rows, toks, ks, owner = [], [], [], []
    c = 0
    for i, (req, _) in enumerate(batch):
        if req.params.logprobs and tokens[i]:
            for j, t in enumerate(tokens[i]):
                rows.append(c + j)
                toks.append(t)
                ks.append(req.params.top_logprobs)
                owner.append(i)
        c += len(sample_rows[i])
    n_out = len(rows)
    for m, (i, _, t) in enumerate(plp):
        rows.append(c + m)
        toks.append(t)
        ks.append(batch[i][0].params.prompt_logprobs)
        owner.append(i)
    entries = compute(logits_all, rows, toks, ks, ranked=n_out)  # ranks: prompt logprobs only
    out: list[list[Entry]] = [[] for _ in batch]
    prompt: dict[int, list[Entry]] = {}
    for m, e in enumerate(entries):
        (out[owner[m]] if m < n_out else prompt.setdefault(owner[m], [])).append(e)
    return out, prompt


__all__ = ["prompt_rows", "compute", "for_step"]
