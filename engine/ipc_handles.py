"""The wire form of a CUDA IPC weight export (:class:`IpcHandles`) and its bounded codec, kept
free of torch so that ``ipc.control`` can name it without importing torch; what the fields mean
and how they are opened: :mod:`engine.weight_ipc`."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from engine.errors import BadRequestError

MAX_TENSORS = 1 << 16
MAX_HANDLE = 4096  # a cudaIpcMemHandle is 64 bytes; expandable segments' handles are longer
REFCOUNT_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: slots per ref-counter file

Int = Annotated[int, Meta(ge=0, le=2**48)]
Dims = Annotated[list[Int], Meta(max_length=8)]


class IpcStorage(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """One CUDA storage as ``_share_cuda_()`` describes it."""

    device: Annotated[int, Meta(ge=0, le=1023)]
    handle: Annotated[bytes, Meta(min_length=1, max_length=MAX_HANDLE)]
    size: Int  # bytes of the storage
    offset: Int  # bytes from its allocation's start
    ref_counter_handle: Annotated[bytes, Meta(min_length=1, max_length=256)]
    ref_counter_offset: Annotated[int, Meta(ge=0, lt=REFCOUNT_SLOTS)]
    event_handle: Annotated[bytes, Meta(max_length=MAX_HANDLE)] = b""
    event_sync_required: bool = False


class IpcTensor(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    name: Annotated[str, Meta(min_length=1, max_length=512)]
    dtype: Annotated[str, Meta(min_length=1, max_length=16)]
    shape: Dims
    stride: Dims
    offset: Int  # elements from the storage's start
    storage: Annotated[int, Meta(ge=0, lt=MAX_TENSORS)]  # index into IpcHandles.storages


class IpcHandles(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An export: the storages and the weights on them; ``pid``: the exporting process."""

    pid: Annotated[int, Meta(ge=1, le=2**31)]
    storages: Annotated[list[IpcStorage], Meta(min_length=1, max_length=MAX_TENSORS)]
    tensors: Annotated[list[IpcTensor], Meta(min_length=1, max_length=MAX_TENSORS)]


def encode(handles: IpcHandles) -> bytes:
    return msgspec.msgpack.encode(handles)


def decode(data: bytes, max_bytes: int = 16 * 2**20) -> IpcHandles:
    """``data`` from a stranger: at most ``max_bytes``, every field bounded, else BadRequestError."""
    if len(data) > max_bytes:
        raise BadRequestError(f"an IPC handle export is at most {max_bytes} bytes")
    try:
        return msgspec.msgpack.decode(data, type=IpcHandles)
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"IPC handles: {exc}") from None
