"""``ModelState``: persistent per-step input buffers on the device, plus per-request samplers'
generators. Owned (and released) by the runner's ``DeviceOwner``."""

from __future__ import annotations

from typing import Optional

import torch


class ModelState:
    def __init__(self, *, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 device: torch.device):
        self.device = device
        long = dict(dtype=torch.long, device=device)
        self.buffers: Optional[dict[str, torch.Tensor]] = {
            "input_ids": torch.zeros(max_tokens, **long),
            "positions": torch.zeros(max_tokens, **long),
            "slot_mapping": torch.zeros(max_tokens, **long),
            "block_tables": torch.zeros((max_seqs, max_blocks_per_seq), **long),
            "context_lens": torch.zeros(max_seqs, **long),
            # the tokens the last deferred step sampled, one row per sampling request: the next
            # step reads a request's new token from here (overlapped scheduling, engine/core/engine_core.py)
            "sampled": torch.zeros(max_seqs, **long),
        }
        self.generators: dict[str, torch.Generator] = {}
        # unseeded rows' noise in the one-pass sampler (engine/ops/triton/fused_sample.py): a seed a step,
        # drawn from torch's default CPU generator (so torch.manual_seed makes runs repeat)
        self._noise_base: Optional[int] = None
        self._noise_steps = 0

    def next_noise_seed(self) -> int:
        """A new seed for this step's unseeded sampling noise (host only: no device work)."""
        if self._noise_base is None:
            self._noise_base = int(torch.randint(0, 2**31 - 1, (1,)).item())
        self._noise_steps += 1
        return (self._noise_base + self._noise_steps * 1_000_003) & 0x7FFFFFFF

    def load(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """Copy host ``values`` into the front of buffer ``name``; return that device view."""
        assert self.buffers is not None, "model state released"
        buf = self.buffers[name]
        if values.dim() == 2:
            view = buf[: values.shape[0], : values.shape[1]]
        else:
            view = buf[: values.shape[0]]
        view.copy_(values, non_blocking=True)
        return view

    def generator(self, request_id: str, seed: int) -> torch.Generator:
        g = self.generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[request_id] = g
        return g

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def close(self) -> None:
        if self.buffers is not None:
            for t in self.buffers.values():
                t.set_()
        self.buffers = None
        self.generators.clear()
