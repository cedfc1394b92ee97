"""``python fd_limited_server.py ADDRESS NOFILE``: serve a FakeEngine over IPC with the soft
RLIMIT_NOFILE lowered to NOFILE; prints ``READY <address>``; exits 0 after a client's Shutdown."""

from __future__ import annotations

import logging
import resource
import sys
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ipc"))

from fake_engine import FakeEngine  # noqa: E402
from ipc.server import serve_ipc  # noqa: E402


async def main(address: str) -> None:
    engine = FakeEngine(step_interval=0.005)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        bound = await tg.start(lambda task_status: serve_ipc(
            engine, address, max_connections=100_000, handshake_timeout=1.0, log_interval=1.0,
            task_status=task_status))
        print(f"READY {bound}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), hard))
    anyio.run(main, sys.argv[1])
