"""Weights from a trainer on the same GPU through CUDA IPC handles, without a copy through the
network stack and without pickle: :func:`export_cuda_ipc` / :class:`IpcSender` on the trainer's
side, :func:`check_handles` and :func:`opened` on the engine's
(``AsyncEngine.update_weights_from_ipc``, over IPC ``ipc.control.UpdateWeightsFromIpc``).

An export is an :class:`IpcHandles` (a msgspec Struct of plain fields and ``bytes``): one
:class:`IpcStorage` per CUDA storage -- what ``UntypedStorage._share_cuda_()`` returns, the
fields ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` passes back to
``UntypedStorage._new_shared_cuda`` in that order -- and one :class:`IpcTensor` per weight (name,
dtype, shape, stride, element offset in its storage). :func:`export_cuda_ipc` shares the
trainer's own tensors (no copy; one handle per storage); :class:`IpcSender` first packs them into
one flat buffer per dtype (one handle per dtype; it holds the buffers until ``close()``).

The engine checks every field before it opens anything (:func:`check_handles`: the device must be
its own, the dtype in :data:`DTYPES`, each tensor's extent inside its storage, the ref-counter
name of torch's form), opens the storages, copies the weights in place, synchronizes and drops
them: the mapping is closed and torch's ref counter tells the trainer's allocator the block is
free again. What the receiver cannot check: that a storage's ``offset + size`` lies inside the
trainer's allocation (CUDA does not say how large an opened allocation is) -- a handle is a
capability the trainer hands out on its own machine.

In one process (the trainer's handle of its own memory: CUDA cannot open it there) the export
is found by its pid and the storages come from a process-local registry of weak references.

Why by hand: vLLM's and SGLang's CUDA-IPC paths send torch's reduction through pickle; the
fields themselves are the few lines below.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from typing import Iterator, Mapping, Union

import torch

from engine.errors import BadRequestError
from engine.ipc_handles import IpcHandles, IpcStorage, IpcTensor, decode, encode  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

#: dtypes a weight may travel as (the engine's check then wants the weights' own)
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}
_REFCOUNT_NAME = re.compile(rb"/torch_[0-9A-Za-z_]{1,200}")
NamedTensors = Union[Mapping[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


# -- the trainer's side --------------------------------------------------------------------------
_LOCAL: dict[tuple[bytes, int], object] = {}  # (handle, offset) -> StorageWeakRef, this process


def _items(named: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    return list(named.items() if isinstance(named, Mapping) else named)


def export_cuda_ipc(named: NamedTensors) -> IpcHandles:
    """Handles of ``named``'s own storages (no copy): keep the tensors alive and unchanged until
    the engine's update returns."""
    from torch.multiprocessing.reductions import StorageWeakRef

    for key in [k for k, ref in _LOCAL.items() if ref.expired()]:
        del _LOCAL[key]
    storages: list[IpcStorage] = []
    tensors: list[IpcTensor] = []
    index: dict[tuple[int, int], int] = {}
    for name, t in _items(named):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            raise BadRequestError(f"{name}: CUDA IPC exports CUDA tensors only")
        t = t.detach()
        st = t.untyped_storage()
        key = (st.device.index, st.data_ptr())
        if key not in index:
            dev, handle, size, off, rc, rc_off, ev, ev_sync = st._share_cuda_()
            index[key] = len(storages)
            storages.append(IpcStorage(int(dev), bytes(handle), int(size), int(off), bytes(rc),
                                       int(rc_off), bytes(ev or b""), bool(ev_sync)))
            _LOCAL[(bytes(handle), int(off))] = StorageWeakRef(st)
        tensors.append(IpcTensor(name, str(t.dtype).removeprefix("torch."), list(t.shape),
                                 list(t.stride()), t.storage_offset(), index[key]))
    if not tensors:
        raise BadRequestError("nothing to export")
    return IpcHandles(pid=os.getpid(), storages=storages, tensors=tensors)


class IpcSender:
    """Exports through one flat buffer per dtype (fewer handles than tensors): ``export`` copies
    the tensors into buffers this object holds until the next ``export`` or ``close()`` -- keep
    it open until the engine's update returns."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def export(self, named: NamedTensors) -> IpcHandles:
        self._buffers = []
        items = _items(named)
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, t in items:
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                raise BadRequestError(f"{name}: CUDA IPC exports CUDA tensors only")
            by_dtype.setdefault(t.dtype, []).append((name, t.detach()))
        views = {}
        for dtype, group in by_dtype.items():
            devices = {t.device for _, t in group}
            if len(devices) != 1:
                raise BadRequestError("an IpcSender export lives on one device")
            buf = torch.empty(sum(t.numel() for _, t in group), dtype=dtype, device=devices.pop())
            at = 0
            for name, t in group:
                views[name] = buf[at:at + t.numel()].view(t.shape)
                views[name].copy_(t)
                at += t.numel()
            self._buffers.append(buf)
        torch.cuda.synchronize()
        return export_cuda_ipc([(n, views[n]) for n, _ in items])

    def close(self) -> None:
        """Drop the buffers (their memory returns once the engine has let go of them)."""
        self._buffers = []
        torch.cuda.ipc_collect()

    def __enter__(self) -> "IpcSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the engine's side ---------------------------------------------------------------------------
def _nbytes(shape, stride, itemsize: int) -> int:
    """Bytes from a tensor's first element to one past its last (0 if empty)."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * itemsize


def check_handles(handles: object, device: torch.device) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every field of ``handles`` checked for an engine on ``device`` before anything is opened;
    the (name, shape, dtype) plan for the weights' check. Raises ``BadRequestError``."""
    if not isinstance(handles, IpcHandles):
        raise BadRequestError("update_weights_from_ipc takes an engine.weight_ipc.IpcHandles")
    if device.type != "cuda":
        raise BadRequestError("update_weights_from_ipc needs the engine on a CUDA device "
                              f"(this one runs on {device.type}): use update_weights_from_tensors")
    want = device.index if device.index is not None else torch.cuda.current_device()
    for j, s in enumerate(handles.storages):
        if s.device != want:
            raise BadRequestError(f"storages[{j}] lives on cuda:{s.device}; the engine opens "
                                  f"handles of its own device (cuda:{want}) only")
        if not _REFCOUNT_NAME.fullmatch(s.ref_counter_handle):
            raise BadRequestError(f"storages[{j}]: not a torch ref-counter name")
    seen, plan = set(), []
    for i, t in enumerate(handles.tensors):
        where = f"tensors[{i}] ({t.name})"
        if t.name in seen:
            raise BadRequestError(f"{where}: named twice")
        seen.add(t.name)
        if t.dtype not in DTYPES:
            raise BadRequestError(f"{where}: dtype must be one of {sorted(DTYPES)}")
        if len(t.stride) != len(t.shape):
            raise BadRequestError(f"{where}: stride and shape differ in length")
        if t.storage >= len(handles.storages):
            raise BadRequestError(f"{where}: storage {t.storage} does not exist")
        dtype = DTYPES[t.dtype]
        end = t.offset * dtype.itemsize + _nbytes(t.shape, t.stride, dtype.itemsize)
        if end > handles.storages[t.storage].size:
            raise BadRequestError(f"{where}: reaches byte {end}, past its storage's "
                                  f"{handles.storages[t.storage].size}")
        plan.append((t.name, tuple(t.shape), dtype))
    return plan


def _open(s: IpcStorage, same_process: bool) -> torch.UntypedStorage:
    if same_process:  # CUDA cannot open a process's own handle: the registry has the storage
        ref = _LOCAL.get((s.handle, s.offset))
        if ref is None or ref.expired():
            raise BadRequestError("an export of this process whose tensors are gone")
        st = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        # the export counted one more user of the storage; nobody else will give it back
        torch.UntypedStorage._release_ipc_counter(s.ref_counter_handle, s.ref_counter_offset,
                                                  device=s.device)
        if st.nbytes() != s.size:
            raise BadRequestError("an export of this process whose storage changed size")
        return st
    torch.cuda._lazy_init()
    return torch.UntypedStorage._new_shared_cuda(
        s.device, s.handle, s.size, s.offset, s.ref_counter_handle, s.ref_counter_offset,
        s.event_handle, s.event_sync_required)


@contextmanager
def opened(handles: IpcHandles, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The weights of ``handles`` (checked by :func:`check_handles`) as tensors on the opened
    storages; on exit the work on them is synchronized and every storage dropped."""
    same = handles.pid == os.getpid()
    storages: list = []
    tensors: dict[str, torch.Tensor] = {}
    try:
        for s in handles.storages:
            storages.append(_open(s, same))
        for t in handles.tensors:
            dtype = DTYPES[t.dtype]
            tensors[t.name] = torch.empty(0, dtype=dtype, device=device).set_(
                storages[t.storage], t.offset, t.shape, t.stride)
        yield tensors
    finally:
        torch.cuda.synchronize(device)  # the copies from the trainer's memory are done
        tensors.clear()
        storages.clear()


def let_go(handles: IpcHandles, device: torch.device) -> None:
    """A refused update's handles opened and dropped at once: each export counts one user of
    its storages in the trainer until opened and dropped, and would otherwise hold them there."""
    try:
        with opened(handles, device):
            pass
    except Exception as exc:  # noqa: BLE001 - the refusal the caller raises is what matters
        log.warning("could not let go of a refused IPC export: %s", exc)


__all__ = ["IpcHandles", "IpcStorage", "IpcTensor", "IpcSender", "export_cuda_ipc",
           "check_handles", "opened", "let_go", "encode", "decode", "DTYPES"]
