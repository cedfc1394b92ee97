"""A stand-in trainer on the engine's GPU for the CUDA-IPC weight path (engine/weight_ipc.py),
run as a child process: ``python -m bench.ipc_trainer``. Used by bench/weight_sync.py (path
``ipc``) and tests/gpu/test_gpu_weight_ipc.py.

It speaks length-prefixed msgpack frames (msgspec; no pickle) on stdin / stdout:

* in ``{"spec": [[name, shape, dtype], ...], "seed": n, "mode": "tensors" | "bucket"}``: it makes
  :func:`trainer_weights` on ``cuda`` and answers ``{"ready": true}``;
* in ``{"cmd": "export"}``: answers ``{"handles": <IpcHandles msgpack>, "export_s": s}``
  (``tensors``: ``export_cuda_ipc`` of its own tensors; ``bucket``: an ``IpcSender``);
* in ``{"cmd": "close"}``: drops everything, collects what the engine let go and answers
  ``{"allocated": bytes}`` -- its CUDA memory above what it held before the weights -- then exits.
"""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import sys
import time
from typing import Any, BinaryIO

import msgspec
import torch

_LEN = struct.Struct("<I")
MAX_FRAME = 64 * 2**20


def write_frame(out: BinaryIO, obj: Any) -> None:
    data = msgspec.msgpack.encode(obj)
    out.write(_LEN.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> Any:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the other side closed the pipe")
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    data = inp.read(n)
    if len(data) < n:
        raise EOFError("the other side closed the pipe mid-frame")
    return msgspec.msgpack.decode(data)


def trainer_weights(spec, seed: int, device="cuda") -> dict[str, torch.Tensor]:
    """Seeded random weights of ``spec`` ((name, shape, dtype) as ``weight_info()`` lists them):
    the same on the same device in any process."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape, dtype in spec:
        t = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32) * 0.02
        out[name] = t.to(getattr(torch, dtype))
    return out


class TrainerProcess:
    """The parent's handle on a :mod:`bench.ipc_trainer` child."""

    def __init__(self, spec, seed: int, mode: str = "tensors") -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.ipc_trainer"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._call({"spec": [[n, list(s), d] for n, s, d in spec], "seed": seed, "mode": mode})

    def _call(self, msg: dict) -> dict:
        write_frame(self.proc.stdin, msg)
        return read_frame(self.proc.stdout)

    def export(self):
        """The trainer's current weights as ``IpcHandles`` (and its export's seconds)."""
        from engine.weight_ipc import decode

        got = self._call({"cmd": "export"})
        return decode(got["handles"]), got["export_s"]

    def close(self, timeout: float = 60.0) -> int:
        """The trainer lets go of everything; its CUDA bytes still held afterwards."""
        got = self._call({"cmd": "close"})
        self.proc.stdin.close()
        self.proc.wait(timeout)
        self.proc.stdout.close()
        return got["allocated"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if not pipe.closed:
                pipe.close()


def main() -> int:
    from engine.weight_ipc import IpcSender, encode, export_cuda_ipc

    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # the frames' own copy of stdout; anything printed
    os.dup2(2, 1)  # (by Python or by a library in C) goes to stderr instead
    sys.stdout = sys.stderr
    torch.cuda.init()
    torch.empty(1, device="cuda")
    base = torch.cuda.memory_allocated()
    cfg = read_frame(inp)
    weights = trainer_weights(cfg["spec"], cfg["seed"])
    torch.cuda.synchronize()
    sender = IpcSender() if cfg["mode"] == "bucket" else None
    write_frame(out, {"ready": True})
    while True:
        msg = read_frame(inp)
        if msg.get("cmd") == "export":
            t0 = time.perf_counter()
            handles = sender.export(weights) if sender else export_cuda_ipc(weights)
            torch.cuda.synchronize()
            write_frame(out, {"handles": encode(handles), "export_s": time.perf_counter() - t0})
        elif msg.get("cmd") == "close":
            weights = {}
            if sender:
                sender.close()
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
            write_frame(out, {"allocated": torch.cuda.memory_allocated() - base})
            return 0
        else:
            raise ValueError(f"unknown command {msg!r}")


if __name__ == "__main__":
    sys.exit(main())
