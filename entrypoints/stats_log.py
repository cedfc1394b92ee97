"""The periodic stats line of a serving engine process (as vLLM prints it), from
``engine.statistics()``: throughput since the last line, running / waiting, KV-cache usage,
preemptions and, where the engine counts it, the prefix-cache hit rate.

Idle intervals (no tokens, nothing in flight) log at DEBUG, so an idle server stays quiet at INFO.
``enginecore serve --disable-log-stats`` turns it off; ``--log-stats-interval`` sets the period.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import anyio

from states import State

log = logging.getLogger("enginecore.stats")


class StatsLine:
    """Turns successive ``EngineStats`` into lines; keeps the previous one for the rates."""

    def __init__(self) -> None:
        self._last = None
        self._t: Optional[float] = None

    def line(self, stats, now: float) -> tuple[int, str, dict]:
        """``(level, message, fields)`` for ``stats`` taken at ``now`` (monotonic seconds)."""
        last, t0 = self._last, self._t
        self._last, self._t = stats, now
        dt = max(1e-9, now - t0) if t0 is not None else None
        prompt = stats.prompt_tokens - (last.prompt_tokens if last else 0)
        gen = stats.generation_tokens - (last.generation_tokens if last else 0)
        fields = {
            "prompt_tokens_per_s": round(prompt / dt, 1) if dt else 0.0,
            "generation_tokens_per_s": round(gen / dt, 1) if dt else 0.0,
            "running": stats.running, "waiting": stats.waiting,
            "kv_cache_usage": round(stats.kv_usage, 4), "preemptions": stats.preemptions,
        }
        msg = (f"prompt {fields['prompt_tokens_per_s']:,.1f} tok/s, generation "
               f"{fields['generation_tokens_per_s']:,.1f} tok/s; {stats.running} running, "
               f"{stats.waiting} waiting; KV cache {100 * stats.kv_usage:.1f}%; "
               f"{stats.preemptions} preemptions")
        queries = getattr(stats, "prefix_cache_queries", 0) or 0
        if queries:
            hits = getattr(stats, "prefix_cache_hits", 0) or 0
            fields["prefix_cache_hit_rate"] = round(hits / queries, 4)
            msg += f"; prefix cache hit rate {100 * hits / queries:.1f}%"
        busy = prompt or gen or stats.running or stats.waiting
        return (logging.INFO if busy else logging.DEBUG), msg, fields


async def log_stats(engine, interval: float) -> None:
    """Log a stats line every ``interval`` seconds while ``engine`` serves, sleeps (an idle
    line: DEBUG) or drains; return once it has stopped."""
    lines = StatsLine()
    lines.line(engine.statistics(), time.monotonic())
    while True:
        await anyio.sleep(interval)
        if engine.state not in (State.SERVING, State.PAUSED, State.SLEEPING, State.DRAINING):
            return
        level, msg, fields = lines.line(engine.statistics(), time.monotonic())
        log.log(level, msg, extra=fields)


__all__ = ["StatsLine", "log_stats"]
