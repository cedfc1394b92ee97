"""Weights from a trainer over ``torch.distributed`` (engine/weight_transfer.py), mixed into
:class:`engine.AsyncEngine`: ``init_weight_transfer`` joins the trainer's group,
``update_weights_from_distributed`` receives one update (while PAUSED or SLEEPING, as the other
weight updates), ``close_weight_transfer`` leaves it. The group is the engine's: its release
(shutdown, a failure) closes it too, so no thread or socket outlives the engine.
``update_weights_from_ipc`` takes a trainer's CUDA IPC handles on the engine's GPU
(engine/weight_ipc.py).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from anyio import to_thread
import torch

from engine.errors import BadRequestError
from engine.weight_ipc import check_handles, let_go
from engine.weight_transfer import BUCKET_BYTES, Receiver, checked_metadata
from states import State


class TransferAPI:
    """The weight-transfer methods of :class:`~engine.serving.async_engine.AsyncEngine`."""

    _transfer: Optional[Receiver] = None
    lifecycle: Any

    async def init_weight_transfer(self, backend: str, address: str, port: int, rank: int,
                                   world_size: int, timeout: float = 300.0) -> None:
        """Join the trainer's group as ``rank`` (the trainer is rank 0, hosting the store at
        ``address:port``: ``engine.weight_transfer.Sender``); waits for the rendezvous (at most
        ``timeout`` seconds, which also bounds each later transfer)."""
        if self.lifecycle.state in (State.INIT, State.SHUTDOWN, State.FAILED, State.DRAINING):
            self._raise_unavailable("init_weight_transfer")  # type: ignore[attr-defined]
        if self._transfer is not None:
            raise BadRequestError("a weight transfer group is open already: close it first")
        if rank == 0:
            raise BadRequestError("rank 0 is the trainer's (the sender); the engine needs another")
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= 86400):
            raise BadRequestError("timeout must be a number of seconds in (0, 86400]")
        device = self.runner.device  # type: ignore[attr-defined]
        self._transfer = await to_thread.run_sync(
            lambda: Receiver(backend, address, port, rank, world_size, float(timeout),
                             device if backend == "nccl" else torch.device("cpu")))

    async def update_weights_from_distributed(self, metadata: Sequence,
                                              version: Optional[int] = None,
                                              bucket_bytes: int = BUCKET_BYTES) -> None:
        """Receive the update ``metadata`` describes (``weight_transfer.metadata`` on the
        trainer's side: (name, shape, dtype) in send order, the same ``bucket_bytes``) from the
        group's rank 0 and write it into the weights in place; every entry is checked against
        the weights before anything moves. While PAUSED or SLEEPING (weights kept)."""
        if self._transfer is None:
            raise BadRequestError("no weight transfer group: call init_weight_transfer first")
        if type(bucket_bytes) is not int or not 2**20 <= bucket_bytes <= 2**34:
            raise BadRequestError("bucket_bytes must be an integer in [1 MiB, 16 GiB]")
        meta = checked_metadata(metadata)
        runner = self.runner  # type: ignore[attr-defined]
        if runner.model_config is None:
            self._raise_unavailable("update_weights_from_distributed")  # type: ignore[attr-defined]
        runner.check_weights([(n, torch.empty(s, dtype=d, device="meta")) for n, s, d in meta])
        await self._sleep.update_weights(  # type: ignore[attr-defined]
            "distributed", (self._transfer, meta, bucket_bytes), version)

    async def update_weights_from_ipc(self, handles: Any, version: Optional[int] = None) -> None:
        """Write the weights a trainer on this GPU exported (``engine.weight_ipc``:
        ``export_cuda_ipc`` / ``IpcSender``): any subset, by name, each of its weight's shape
        and dtype. Every field and every name is checked before a handle is opened (a
        ``BadRequestError`` and nothing changes); the storages are opened, copied from in place,
        synchronized and let go. While PAUSED or SLEEPING (weights kept), as
        :meth:`update_weights_from_tensors`. The handles must be of the engine's device (with
        tensor parallelism the driver's, rank 0's: the other ranks get their slices over the
        ranks' group)."""
        runner = self.runner  # type: ignore[attr-defined]
        plan = check_handles(handles, runner.device)
        opened: list[bool] = []
        try:
            if runner.model_config is None:
                self._raise_unavailable("update_weights_from_ipc")  # type: ignore[attr-defined]
            runner.check_weights([(n, torch.empty(s, dtype=d, device="meta")) for n, s, d in plan])
            await self._sleep.update_weights(  # type: ignore[attr-defined]
                "ipc", (handles, opened), version)
        except Exception:  # (a cancelled caller's queued update may still run: it lets go itself)
            if not opened:  # refused before the copy: the trainer's storages are let go all the same
                await to_thread.run_sync(let_go, handles, runner.device)
            raise

    async def close_weight_transfer(self) -> None:
        """Leave the group (a no-op without one)."""
        self._close_transfer()

    def _close_transfer(self) -> None:
        group, self._transfer = self._transfer, None
        if group is not None:
            group.close()
