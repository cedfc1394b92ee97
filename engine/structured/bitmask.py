"""``TokenBitmask``: the runner's one token-bitmask buffer (a device resource, owned by the
runner's :class:`engine.owner.DeviceOwner` and released with it) and the per-step masking.

Each step, every constrained row's matcher fills its row of the host bitmask (xgrammar's
``fill_next_token_bitmask``, CPU); on CUDA the filled rows are copied to the device buffer in one
transfer; then ``apply_token_bitmask_inplace`` sets the disallowed logits to -inf on the logits'
device (xgrammar's own kernels: Triton on CUDA, its C++ path on CPU), once for the whole batch,
before sampling -- so greedy, temperature, top-k/top-p and seeds all sample from the allowed set.
Rows without a constraint are left untouched (``indices``).
"""

from __future__ import annotations

from typing import Sequence

import torch


class TokenBitmask:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        words = -(-vocab_size // 32)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.host = torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=cuda)
        self.dev = torch.full((max_rows, words), -1, dtype=torch.int32, device=self.device) \
            if cuda else self.host

    @property
    def max_rows(self) -> int:
        return self.host.shape[0]

    def apply(self, logits: torch.Tensor, matchers: Sequence) -> torch.Tensor:
        """Mask row ``k`` of ``logits`` [N, V] with ``matchers[k]`` (None: unconstrained row);
        returns a masked copy (the raw logits stay for logprobs), or ``logits`` when no row is
        constrained."""
        rows = [k for k, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        if rows[-1] >= self.max_rows:
            raise RuntimeError(f"{rows[-1] + 1} sampled rows; the bitmask has {self.max_rows}")
        for k in rows:
            matchers[k].fill_next_token_bitmask(self.host, k)
        from xgrammar import apply_token_bitmask_inplace

        n = rows[-1] + 1
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        out = logits.clone()
        apply_token_bitmask_inplace(out, self.dev[:n], vocab_size=min(self.vocab_size,
                                                                       out.shape[-1]),
                                    indices=rows)
        return out

    def offload(self, pin: bool) -> int:  # pragma: no cover - sleep releases it instead
        raise RuntimeError("the token bitmask is released at sleep, not offloaded")

    def close(self) -> None:
        """Give both buffers back (the owner's one release path calls this)."""
        with torch.no_grad():
            if self.dev is not self.host:
                self.dev.set_()
            self.host.set_()


__all__ = ["TokenBitmask"]
