"""The soak's clients: the well-behaved one and the attackers (HTTP bodies, vanishing, slowloris, IPC)."""

from __future__ import annotations

import json
import random
import struct

import anyio
import httpx

MODEL = ["default"]  # the served model's id, read from /v1/models at start
PROMPTS = ["The capital of France is", "Name three colours:", "Once upon a time",
           "def fibonacci(n):", "The quick brown fox"]


class Stats:
    """Counts per phase (the good clients' outcomes, the attackers' results) and the sampler's readings."""

    def __init__(self) -> None:
        self.phase = "before"
        self.counts: dict[str, dict[str, int]] = {}
        self.samples: list[dict] = []

    def add(self, key: str, n: int = 1) -> None:
        c = self.counts.setdefault(self.phase, {})
        c[key] = c.get(key, 0) + n


async def good_client(base: str, stats: Stats, stop: anyio.Event, k: int, timeout: float) -> None:
    rnd = random.Random(k)
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as c:
        while not stop.is_set():
            body = {"model": MODEL[0], "prompt": rnd.choice(PROMPTS), "temperature": 0,
                    "max_tokens": rnd.randint(4, 16), "stream": rnd.random() < 0.5}
            try:
                if body["stream"]:
                    finished = False
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code == 200:
                            async for line in r.aiter_lines():
                                if line.startswith("data: {") and '"finish_reason":"' in line.replace(" ", ""):
                                    finished = True
                        status = r.status_code
                        retry = r.headers.get("retry-after")
                    ok = status == 200 and finished
                else:
                    r = await c.post("/v1/completions", json=body)
                    status, retry = r.status_code, r.headers.get("retry-after")
                    ok = status == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            except (httpx.TimeoutException, httpx.TransportError):
                stats.add("lost")
                await anyio.sleep(0.5)
                continue
            if ok:
                stats.add("served")
            elif status in (429, 503) and retry:
                stats.add("refused_retryable")
                await anyio.sleep(min(2.0, float(retry)))
            else:
                stats.add(f"failed_{status}")


async def _post_raw(base: str, body: bytes, timeout: float = 30) -> int:
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as c:
        r = await c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        return r.status_code


def _http_kinds() -> list:
    """The hostile bodies of :func:`attack_http`: (name, a function making the body)."""
    return [
        ("huge_top_k", lambda: json.dumps({"model": MODEL[0], "prompt": "x", "max_tokens": 2,
                                           "top_k": 2**63}).encode()),
        ("huge_seed", lambda: json.dumps({"model": MODEL[0], "prompt": "x", "seed": 2**64 - 1}).encode()),
        ("bool_max_tokens", lambda: b'{"model":"%s","prompt":"x","max_tokens":true}' % MODEL[0].encode()),
        ("huge_stop_ids", lambda: json.dumps({"model": MODEL[0], "prompt": "x", "max_tokens": 2,
                                              "stop_token_ids": list(range(200_000))}).encode()),
        ("huge_stop", lambda: json.dumps({"model": MODEL[0], "prompt": "x",
                                          "stop": ["y" * 100_000] * 16}).encode()),
        ("giant_prompt", lambda: json.dumps({"model": MODEL[0], "prompt": "z " * 2_000_000,
                                             "max_tokens": 2}).encode()),
        ("bad_json", lambda: b'{"model": MODEL[0], "prompt": '),
        ("oversized_body", lambda: b'{"prompt": "' + b"a" * (64 * 2**20) + b'"}'),
        # not in the default set (the soak's default workload stays the one bench/RESULTS.md reports)
        ("many_prompts", lambda: json.dumps({"model": MODEL[0], "prompt": [[5]] * 300_000,
                                             "max_tokens": 2}).encode()),
    ]


HTTP_KINDS = tuple(name for name, _ in _http_kinds())
DEFAULT_HTTP_KINDS = tuple(k for k in HTTP_KINDS if k != "many_prompts")
ATTACKS = ("http", "vanishing", "slowloris", "ipc")


async def attack_http(base: str, stats: Stats, stop: anyio.Event, rate: float,
                      only: tuple = DEFAULT_HTTP_KINDS) -> None:
    """Hostile bodies, one every 1/rate seconds, cycling through the kinds in ``only``."""
    kinds = [(name, make) for name, make in _http_kinds() if name in only]
    if not kinds:
        return
    i = 0
    while not stop.is_set():
        name, make = kinds[i % len(kinds)]
        i += 1
        try:
            status = await _post_raw(base, make())
            stats.add(f"attack_{name}_{status}")
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            stats.add(f"attack_{name}_{type(exc).__name__}")
        await anyio.sleep(1.0 / rate)


async def attack_vanishing(base: str, stats: Stats, stop: anyio.Event) -> None:
    """Clients that start a long stream and disconnect after the first chunk."""
    while not stop.is_set():
        try:
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                async with c.stream("POST", "/v1/completions", json={
                        "model": MODEL[0], "prompt": "Tell a long story", "max_tokens": 200,
                        "stream": True, "ignore_eos": True}) as r:
                    async for _ in r.aiter_lines():
                        break
            stats.add("attack_vanished")
        except (httpx.TimeoutException, httpx.TransportError):
            stats.add("attack_vanished_error")
        await anyio.sleep(0.5)


async def attack_slowloris(port: int, stats: Stats, stop: anyio.Event, n: int) -> None:
    """``n`` connections that send a request head one byte every few seconds."""
    socks: list = []
    try:
        while not stop.is_set():
            while len(socks) < n and not stop.is_set():
                try:
                    s = await anyio.connect_tcp("127.0.0.1", port)
                    await s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    socks.append(s)
                except OSError:
                    stats.add("attack_slowloris_connect_error")
                    break
            alive = []
            for s in socks:
                try:
                    await s.send(b"X")
                    alive.append(s)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    stats.add("attack_slowloris_closed_by_server")
                    await s.aclose()
            socks = alive
            await anyio.sleep(3)
    finally:
        for s in socks:
            await s.aclose()


async def attack_ipc(path: str, stats: Stats, stop: anyio.Event, n_bare: int) -> None:
    """Bare connections that never say Hello, garbage frames, and wrong tokens."""
    bare: list = []
    try:
        while not stop.is_set():
            while len(bare) < n_bare:
                try:
                    bare.append(await anyio.connect_unix(path))
                except OSError:
                    stats.add("attack_ipc_connect_error")
                    break
            for payload in (struct.pack(">I", 2**31) + b"x", struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1",
                            _hello_with_token("wrong")):
                try:
                    s = await anyio.connect_unix(path)
                    await s.send(payload)
                    with anyio.move_on_after(2):
                        await s.receive()
                    await s.aclose()
                    stats.add("attack_ipc_frame")
                except (OSError, anyio.EndOfStream, anyio.BrokenResourceError):
                    stats.add("attack_ipc_frame_closed")
            # bare connections are recycled: the engine closes them at its handshake timeout
            kept = []
            for s in bare:
                try:
                    await s.send(b"")
                    kept.append(s)
                except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await s.aclose()
            bare = kept
            await anyio.sleep(1)
    finally:
        for s in bare:
            await s.aclose()


def _hello_with_token(token: str) -> bytes:
    import msgspec

    from ipc.messages import PROTOCOL_VERSION

    body = msgspec.msgpack.encode({"t": "Hello", "protocol_version": PROTOCOL_VERSION, "token": token})
    return struct.pack(">I", len(body)) + body
