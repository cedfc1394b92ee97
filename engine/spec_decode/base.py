"""The proposer framework shared by every speculator, and verification.

A speculator is a host-side object: it holds no tensor (the runner refuses one that does); a
proposer that needs device memory adopts one resource into the runner's owner and reads it back
with ``runner.resource("speculator")``. It keeps only a weak reference to the runner, so the
runner's object graph stays acyclic and free of device memory after ``shutdown()``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence
import weakref

import torch

from engine.request import Request
from engine.sample.sampler import SamplingBatch, StepResult, apply_penalty_free_filters

_TINY = 1e-12


@dataclasses.dataclass
class SpecStats:
    """Engine-wide speculation counters (verification is where they are known exactly)."""

    verifications: int = 0  # entries verified with at least one draft token
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted (before stop/max_tokens truncation)
    #: by draft position (0 = the first drafted token): verifications that accepted it
    accepted_per_pos: list = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verification (the step then emits this + 1 tokens)."""
        return self.accepted / self.verifications if self.verifications else 0.0

    def as_dict(self) -> dict:
        return {"verifications": self.verifications, "proposed": self.proposed,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}


def race(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """Sample one token per row of ``probs`` [N, V] by the exponential race (argmax p / E), with
    exactly the noise draws of :func:`engine.sample.sampler.sample` (a seeded row draws V exponentials
    from its own generator)."""
    noise = torch.empty_like(probs)
    unseeded = []
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
        else:
            unseeded.append(i)
    if len(unseeded) == len(generators):
        noise.exponential_()
    elif unseeded:
        rows = torch.tensor(unseeded, device=probs.device)
        noise[rows] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_()
    return (probs / noise).argmax(-1)


def verify_tokens(logits: torch.Tensor, sample_rows: Sequence[Sequence[int]],
                  drafts: Sequence[Sequence[int]], sb: SamplingBatch,
                  draft_probs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                  ) -> tuple[list[list[int]], Optional[list[list[float]]], list[int]]:
    """Verify draft tokens against the target's logits.

    ``logits`` [R, V] fp32; ``sample_rows[i]`` the rows of entry i: row ``j`` holds the target's
    prediction after the real prefix plus drafts ``drafts[i][:j]``, so an entry with ``m`` drafts
    has ``m + 1`` rows (none: the entry samples nothing). ``sb`` describes every row (per-row
    temperature/top-k/top-p/generator; an entry's rows share its parameters).
    ``draft_probs[i]`` is the draft's distribution [m, V] for entry i (same filters), or None for
    a deterministic proposal (a point mass: n-gram lookup or a greedy draft).

    Greedy rows accept the longest prefix of drafts equal to the target's argmax and add the
    argmax after it. Sampled rows accept draft x with probability min(1, p(x)/q(x)); at the first
    rejection they sample from normalize(max(0, p - q)) (for a point mass: p without x); when all
    drafts are accepted they sample a bonus token from p at the last row. Returns
    (tokens per entry, logprobs per entry or None, accepted drafts per entry).
    """
    device = logits.device
    n_entries = len(sample_rows)
    draft_probs = draft_probs if draft_probs is not None else [None] * n_entries
    greedy_row = (sb.temperature == 0).tolist()
    argmax = logits.argmax(-1)
    probs = None if sb.all_greedy else apply_penalty_free_filters(logits, sb).softmax(-1)

    # dense draft distributions, stacked: entry i's row j is qcat[q_off[i] + j]
    q_off: dict[int, int] = {}
    q_list: list[torch.Tensor] = []
    n_q = 0
    for i, rows in enumerate(sample_rows):
        q = draft_probs[i]
        if q is not None and len(rows) > 1 and not greedy_row[rows[0]]:
            assert q.shape[0] == len(rows) - 1, f"entry {i}: draft probs for {q.shape[0]} tokens"
            q_off[i] = n_q
            q_list.append(q)
            n_q += q.shape[0]
    qcat = torch.cat(q_list) if q_list else None

    # one flat list of (row, draft token) checks
    chk_rows: list[int] = []
    chk_toks: list[int] = []
    chk_sampled: list[bool] = []
    dense_at: list[int] = []  # check indices whose q is dense ...
    dense_q: list[int] = []  # ... and their qcat rows
    seeded: list[tuple[int, int, torch.Generator]] = []  # (first check, count, generator)
    for i, rows in enumerate(sample_rows):
        m = len(rows) - 1
        if m <= 0:
            continue
        d = drafts[i]
        assert len(d) == m, f"entry {i}: {m} draft rows but {len(d)} drafts"
        sampled = not greedy_row[rows[0]]
        if sampled and sb.generators[rows[0]] is not None:
            seeded.append((len(chk_rows), m, sb.generators[rows[0]]))
        if i in q_off:
            dense_at.extend(range(len(chk_rows), len(chk_rows) + m))
            dense_q.extend(range(q_off[i], q_off[i] + m))
        chk_rows.extend(rows[:m])
        chk_toks.extend(d)
        chk_sampled.extend([sampled] * m)
    accept: list[bool] = []
    if chk_rows:
        rows_t = torch.tensor(chk_rows, device=device)
        toks_t = torch.tensor(chk_toks, device=device)
        acc = argmax[rows_t] == toks_t
        if probs is not None and any(chk_sampled):
            p_x = probs[rows_t, toks_t]
            q_x = torch.ones_like(p_x)  # a point mass unless the draft said otherwise
            if dense_at:
                at = torch.tensor(dense_at, device=device)
                q_x[at] = qcat[torch.tensor(dense_q, device=device), toks_t[at]]
            u = torch.rand(len(chk_rows), device=device)
            for c0, m, g in seeded:
                u[c0:c0 + m] = torch.rand(m, generator=g, device=device)
            # accept with probability min(1, p/q)
            acc = torch.where(torch.tensor(chk_sampled, device=device), u * q_x < p_x, acc)
        accept = acc.tolist()

    tokens: list[list[int]] = [[] for _ in range(n_entries)]
    n_acc = [0] * n_entries
    greedy_final: list[tuple[int, int]] = []  # (entry, row)
    samp_final: list[tuple[int, int]] = []  # (entry, row)
    rej_point: list[tuple[int, int]] = []  # (index in samp_final, rejected draft token)
    rej_dense: list[tuple[int, int]] = []  # (index in samp_final, qcat row)
    c = 0
    for i, rows in enumerate(sample_rows):
        if not rows:
            continue
        m = len(rows) - 1
        j = 0
        while j < m and accept[c + j]:
            j += 1
        c += m
        n_acc[i] = j
        tokens[i] = list(drafts[i][:j]) if m > 0 else []
        if greedy_row[rows[0]]:
            greedy_final.append((i, rows[j]))
            continue
        if j < m:  # rejected: sample from the residual
            if i in q_off:
                rej_dense.append((len(samp_final), q_off[i] + j))
            else:
                rej_point.append((len(samp_final), drafts[i][j]))
        samp_final.append((i, rows[j]))

    finals: list[tuple[int, int]] = []
    if greedy_final:
        picked = argmax[torch.tensor([r for _, r in greedy_final], device=device)].tolist()
        finals += [(i, t) for (i, _), t in zip(greedy_final, picked)]
    if samp_final:
        assert probs is not None
        dist = probs[torch.tensor([r for _, r in samp_final], device=device)]
        if rej_point or rej_dense:
            p = dist.clone()
            if rej_point:  # q = point mass at x: max(0, p - q) is p without x
                dist[torch.tensor([k for k, _ in rej_point], device=device),
                     torch.tensor([x for _, x in rej_point], device=device)] = 0
            if rej_dense:
                ks = torch.tensor([k for k, _ in rej_dense], device=device)
                dist[ks] = (dist[ks] - qcat[torch.tensor([r for _, r in rej_dense], device=device)]).clamp_(min=0)
            total = dist.sum(-1, keepdim=True)
            # p == q up to rounding: rejection had probability ~0, and p is then the right law
            dist = torch.where(total > _TINY, dist / total.clamp(min=_TINY), p)
        gens = [sb.generators[sample_rows[i][0]] for i, _ in samp_final]
        picked = race(dist, gens).tolist()
        finals += [(i, t) for (i, _), t in zip(samp_final, picked)]
    for i, t in finals:
        tokens[i].append(t)

    logprobs = None
    if sb.need_logprobs:
        lp_rows = [sample_rows[i][j] for i in range(n_entries) for j in range(len(tokens[i]))]
        lp_toks = [t for i in range(n_entries) for t in tokens[i]]
        flat: list[float] = []
        if lp_rows:
            lsm = logits[torch.tensor(lp_rows, device=device)].log_softmax(-1)
            flat = lsm.gather(1, torch.tensor(lp_toks, device=device)[:, None]).squeeze(1).tolist()
        logprobs, k = [], 0
        for i in range(n_entries):
            logprobs.append(flat[k:k + len(tokens[i])])
            k += len(tokens[i])
    return tokens, logprobs, n_acc


class Speculator:
    """Base proposer: limits, bookkeeping, verification. Subclasses implement ``_propose``."""

    name = "base"

    def __init__(self, config, runner):
        self.k = config.num_speculative_tokens
        self._runner = weakref.ref(runner)
        self.stats_ = SpecStats(accepted_per_pos=[0] * self.k)

    @property
    def runner(self):
        r = self._runner()
        if r is None:  # pragma: no cover - the runner owns the speculator
            raise RuntimeError("the runner of this speculator is gone")
        return r

    def wake(self) -> None:
        """After a sleep of the runner: rebuild what the proposer keeps on the device (nothing
        here; the draft model's speculator overrides it)."""

    # -- proposing ---------------------------------------------------------------------------
    def limit(self, req: Request) -> int:
        """How many draft tokens ``req`` may take this step (0: not decoding, or no room)."""
        if req.num_computed_tokens != req.num_tokens - 1 or req.num_computed_tokens == 0:
            return 0
        if req.params.output_dependent_logits:
            return 0  # each draft position would need its own penalties and bans: not drafted
        r = self.runner
        room_out = req.params.max_tokens - req.num_output_tokens - 1
        room_ctx = r.max_model_len - req.num_tokens - 1
        # the target must be able to hold num_tokens + k tokens, or the scheduler would
        # preempt the request forever
        room_kv = r.num_blocks * r.block_size - req.num_tokens
        return max(0, min(self.k, room_out, room_ctx, room_kv))

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` on every decoding request in ``running`` (maybe empty)."""
        want: list[tuple[Request, int]] = []
        for req in running:
            req.spec_token_ids = []
            n = self.limit(req)
            if n > 0:
                want.append((req, n))
        with torch.inference_mode():
            self._propose(running, want)

    def _propose(self, running: Sequence[Request], want: list[tuple[Request, int]]) -> None:
        raise NotImplementedError

    def _draft_probs(self, batch) -> Optional[list]:
        """Per entry: the draft distribution [m, V] of its proposal, or None (point mass)."""
        return None

    # -- verifying ---------------------------------------------------------------------------
    def verify(self, batch, sample_rows, logits, sb: SamplingBatch) -> StepResult:
        # ``sample_rows`` index the packed batch; ``logits`` holds just those rows, in order
        rows: list[list[int]] = []
        c = 0
        for r in sample_rows:
            rows.append(list(range(c, c + len(r))))
            c += len(r)
        drafts = [req.spec_token_ids if len(rows[i]) > 1 else []
                  for i, (req, _) in enumerate(batch)]
        tokens, logprobs, n_acc = verify_tokens(logits, rows, drafts, sb,
                                                self._draft_probs(batch))
        st = self.stats_
        for i, d in enumerate(drafts):
            if d:
                st.verifications += 1
                st.proposed += len(d)
                st.accepted += n_acc[i]
                for pos in range(n_acc[i]):
                    st.accepted_per_pos[pos] += 1
        self._verified(batch, drafts, n_acc)
        return StepResult(tokens, logprobs)

    def _verified(self, batch, drafts, n_acc) -> None:
        """Hook: after verification (the draft model rolls its cache back here)."""

    # -- lifecycle ---------------------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop its state."""

    def stats(self) -> dict:
        return self.stats_.as_dict()


__all__ = ["Speculator", "SpecStats", "verify_tokens", "race"]
