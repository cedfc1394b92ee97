"""``Recorder``: arrival times of every streamed piece of a benchmark run, turned into throughput
and latency figures (shared by the engine modes and the HF peers of ``bench.throughput``)."""

from __future__ import annotations

from typing import Any, Optional

from .common import percentile


def warm_work(work: list[tuple[list[int], int]], n: int) -> list[tuple[list[int], int]]:
    """The first ``n`` requests of ``work``, capped at 8 output tokens: a warm-up."""
    return [(p, min(o, 8)) for p, o in work[:n]]


class Recorder:
    """Arrival times of every streamed piece; turns them into throughput and latency figures."""

    def __init__(self, work: list[tuple[list[int], int]], bar=None):
        n = len(work)
        self.prompt_tokens = sum(len(p) for p, _ in work)
        self.expected_output = sum(o for _, o in work)
        self.submit: list[Optional[float]] = [None] * n
        self.first: list[Optional[float]] = [None] * n
        self.last: list[Optional[float]] = [None] * n
        self.out_tokens = [0] * n
        self.finish: list[Optional[str]] = [None] * n
        self.itl: list[float] = []
        self.t0 = self.t1 = 0.0
        self.bar = bar
        self.pending_bar = 0

    def submitted(self, i: int, t: float) -> None:
        self.submit[i] = t

    def piece(self, i: int, t: float, k: int, finish: Optional[str] = None) -> None:
        if k:
            if self.first[i] is None:
                self.first[i] = t
                if k > 1:
                    self.itl.extend([0.0] * (k - 1))
            else:
                gap = (t - self.last[i]) / k
                self.itl.extend([gap] * k)
            self.last[i] = t
            self.out_tokens[i] += k
            self.pending_bar += k
        if finish is not None:
            self.finish[i] = finish

    def flush_bar(self) -> None:
        if self.bar is not None and self.pending_bar:
            self.bar.update(self.pending_bar)
            self.pending_bar = 0

    def summary(self, mode: str, **extra) -> dict[str, Any]:
        wall = self.t1 - self.t0
        out = sum(self.out_tokens)
        ttft = [f - s for f, s in zip(self.first, self.submit) if f is not None and s is not None]
        bad = {}
        for r in self.finish:
            if r != "length":
                bad[str(r)] = bad.get(str(r), 0) + 1
        res = {
            "mode": mode, "requests": len(self.finish), "prompt_tokens": self.prompt_tokens,
            "output_tokens": out, "expected_output_tokens": self.expected_output, "wall_s": wall,
            "output_tok_s": out / wall if wall > 0 else None,
            "total_tok_s": (out + self.prompt_tokens) / wall if wall > 0 else None,
            "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
            "itl_p50_ms": _ms(percentile(self.itl, 50)), "itl_p99_ms": _ms(percentile(self.itl, 99)),
            "itl_mean_ms": _ms(sum(self.itl) / len(self.itl)) if self.itl else None,
            "not_finished_by_length": bad or None,
        }
        res.update(extra)
        return res


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else x * 1e3
