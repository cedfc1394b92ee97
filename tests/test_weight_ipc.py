"""CUDA-IPC weight updates (engine/weight_ipc.py), the parts a CPU can check: the handles' codec
round trip and its bounds, every field checked before a handle is opened (wrong device, dtype
outside the allow-list, a tensor reaching past its storage, a foreign ref-counter name, unknown
names: a BadRequestError and no weight changed), a CPU engine's refusal, and the IPC message over
a real connection. Opening handles needs a GPU: tests/gpu/test_gpu_weight_ipc.py."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine import AsyncEngine, BadRequestError, EngineConfig
from engine.weight_ipc import (IpcHandles, IpcStorage, IpcTensor, check_handles, decode, encode,
                               export_cuda_ipc)

CUDA0 = torch.device("cuda", 0)


def storage(size: int = 4096, device: int = 0, **kw) -> IpcStorage:
    fields = dict(device=device, handle=b"\x01" * 64, size=size, offset=512,
                  ref_counter_handle=b"/torch_123_456_0", ref_counter_offset=3,
                  event_handle=b"\x02" * 64, event_sync_required=True)
    fields.update(kw)
    return IpcStorage(**fields)


def handles(*tensors: IpcTensor, storages=None) -> IpcHandles:
    return IpcHandles(pid=1, storages=storages or [storage()], tensors=list(tensors))


def tensor(name="model.norm.weight", dtype="float32", shape=(64,), stride=(1,), offset=0,
           storage=0) -> IpcTensor:
    return IpcTensor(name, dtype, list(shape), list(stride), offset, storage)


def test_the_codec_round_trips_and_bounds_what_enters() -> None:
    h = handles(tensor(), tensor("model.embed_tokens.weight", shape=(4, 8), stride=(8, 1), offset=64))
    data = encode(h)
    assert decode(data) == h
    assert msgspec.msgpack.decode(data, type=IpcHandles) == h
    with pytest.raises(BadRequestError, match="at most"):
        decode(data, max_bytes=len(data) - 1)
    for bad in [dict(h=msgspec.structs.replace(h, tensors=[])),  # nothing to write
                dict(h=handles(tensor(shape=[1] * 9, stride=[1] * 9))),  # too many dims
                dict(h=handles(tensor(), storages=[storage(handle=b"x" * 5000)])),
                dict(h=handles(tensor(), storages=[storage(ref_counter_offset=10000)])),
                dict(h=handles(tensor(offset=-1))),
                dict(h=handles(tensor(name="x" * 513)))]:
        with pytest.raises(BadRequestError):
            decode(encode(bad["h"]))
    with pytest.raises(BadRequestError):
        decode(b"\xc1garbage")


@pytest.mark.parametrize("h, what", [
    (handles(tensor(), storages=[storage(device=1)]), "own device"),
    (handles(tensor(dtype="int64")), "dtype"),
    (handles(tensor(dtype="complex64")), "dtype"),
    (handles(tensor(offset=1000)), "past its storage"),  # 1000 * 4 + 256 > 4096
    (handles(tensor(shape=(64, 64), stride=(64, 1))), "past its storage"),
    (handles(tensor(shape=(2,), stride=(5000,))), "past its storage"),  # strides count too
    (handles(tensor(storage=1)), "does not exist"),
    (handles(tensor(), tensor()), "named twice"),
    (handles(tensor(shape=(64,), stride=(1, 1))), "stride"),
    (handles(tensor(), storages=[storage(ref_counter_handle=b"/etc/passwd")]), "ref-counter"),
])
def test_every_field_is_checked_before_anything_is_opened(h, what) -> None:
    with pytest.raises(BadRequestError, match=what):
        check_handles(h, CUDA0)


def test_a_good_plan_is_the_weights_names_shapes_and_dtypes() -> None:
    h = handles(tensor(), tensor("b", dtype="bfloat16", shape=(2, 3), stride=(1, 2), offset=10))
    assert check_handles(h, CUDA0) == [("model.norm.weight", (64,), torch.float32),
                                      ("b", (2, 3), torch.bfloat16)]
    assert check_handles(handles(tensor(shape=(0, 5), stride=(5, 1), offset=1024)), CUDA0)
    with pytest.raises(BadRequestError, match="IpcHandles"):
        check_handles({"pid": 1}, CUDA0)


def test_export_refuses_cpu_tensors() -> None:
    with pytest.raises(BadRequestError, match="CUDA tensors only"):
        export_cuda_ipc({"w": torch.zeros(3)})


def cfg() -> EngineConfig:
    return EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=64, max_num_seqs=4)


def weights(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.runner.resource("weights").named_parameters()}


@pytest.mark.asyncio
@pytest.mark.usefixtures("torch_one_thread")
async def test_a_cpu_engine_refuses_clearly_and_a_bad_plan_changes_nothing(monkeypatch) -> None:
    async with AsyncEngine.open(cfg()) as eng:
        await eng.pause("abort")
        before = weights(eng)
        name, shape, dtype = eng.weight_info()[0]
        good = tensor(name, dtype, shape, [1] * len(shape) if len(shape) == 1 else [shape[1], 1])
        with pytest.raises(BadRequestError, match="CUDA device"):
            await eng.update_weights_from_ipc(handles(good))
        # as if on cuda:0: the names, shapes and dtypes are checked before a handle is opened
        monkeypatch.setattr(eng.runner, "device", CUDA0)
        big = storage(size=2**40)
        for bad, what in [(tensor("model.nope.weight"), "nope"),
                          (tensor(name, dtype, [3] * len(shape), [1] * len(shape)), name)]:
            with pytest.raises(BadRequestError, match=what):
                await eng.update_weights_from_ipc(handles(good, bad, storages=[big]))
        with pytest.raises(BadRequestError, match="own device"):
            await eng.update_weights_from_ipc(handles(good, storages=[storage(2**40, device=1)]))
        after = weights(eng)
        assert eng.weight_version == 0
        assert all(torch.equal(before[n], after[n]) for n in before)
