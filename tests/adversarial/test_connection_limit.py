"""Finding 2 (the limit): nothing bounded the number of connections, handshaken or not, so a
flood could take every file descriptor. Now beyond ``max_connections`` a new connection gets a
fatal ``Error(OVERLOADED)`` ("too many connections (max N)") at once -- not after the handshake
timeout -- and is closed; the client raises the retryable EngineOverloadedError."""

from __future__ import annotations

import time

import anyio
import pytest

from engine.errors import EngineOverloadedError
from engine.params import SamplingParams
from helpers import serving
from ipc.client import EngineClient
from ipc.framing import FrameCodec, FrameReader
from ipc.errors import ConnectionClosed
from ipc.messages import EngineMessage, Error, ErrorKind
from ipc.transport import connect

pytestmark = pytest.mark.asyncio


@pytest.mark.alone  # asserts wall-clock bounds
async def test_connections_beyond_the_limit_are_refused_politely_and_at_once():
    async with serving(max_connections=4, handshake_timeout=10.0) as (eng, server, addr):
        async with EngineClient.connect(addr) as good:
            running = good.generate([1], SamplingParams(max_tokens=200))
            await running.__anext__()
            bare = [await connect(addr) for _ in range(3)]  # no Hello: they count too
            try:
                with anyio.fail_after(5):
                    while server.live < 4:
                        await anyio.sleep(0.01)
                t0 = time.monotonic()
                with pytest.raises(EngineOverloadedError, match=r"too many connections \(max 4\)") as info:
                    async with EngineClient.connect(addr):
                        pass
                assert time.monotonic() - t0 < 2.0 and info.value.retry_after > 0
                raw = await connect(addr)  # what the wire says: one fatal Error, then EOF
                reader = FrameReader(raw, FrameCodec(EngineMessage))
                with anyio.fail_after(2):
                    err = await reader.read()
                    with pytest.raises(ConnectionClosed):
                        await reader.read()
                await raw.aclose()
                assert isinstance(err, Error) and err.kind is ErrorKind.OVERLOADED and err.fatal
                outs = [o async for o in running]  # the good client is unaffected
                assert outs[-1].finish_reason == "length"
            finally:
                for s in bare:
                    await s.aclose()
            with anyio.fail_after(5):  # a freed slot is usable again
                while server.live > 1:
                    await anyio.sleep(0.01)
            async with EngineClient.connect(addr) as again:
                assert (await again.complete([1], SamplingParams(max_tokens=2))).token_ids == [1, 2]
