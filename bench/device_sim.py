"""A simulated accelerator for host-side benchmarks: steps take device time, the host does not.

``tools.host_overhead --sim h200`` (and ``--sim`` of ``bench.prefix`` and ``bench.structured``)
runs the engine's real host work (scheduling, step inputs, the update, the in-process delivery)
against a device that is modelled, not present: each
launched step occupies the "device" for a time given by a cost model, starting when it is
launched or when the step before it ends, whichever is later, exactly as a CUDA stream queues
work. Waiting for a step's tokens sleeps until its simulated end with the GIL released (as
``torch.cuda.Event.synchronize`` does), so another thread (the event loop delivering outputs)
may run meanwhile, and takes the GIL back when it wakes -- the contention a real device shows.
An eager step with prompt tokens can also cost host time with the GIL held (``eager_ms``: Triton's
Python launcher and cuBLAS's shape choice on the H200).

Why: the in-process / bare ratio of ``bench.throughput`` is a question of whether the host's part of a step
(step thread and event loop together) stays under the device's. Without a device lent, this is
the one way to measure that here; the figures are a proxy, to compare host-side changes, not
the device's.

The sampling's share is queued when the sampling is launched, so a step sampled late (its masks
filled after its forward was launched: constrained requests) leaves the device idle for as long
as the host takes past the forward. The cost model (``H200``) is fitted to ``bench.roofline --device cuda`` on the H200 for
random:qwen3-0.6b bf16 (2026-12-04, pipelined step times: 1.43 ms at batch 1 x ctx 256, 3.69 at
256 x 256, 8.89 at 256 x 1024): a fixed 1.4 ms a step (weights and launch-bound small
kernels), 2 us a sampled row, the K/V read at 114,688 bytes a context token over 4.2 TB/s
(27.3 ns a token), and 3 us a prompt token (its share of a 2,048-token prefill's matmuls).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class CostModel:
    base_ms: float  # every step
    row_us: float  # per sampled (decode) row
    ctx_ns: float  # per context token read (K/V)
    prompt_us: float  # per prompt token computed (prefill)
    eager_ms: float = 0.0  # host time with the GIL held, for a step with prompt tokens

    def seconds(self, batch: Sequence[tuple]) -> tuple[float, float]:
        """The step's device time: (its forward's, its sampling's)."""
        rows = ctx = prompt = 0
        for req, n in batch:
            start = req.num_computed_tokens
            if n == 1 and start > 0:
                rows += 1
            else:
                prompt += n
                if start + n >= req.num_known_tokens:
                    rows += 1
            ctx += start + n
        return (self.base_ms * 1e-3 + ctx * self.ctx_ns * 1e-9 + prompt * self.prompt_us * 1e-6,
                rows * self.row_us * 1e-6)


MODELS = {
    "h200": CostModel(base_ms=1.4, row_us=2.0, ctx_ns=27.3, prompt_us=3.0),
    # a device twice as fast: where the host (this machine's) becomes the bound
    "h200-half": CostModel(base_ms=0.7, row_us=1.0, ctx_ns=13.65, prompt_us=1.5),
    # twice as slow: the H200's balance for a host twice as fast as the 2-core development box
    "h200-x2": CostModel(base_ms=2.8, row_us=4.0, ctx_ns=54.6, prompt_us=6.0),
    # the same with the host's eager launch of a prompt step (20-45 ms measured on the H200
    # before eager row counts; 8 ms a guess for after them)
    "h200-eager": CostModel(base_ms=1.4, row_us=2.0, ctx_ns=27.3, prompt_us=3.0, eager_ms=8.0),
}


class SimEvent:
    """What ``Launched`` waits on: done at a simulated time."""

    __slots__ = ("at",)

    def __init__(self, at: float):
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        left = self.at - time.perf_counter()
        if left > 0:
            time.sleep(left)  # the GIL is released, as in a CUDA synchronize


class SimDevice:
    """One queue of steps: a step starts at the later of its launch and the previous step's end."""

    def __init__(self, model: CostModel):
        self.model = model
        self.free_at = 0.0
        self.busy_s = 0.0  # simulated device time, for the utilisation figure
        self.steps = 0
        self.idle: list[float] = []  # each time the device ran dry: for how long

    def enqueue(self, seconds: float) -> SimEvent:
        """Device work of ``seconds`` queued now; the event of its end."""
        now = time.perf_counter()
        if now > self.free_at and self.free_at:
            self.idle.append(now - self.free_at)  # the device had nothing queued this long
        self.free_at = max(self.free_at, now) + seconds
        self.busy_s += seconds
        return SimEvent(self.free_at)

    def attach(self, runner) -> None:
        """Route ``runner``'s steps through this device (its model forward should be a null
        one: the host work measured is the engine's, not the CPU's arithmetic)."""
        forward, sample_step = runner.forward, runner.sample_step
        model = self.model
        pending: list = []

        def sim_forward(batch, poll=None):
            # the device starts with the forward's first launch and cannot end before its last:
            # an eager step's launches (eager_ms of host time) feed it as they go
            fwd_s, sample_s = model.seconds(batch)
            self.enqueue(fwd_s)
            if model.eager_ms and any(n > 1 or req.num_computed_tokens == 0 for req, n in batch):
                _spin(model.eager_ms * 1e-3)
            out = forward(batch, poll)
            self.free_at = max(self.free_at, time.perf_counter())
            self.steps += 1
            pending.append(sample_s)
            return out

        def sim_sample_step(fwd, defer, masks=None):
            # the sampling is queued when it is launched: after the forward, or -- a step
            # sampled late (constrained requests, EngineCore.step) -- once the masks are on
            launched = sample_step(fwd, defer, masks)
            event = self.enqueue(pending.pop())
            if launched.is_deferred:
                launched.event = event
            else:  # a synchronous step: the host waits for the device here
                event.synchronize()
            return launched

        # NOTE: object.__setattr__: ModelRunner's own __setattr__ guards device resources
        object.__setattr__(runner, "forward", sim_forward)
        object.__setattr__(runner, "sample_step", sim_sample_step)


def _spin(seconds: float) -> None:
    """Busy host time with the GIL held (a Python launcher's work)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def null_model(runner, varied: bool = False) -> None:
    """The runner's model forward returns hidden states without computing: zeros, or (``varied``)
    a fixed random vector per input token id, so that the sampled tokens vary as with random
    weights (a structured output's path through its grammar depends on them)."""
    import torch

    model = runner.resource("weights")
    hidden = model.config.hidden_size
    if varied:
        gen = torch.Generator().manual_seed(0)
        table = torch.randn(model.config.vocab_size, hidden, generator=gen) * 4
        fn = lambda ids, pos, kv, meta: table[ids]  # noqa: E731
    else:
        zeros = torch.zeros(runner.config.max_num_batched_tokens + runner.config.max_num_seqs * 17,
                            hidden)
        fn = lambda ids, pos, kv, meta: zeros[: ids.shape[0]]  # noqa: E731
    # NOTE: object.__setattr__: a plain attribute on the module, past nn.Module's own
    object.__setattr__(model, "forward", fn)


def simulate(runner, sim: str, eager_ms: Optional[float] = None, varied: bool = False) -> SimDevice:
    """``runner`` (loaded) with a null model (:func:`null_model`) on a simulated device of cost
    model ``sim`` (``eager_ms`` overriding the model's); the device, for its figures."""
    model = MODELS[sim]
    if eager_ms is not None:
        model = dataclasses.replace(model, eager_ms=eager_ms)
    null_model(runner, varied)
    device = SimDevice(model)
    device.attach(runner)
    return device
