"""Fault injection for tests: a model forward that raises on its Nth step.

In process, :func:`arm` (or the ``inject_fault`` fixture in conftest.py) wraps
``ModelRunner.forward`` for every runner made while it is armed. For an engine process,
``python -m tests.faults N ARGS...`` arms it, then runs ``enginecore ARGS...``.
Never part of the product: the engine has no fault hook of its own.
"""

from __future__ import annotations

import sys
from typing import Callable

from engine.runner.model_runner import ModelRunner


class InjectedFault(RuntimeError):
    """What the armed forward raises."""


def arm(step: int) -> Callable[[], None]:
    """From now on a runner's forward raises :class:`InjectedFault` on its ``step``-th call
    (1-based); returns the function that disarms it."""
    original = ModelRunner.forward

    def forward(self, batch, poll=None):
        if self.steps + 1 == step:
            self.steps += 1
            raise InjectedFault(f"injected fault at step {self.steps}")
        return original(self, batch, poll)

    ModelRunner.forward = forward

    def disarm() -> None:
        ModelRunner.forward = original

    return disarm


def main() -> int:
    step, args = int(sys.argv[1]), sys.argv[2:]
    arm(step)
    from entrypoints.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
