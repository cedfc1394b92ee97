"""A tensor-parallel worker: ``python -m entrypoints.tp_worker --connect HOST:PORT --rank R``.

A process entry point (it configures its own signals and logging): it connects to the driver,
joins the process group, loads its shard through the same :class:`~engine.runner.model_runner.ModelRunner`
as the driver, then replays every ``Step`` the driver sends, and runs its part of each
``Sleep``, ``Wake`` and ``Update`` (answering ``Done``), until ``Shutdown`` -- when it
releases its owner, reports the weakref check, destroys the process group and exits 0.

It never outlives the driver: a closed control connection ends it (at once, the kernel closes
a killed driver's sockets), and a watchdog thread exits when its parent process is gone.
NOTE: not ``prctl(PR_SET_PDEATHSIG)``: that fires when the *thread* that forked the worker
exits, and the driver forks from a pooled loading thread that anyio retires when idle.
SIGTERM and SIGINT are ignored: the driver drains and stops every rank itself (a Ctrl-C or a
``kill`` of the process group must not take a rank away under a draining driver).

Exit codes: 0 after a Shutdown, 1 when the driver is gone or a step failed, 2 when loading
failed (reported to the driver first as ``Failed(startup=True)``).
"""

from __future__ import annotations

import argparse
from datetime import timedelta
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

from engine import envs

log = logging.getLogger("enginecore.tp.worker")


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.25)
    os._exit(1)  # the driver (or the node launcher) is gone: so are we


def _connect(addr: str, deadline: float) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=5.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="entrypoints.tp_worker")
    ap.add_argument("--connect", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--local-rank", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, default=None)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if a.parent_pid:
        if os.getppid() != a.parent_pid:
            return 1
        threading.Thread(target=_watch_parent, args=(a.parent_pid,), daemon=True).start()
    logging.basicConfig(level=envs.get(envs.TP_LOG_LEVEL).upper(),
                        format=f"%(asctime)s rank {a.rank} %(name)s %(levelname)s: %(message)s")
    return run(a.connect, a.rank, a.local_rank)


def run(addr: str, rank: int, local_rank: int) -> int:
    import msgspec
    import torch
    import torch.distributed as dist

    from engine.config import EngineConfig
    from engine.runner.model_runner import ModelRunner
    from engine.tp.channel import (Channel, Closed, Done, Failed, Hello, Init, Shutdown, Sleep,
                                   Step, Update, Wake)
    from engine.tp.group import TOKEN_ENV
    from engine.tp.link import WorkerLink

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ch = Channel(_connect(addr, time.monotonic() + 60.0))
    ch.send(Hello(rank, os.environ.pop(TOKEN_ENV, "")))
    init = ch.recv(timeout=120.0)
    if not isinstance(init, Init):
        return 1
    config = msgspec.json.decode(init.config_json, type=EngineConfig)
    device = config.resolved_device()
    if device.type == "cuda":  # one GPU a rank; ranks share them if there are fewer (gloo)
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        config = msgspec.structs.replace(config, device=f"cuda:{index}")
    store = dist.TCPStore(init.store_host, init.store_port, init.world, False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group(init.backend, store=store, rank=rank, world_size=init.world,
                            timeout=timedelta(seconds=init.timeout_s))
    runner = ModelRunner(config, tp=WorkerLink(rank, init.world, ch))
    try:
        runner.load()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"enginecore tp rank {rank}: startup failed: {error}", file=sys.stderr, flush=True)
        _send_quietly(ch, Failed(rank, error, True))
        dist.destroy_process_group()
        return 2
    code = 0
    try:
        while True:
            msg = ch.recv()
            if isinstance(msg, Step):
                runner.replay(msg.seqs, msg.logits_rows)
            elif isinstance(msg, (Sleep, Wake, Update)):
                ch.send(_control(runner, msg, rank, Done))
            elif isinstance(msg, Shutdown):
                break
    except Closed:
        code = 1  # the driver is gone
    except Exception as exc:
        print(f"enginecore tp rank {rank}: step failed: {exc!r}", file=sys.stderr, flush=True)
        traceback.print_exc()
        _send_quietly(ch, Failed(rank, f"{type(exc).__name__}: {exc}", False))
        code = 1
    runner.shutdown()  # releases the owner and reports (WorkerLink.close)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    ch.close()
    return code


def _control(runner, msg, rank: int, done):
    """One sleep-mode call of the driver's (engine/tp/control.py), answered: its error does not
    end this rank (a failed wake leaves it asleep; the driver decides what follows)."""
    from engine.tp.channel import Sleep, Wake

    try:
        if isinstance(msg, Sleep):
            value = runner.sleep(msg.level, msg.tags)
        elif isinstance(msg, Wake):
            value = runner.wake(msg.tags)
        else:
            value = runner.receive_weights(msg.names, msg.shapes, msg.bucket_bytes, msg.source)
    except Exception as exc:
        log.warning("%s failed: %r", type(msg).__name__.lower(), exc)
        traceback.clear_frames(exc.__traceback__)
        error = f"{type(exc).__name__}: {exc}"
        value = 0
    else:
        error = ""
    return done(msg.seq, rank, error, int(value or 0), runner.resources(), list(runner.asleep))


def _send_quietly(ch, msg) -> None:
    from engine.tp.channel import Closed

    try:
        ch.send(msg)
    except Closed:
        pass


if __name__ == "__main__":
    sys.exit(main())
