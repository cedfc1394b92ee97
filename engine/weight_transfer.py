"""Weights from a trainer process over ``torch.distributed``: :class:`Sender` on the trainer's
side, :class:`Receiver` on the engine's (``AsyncEngine.init_weight_transfer`` /
``update_weights_from_distributed`` / ``close_weight_transfer``).

The two sides form a group of their own -- a ``TCPStore`` (rank 0, the trainer, hosts it) and a
``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL`` (CUDA tensors) built on it directly,
not through ``init_process_group``: a trainer that already has its default group keeps it, and
both sides may even live in one process (threads), as in ``examples/rl_loop.py``. The same code
runs on CPU and GPU; only the backend differs.

An update is a list of ``(name, shape, dtype)`` (:func:`metadata`), sent ahead as plain data
(over IPC too) and checked by the engine against its own weights before anything moves; then
the tensors follow in buckets (:func:`buckets`): each bucket is the tensors' bytes back to back
in one ``uint8`` buffer and one broadcast from rank 0, so a model of hundreds of tensors costs a
few collective calls. The receiver reuses one bucket buffer and writes each bucket into the
weights in place as it arrives.

Why by hand: vLLM's and SGLang's weight-sync code is part of their engines (their workers, their
``StatelessProcessGroup``); what we need is the few lines of c10d above.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Iterable, Mapping, Sequence, Union

import torch

from engine.errors import BadRequestError

BACKENDS = ("gloo", "nccl")
#: bytes per bucket by default (one broadcast each; the receiver holds one bucket at a time)
BUCKET_BYTES = 256 * 2**20
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
    torch.int32, torch.int64)}

Meta = tuple[str, tuple[int, ...], str]
NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def metadata(named: NamedTensors) -> list[Meta]:
    """What the receiver must know before the tensors come: (name, shape, dtype) in send order."""
    items = named.items() if isinstance(named, Mapping) else named
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in items]


def checked_metadata(meta: Sequence, max_entries: int = 1 << 16) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``meta`` as it came from a caller (maybe over the wire): a list of (name, shape, dtype
    string), every field checked; a ``BadRequestError`` names the first problem."""
    if not isinstance(meta, (list, tuple)) or not 0 < len(meta) <= max_entries:
        raise BadRequestError(f"metadata must be a non-empty list of at most {max_entries} "
                              "(name, shape, dtype) entries")
    out = []
    for i, entry in enumerate(meta):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise BadRequestError(f"metadata[{i}] must be (name, shape, dtype)")
        name, shape, dtype = entry
        if not isinstance(name, str) or not 0 < len(name) <= 512:
            raise BadRequestError(f"metadata[{i}]: name must be a string of 1-512 characters")
        if (not isinstance(shape, (list, tuple)) or len(shape) > 8
                or not all(type(s) is int and 0 <= s < 2**40 for s in shape)):
            raise BadRequestError(f"metadata[{i}] ({name}): shape must be up to 8 sizes >= 0")
        if dtype not in DTYPES:
            raise BadRequestError(f"metadata[{i}] ({name}): dtype must be one of {sorted(DTYPES)}")
        out.append((name, tuple(shape), DTYPES[dtype]))
    return out


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _layout(meta: Sequence, idx: Sequence[int]) -> tuple[list[int], int]:
    """Each tensor's byte offset in its bucket (16-byte aligned, so every dtype's view of the
    buffer is legal) and the bucket's size."""
    offsets, at = [], 0
    for i in idx:
        offsets.append(at)
        at += -(-_nbytes(meta[i][1], meta[i][2]) // 16) * 16
    return offsets, at


def buckets(meta: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
            bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive entries of ``meta`` grouped up to ``bucket_bytes`` each (a larger tensor
    alone); both sides compute the same grouping from the same metadata."""
    out: list[list[int]] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(meta):
        n = _nbytes(shape, dtype)
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


class _Group:
    """One side of the transfer group (see the module docstring); ``close()`` destroys it."""

    def __init__(self, backend: str, address: str, port: int, rank: int, world_size: int,
                 timeout_s: float, device: torch.device) -> None:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise BadRequestError(f"backend must be one of {list(BACKENDS)}, not {backend!r}")
        if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size
                and 2 <= world_size <= 1024):
            raise BadRequestError("need 0 <= rank < world_size, 2 <= world_size <= 1024")
        if not (isinstance(port, int) and 0 < port < 65536) or not isinstance(address, str):
            raise BadRequestError("address must be a host name and port an integer in [1, 65535]")
        if backend == "nccl" and device.type != "cuda":
            raise BadRequestError("the nccl backend needs the engine on a CUDA device")
        timeout = timedelta(seconds=timeout_s)
        self.backend, self.rank, self.device = backend, rank, device
        self._store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout)
        store = dist.PrefixStore("enginecore-weights", self._store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:  # pragma: no cover - needs CUDA
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)

    def broadcast(self, buf: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([buf], opts).wait()

    def close(self) -> None:
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - an abandoned peer: the group goes anyway
                pass
        del pg
        self._store = None


class Sender(_Group):
    """The trainer's side (rank 0, hosting the store): ``send(named_tensors)`` while the engine
    runs ``update_weights_from_distributed(metadata(named_tensors))``."""

    def __init__(self, address: str, port: int, world_size: int = 2, backend: str = "gloo",
                 timeout_s: float = 300.0, device: Union[str, torch.device, None] = None,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        dev = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        super().__init__(backend, address, port, 0, world_size, timeout_s, dev)
        self.bucket_bytes = bucket_bytes

    def send(self, named: NamedTensors) -> int:
        """Broadcast ``named`` in buckets, in the order of ``metadata(named)``; bytes sent."""
        items = list(named.items() if isinstance(named, Mapping) else named)
        meta = checked_metadata(metadata(items))
        sent = 0
        for idx in buckets(meta, self.bucket_bytes):
            offsets, size = _layout(meta, idx)
            buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
            for i, at in zip(idx, offsets):
                t = items[i][1].detach().contiguous().reshape(-1).view(torch.uint8)
                buf[at:at + t.numel()].copy_(t)
            self.broadcast(buf)
            sent += size
        return sent

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Receiver(_Group):
    """The engine's side: receives an update bucket by bucket into one reused buffer and hands
    each bucket's tensors (views of the buffer) to ``write``."""

    def receive(self, meta: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                write: Callable[[list[tuple[str, torch.Tensor]]], None],
                bucket_bytes: int = BUCKET_BYTES) -> int:
        plan = [(idx, *_layout(meta, idx)) for idx in buckets(meta, bucket_bytes)]
        buf = torch.empty(max(size for _, _, size in plan), dtype=torch.uint8, device=self.device)
        for idx, offsets, size in plan:
            view = buf[:size]
            self.broadcast(view)
            pairs = []
            for i, at in zip(idx, offsets):
                name, shape, dtype = meta[i]
                pairs.append((name, view[at:at + _nbytes(shape, dtype)].view(dtype).reshape(shape)))
            write(pairs)
        return sum(size for _, _, size in plan)


__all__ = ["Sender", "Receiver", "metadata", "checked_metadata", "buckets", "BACKENDS",
           "BUCKET_BYTES"]
