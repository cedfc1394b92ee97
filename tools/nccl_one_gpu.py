"""Can two processes on one GPU form an NCCL group? (The weight-transfer channel's NCCL backend is
meant for a trainer on other GPUs; on a one-GPU machine it is checked through gloo instead.) Prints
what NCCL answered for a 2-rank all-reduce and a broadcast with both ranks on cuda:0."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda:0"))
        x = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(x)
        y = torch.arange(4.0, device="cuda") if rank == 0 else torch.zeros(4, device="cuda")
        dist.broadcast(y, 0)
        torch.cuda.synchronize()
        q.put((rank, f"ok: all_reduce {x.tolist()}, broadcast {y.tolist()}"))
    except Exception as exc:  # what NCCL says is the result
        q.put((rank, f"{type(exc).__name__}: {str(exc)[:400]}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    while not q.empty():
        rank, msg = q.get()
        print(f"rank {rank}: {msg}")
    print("exit codes", [p.exitcode for p in procs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
