"""Wire messages for what an RL loop asks of its rollout engine (appended to protocol version 2;
an older engine answers them ``PROTOCOL``): pause and resume, abort-all, and new weights from a
trainer. Each takes an optional ``call_id`` and is answered like the other calls
(``messages.py``): an :class:`~ipc.messages.Ack` with the engine's state, a
:class:`ControlReply` where a call returns something, or an ``Error``.

* :class:`Pause` (``mode`` "abort" | "wait" | "keep", ``timeout`` for "wait") moves the engine to
  ``paused`` and answers once nothing steps (``engine/serving/pause.py``); :class:`Resume` back to
  ``serving``. Generates while paused are queued (or refused ``PAUSED`` with the engine's
  ``reject_while_paused``).
* :class:`AbortAll` ends every request in flight (all connections') at the next step boundary,
  each with its partial output: ``ControlReply.count`` says how many.
* :class:`WeightInfoRequest`: ``ControlReply.weights``, every updatable parameter's
  ``[name, shape, dtype]``.
* :class:`InitWeightTransfer` joins a trainer's ``torch.distributed`` group
  (``engine/weight_transfer.py``); :class:`UpdateWeightsFromDistributed` receives one update
  described by ``metadata`` (``[name, shape, dtype]`` in send order: checked against the weights
  before anything moves) while paused or asleep; :class:`CloseWeightTransfer` leaves the group.
* :class:`UpdateWeightsFromIpc` carries a trainer's CUDA IPC handles on the engine's GPU
  (``engine/weight_ipc.py``'s ``IpcHandles``: every field bounded by the decoder, then checked
  against the engine's device and weights before a handle is opened).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from msgspec import Meta

from engine.ipc_handles import IpcHandles

from .wire_base import CallId, Count, Seconds, _Message

MAX_WEIGHTS = 1 << 16  # parameters in one update / one WeightInfo answer
MAX_WEIGHT_NAME = 512
MAX_DIMS = 8

WeightName = Annotated[str, Meta(min_length=1, max_length=MAX_WEIGHT_NAME)]
Shape = Annotated[list[Annotated[int, Meta(ge=0, le=2**40)]], Meta(max_length=MAX_DIMS)]
DType = Annotated[str, Meta(min_length=1, max_length=16)]
WeightEntry = tuple[WeightName, Shape, DType]


class Pause(_Message, tag="Pause"):
    mode: Literal["abort", "wait", "keep"] = "abort"
    timeout: Optional[Seconds] = None
    call_id: Optional[CallId] = None


class Resume(_Message, tag="Resume"):
    call_id: Optional[CallId] = None


class AbortAll(_Message, tag="AbortAll"):
    reason: Annotated[str, Meta(max_length=256)] = "abort_all"
    call_id: Optional[CallId] = None


class WeightInfoRequest(_Message, tag="WeightInfoRequest"):
    call_id: Optional[CallId] = None


class InitWeightTransfer(_Message, tag="InitWeightTransfer"):
    backend: Literal["gloo", "nccl"]
    address: Annotated[str, Meta(min_length=1, max_length=255)]
    port: Annotated[int, Meta(ge=1, le=65535)]
    rank: Annotated[int, Meta(ge=1, le=1023)]
    world_size: Annotated[int, Meta(ge=2, le=1024)]
    timeout: Annotated[float, Meta(gt=0.0, le=86400.0)] = 300.0
    call_id: Optional[CallId] = None


class UpdateWeightsFromDistributed(_Message, tag="UpdateWeightsFromDistributed"):
    metadata: Annotated[list[WeightEntry], Meta(min_length=1, max_length=MAX_WEIGHTS)]
    version: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None
    bucket_bytes: Annotated[int, Meta(ge=2**20, le=2**34)] = 256 * 2**20
    call_id: Optional[CallId] = None


class UpdateWeightsFromIpc(_Message, tag="UpdateWeightsFromIpc"):
    handles: IpcHandles
    version: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None
    call_id: Optional[CallId] = None


class CloseWeightTransfer(_Message, tag="CloseWeightTransfer"):
    call_id: Optional[CallId] = None


class ControlReply(_Message, tag="ControlReply"):
    """What a control call returned (the fields that call fills)."""

    call_id: Optional[CallId] = None
    count: Optional[Count] = None
    weights: Annotated[list[WeightEntry], Meta(max_length=MAX_WEIGHTS)] = []


ControlRequest = Union[Pause, Resume, AbortAll, WeightInfoRequest, InitWeightTransfer,
                       UpdateWeightsFromDistributed, UpdateWeightsFromIpc, CloseWeightTransfer]
CONTROL_REQUESTS: tuple[type, ...] = (Pause, Resume, AbortAll, WeightInfoRequest,
                                      InitWeightTransfer, UpdateWeightsFromDistributed,
                                      UpdateWeightsFromIpc, CloseWeightTransfer)
CONTROL_REPLIES: tuple[type, ...] = (ControlReply,)


async def run_control(engine, msg) -> Optional[ControlReply]:
    """The engine side: ``msg`` (a :data:`ControlRequest`, its fields bounded by the decoder)
    carried out on ``engine``; a :class:`ControlReply` where the call returns something."""
    t = type(msg)
    if t is Pause:
        await engine.pause(msg.mode, msg.timeout)
    elif t is Resume:
        await engine.resume()
    elif t is AbortAll:
        return ControlReply(count=await engine.abort_all(msg.reason))
    elif t is WeightInfoRequest:
        return ControlReply(weights=[(n, list(s), d) for n, s, d in engine.weight_info()])
    elif t is InitWeightTransfer:
        await engine.init_weight_transfer(msg.backend, msg.address, msg.port, msg.rank,
                                          msg.world_size, msg.timeout)
    elif t is UpdateWeightsFromDistributed:
        await engine.update_weights_from_distributed(msg.metadata, msg.version, msg.bucket_bytes)
    elif t is UpdateWeightsFromIpc:
        await engine.update_weights_from_ipc(msg.handles, msg.version)
    else:
        await engine.close_weight_transfer()
    return None


__all__ = ["Pause", "Resume", "AbortAll", "WeightInfoRequest", "InitWeightTransfer",
           "UpdateWeightsFromDistributed", "UpdateWeightsFromIpc", "CloseWeightTransfer", "ControlReply",
           "ControlRequest", "CONTROL_REQUESTS", "CONTROL_REPLIES", "run_control"]
