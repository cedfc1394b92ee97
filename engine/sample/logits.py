"""Logits processing before sampling, for the whole batch at once on the device: the allow-list
(``allowed_token_ids``), ``logit_bias``, ``bad_words`` (engine.sample.bad_words: banned tokens get -inf), the repetition penalty (over prompt and output tokens,
as in vLLM/HF: positive logits divided by it, negative ones multiplied) and the frequency and
presence penalties (over output tokens: ``logit -= frequency * count + presence * (count > 0)``).

The host only gathers index lists (token ids per row, never a loop over the vocabulary); each
kind of processing is one scatter/gather over the rows that ask for it.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch

from .bad_words import banned_now


class LogitsPlan:
    """Index lists for one step's rows (``reqs[r]`` owns row ``r``); None if no row asks."""

    __slots__ = ("allow_rows", "allow_r", "allow_t", "bias_r", "bias_t", "bias_v",
                 "rep_r", "rep_t", "rep_v", "pen_r", "pen_t", "pen_v",
                 "ban_r", "ban_t")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, [])

    @staticmethod
    def build(reqs: Sequence) -> Optional["LogitsPlan"]:
        if not any(r.params.needs_logits_processing for r in reqs):
            return None
        plan = LogitsPlan()
        for row, req in enumerate(reqs):
            p = req.params
            if not p.needs_logits_processing:
                continue
            if p.allowed_token_ids:
                ids = sorted(set(p.allowed_token_ids))
                plan.allow_r.extend([len(plan.allow_rows)] * len(ids))
                plan.allow_t.extend(ids)
                plan.allow_rows.append(row)
            if p.logit_bias:
                plan.bias_r.extend([row] * len(p.logit_bias))
                plan.bias_t.extend(p.logit_bias.keys())
                plan.bias_v.extend(float(v) for v in p.logit_bias.values())
            if p.repetition_penalty != 1.0:
                seen = set(req.token_ids)
                plan.rep_r.extend([row] * len(seen))
                plan.rep_t.extend(seen)
                plan.rep_v.extend([float(p.repetition_penalty)] * len(seen))
            if p.presence_penalty or p.frequency_penalty:
                counts = Counter(req.output_token_ids)
                for t, c in counts.items():
                    plan.pen_r.append(row)
                    plan.pen_t.append(t)
                    plan.pen_v.append(p.frequency_penalty * c + p.presence_penalty)
            if req.bad_words:
                banned = banned_now(req.bad_words, req.token_ids, req.num_prompt_tokens)
                plan.ban_r.extend([row] * len(banned))
                plan.ban_t.extend(banned)
        return plan

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A processed copy of fp32 ``logits`` [N, V]."""
        dev = logits.device
        out = logits.clone()

        def t(xs, dtype=torch.long):
            return torch.tensor(xs, dtype=dtype, device=dev)

        if self.allow_rows:
            rows = t(self.allow_rows)
            mask = torch.full((len(self.allow_rows), out.shape[1]), float("-inf"), device=dev)
            mask[t(self.allow_r), t(self.allow_t)] = 0.0
            out[rows] = out[rows] + mask
        if self.bias_r:
            out.index_put_((t(self.bias_r), t(self.bias_t)), t(self.bias_v, torch.float32),
                           accumulate=True)
        if self.rep_r:
            r, k = t(self.rep_r), t(self.rep_t)
            sel, pen = out[r, k], t(self.rep_v, torch.float32)
            out[r, k] = torch.where(sel > 0, sel / pen, sel * pen)
        if self.pen_r:
            out.index_put_((t(self.pen_r), t(self.pen_t)), -t(self.pen_v, torch.float32),
                           accumulate=True)
        if self.ban_r:
            out[t(self.ban_r), t(self.ban_t)] = float("-inf")
        return out


__all__ = ["LogitsPlan"]
