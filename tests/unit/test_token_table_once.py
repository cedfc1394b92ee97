"""The token table (how logprobs show token ids) is asked of the engine once per frontend, even
when a burst's first requests all need it at the same moment (each asked for it before: the
whole vocabulary over IPC per request), and a frontend fetches it before it serves."""

from __future__ import annotations

import anyio
import pytest

from entrypoints.http.context import Frontend
from states import State


class _Engine:
    """What Frontend reads of an engine, with a slow, counted ``token_bytes``."""

    model = "fake"
    state = State.SERVING
    max_model_len = 64

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def on_state_change(self, listener) -> None:
        pass

    async def token_bytes(self) -> list[bytes]:
        self.calls += 1
        await anyio.sleep(0.05)
        if self.fail:
            raise RuntimeError("asleep")
        return [b"a", b"b", b"\xff"]


def test_concurrent_first_askers_share_one_fetch():
    async def main():
        eng = _Engine()
        fe = Frontend(eng)
        tables = []

        async def ask():
            tables.append(await fe.token_table())

        async with anyio.create_task_group() as tg:
            for _ in range(32):
                tg.start_soon(ask)
        assert eng.calls == 1 and len(tables) == 32 and all(t is tables[0] for t in tables)
        await fe.prefetch()  # already there: nothing asked
        assert eng.calls == 1

    anyio.run(main)


def test_prefetch_fetches_before_serving_and_a_failure_is_not_fatal(caplog):
    async def main():
        eng = _Engine()
        fe = Frontend(eng)
        await fe.prefetch()
        assert eng.calls == 1 and fe._token_table is not None
        bad = _Engine(fail=True)
        fe2 = Frontend(bad)
        await fe2.prefetch()  # logged, not raised; the routes fetch it later
        assert fe2._token_table is None
        slow = Frontend(_Engine())
        await slow.prefetch(timeout=0.001)
        assert slow._token_table is None

    anyio.run(main)
    assert "not fetched before serving" in caplog.text
