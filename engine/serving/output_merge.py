"""``merge_outputs``: consecutive pieces of one request's output as one piece.

A consumer that fell behind its stream takes everything pending at once (as vLLM's
``RequestOutputCollector`` does): one wake-up and one piece instead of one per step, with the
same tokens, text and logprobs, in order.
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from engine.params import Logprobs, RequestOutput


def merge_outputs(parts: Sequence[RequestOutput]) -> RequestOutput:
    """``parts`` (consecutive, of one request) as one ``RequestOutput``: the new tokens, text
    and logprobs of all of them, one after another; the cumulative counts and the ending
    (``finished``, ``finish_reason``, ``reason``) of the last; the prompt's logprobs, text, ids and
    cached tokens of the first that has them (they come with the first piece only)."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    ids: list[int] = []
    for p in parts:
        ids += p.token_ids
    lps = [p.logprobs for p in parts if p.logprobs is not None]
    rows = [p.token_logprobs for p in parts if p.token_logprobs is not None]
    return msgspec.structs.replace(
        last, token_ids=ids, text="".join(p.text for p in parts),
        logprobs=[x for lp in lps for x in lp] if lps else None,
        token_logprobs=Logprobs.join(rows) if rows else None,
        prompt_logprobs=next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None),
        prompt_text=next((p.prompt_text for p in parts if p.prompt_text is not None), None),
        prompt_token_ids=next((p.prompt_token_ids for p in parts
                               if p.prompt_token_ids is not None), None),
        num_cached_tokens=max(p.num_cached_tokens for p in parts))
