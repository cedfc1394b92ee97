"""Text with U+0085, U+2028 or U+2029 in it (each a line end to Python's ``str.splitlines``, so to
httpx's ``iter_lines``): every SSE event still arrives as one line of JSON, and JSON bodies carry
the characters escaped. Also: the peer's host reaches the engine as the request's client."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import anyio
import pytest

from entrypoints.http.errors import escape_separators, json_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ipc"))
from fake_engine import FakeEngine  # noqa: E402
from http_helpers import served  # noqa: E402

SEPARATORS = "\x85\u2028\u2029"


def piece(k: int) -> str:
    return f"<{k}\x85a\u2028b\u2029\\\u2028>"


def test_escaped_json_is_the_same_json_on_one_line():
    rng = random.Random(1)
    alphabet = SEPARATORS + "\\\"\n\r\x0b\x1cé€😀a "
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        data = json_bytes({"text": text, "n": [text]})
        assert json.loads(data) == {"text": text, "n": [text]}
        assert len(data.decode().splitlines()) == 1
        assert not any(c in data.decode() for c in SEPARATORS)
    ascii_only = b'{"a":"b"}'
    assert escape_separators(ascii_only) is ascii_only


@pytest.mark.asyncio
async def test_stream_and_json_bodies_survive_line_based_readers():
    fake = FakeEngine(text=piece)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.run)
        async with served(engine=fake, via="client") as srv, srv.http() as http:
            body = {"model": "fake:counter", "prompt": "a b c", "max_tokens": 5, "stream": True}
            events = []
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line:
                        assert line.startswith("data: "), line
                        events.append(line[len("data: "):])
            assert events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            assert text == "".join(piece(k) for k in range(1, 6))

            resp = await http.post("/v1/completions", json={**body, "stream": False})
            assert resp.status_code == 200 and len(resp.text.splitlines()) == 1
            assert resp.json()["choices"][0]["text"] == text
            # the user (the peer's host) is a client of its own within the frontend's connection
            assert set(fake.clients.values()) == {"c1/127.0.0.1"}
        tg.cancel_scope.cancel()
