"""An IPCServer over the fake engine, in this process (as tests/ipc/test_client.py does)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio

from fake_engine import FakeEngine
from ipc.server import IPCServer


@asynccontextmanager
async def serving(address: str = "tcp://127.0.0.1:0", engine: FakeEngine | None = None, **kw):
    engine = engine or FakeEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        server = IPCServer(engine, address, **kw)
        addr = await tg.start(lambda task_status: server.serve(task_status=task_status))
        yield engine, server, addr
        tg.cancel_scope.cancel()
