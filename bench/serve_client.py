"""One client process of ``bench.serve``: ``python -m bench.serve_client`` (started by the bench,
never by hand). It imports no torch: a client that is not the bottleneck starts fast and stays
small.

The conversation is msgspec JSON lines over the pipes (no pickle):

1. stdin: a :class:`Job` -- the server's address, the route, this client's share of the
   requests (each a ready JSON body and its arrival offset in seconds), its share of the
   concurrency and the per-request timeout;
2. stdout: ``{"ready": true}`` once the HTTP client exists;
3. stdin: ``{"t0": T}`` -- the common start, in ``time.monotonic()`` seconds (CLOCK_MONOTONIC:
   one clock for every process of the machine), so every client's offsets count from one instant;
4. stdout, after the last request: one :class:`Result` per request, then a :class:`Done` with this
   process's CPU seconds from the start to the last response. Nothing is written while requests run (no I/O of ours competes with them).

Each request is streamed (SSE), through httpx (``client: "httpx"``) or a plain HTTP/1.1 reader of
its own (``"raw"``, :func:`one_raw`). A token is counted from the chunk's logprobs (``logprobs: 0`` on
completions, ``logprobs: true, top_logprobs: 0`` on chat): a chunk carrying k tokens counts k
(its inter-token gap split into k equal gaps, as ``bench.recorder`` does). Arrival times are
taken as the bytes arrive, before the JSON is decoded.
"""

from __future__ import annotations

import math
import resource
import ssl
import sys
import time
from typing import Optional

import msgspec


class Item(msgspec.Struct):
    i: int
    body: msgspec.Raw  # the request's JSON, sent as is
    at: float = 0.0  # seconds after t0 (a Poisson arrival; 0 for a burst)


class Job(msgspec.Struct):
    base_url: str
    path: str
    items: list[Item]
    concurrency: int
    timeout: float = 600.0
    client: str = "httpx"  # or "raw" (one_raw)


class Start(msgspec.Struct):
    t0: float


class Result(msgspec.Struct, omit_defaults=True):
    i: int
    submit: float = 0.0  # just before the request is written
    head: Optional[float] = None  # the response head received (status line and headers)
    first: Optional[float] = None  # the first chunk with a token received
    end: float = 0.0
    tokens: int = 0
    itl: list[float] = []
    finish: Optional[str] = None
    usage_tokens: Optional[int] = None
    error: Optional[str] = None


class Done(msgspec.Struct):
    done: bool = True
    cpu_s: float = 0.0


# the fields of a streamed chunk that are read; the rest is skipped by the decoder
class _Logprobs(msgspec.Struct):
    tokens: Optional[list[msgspec.Raw]] = None  # completions
    content: Optional[list[msgspec.Raw]] = None  # chat


class _Choice(msgspec.Struct):
    finish_reason: Optional[str] = None
    logprobs: Optional[_Logprobs] = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: Optional[_Usage] = None
    error: Optional[msgspec.Raw] = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _events(buf: bytearray) -> list[bytes]:
    """The complete SSE events at the head of ``buf`` (removed from it): their data payloads."""
    out = []
    while True:
        end = buf.find(b"\n\n")
        if end < 0:
            return out
        event = bytes(buf[:end])
        del buf[:end + 2]
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())


def _count(chunk: _Chunk) -> tuple[int, Optional[str]]:
    k, finish = 0, None
    for ch in chunk.choices:
        lp = ch.logprobs
        if lp is not None:
            k += len(lp.tokens if lp.tokens is not None else lp.content or ())
        finish = ch.finish_reason or finish
    return k, finish


class _Reader:
    """A response body's SSE events into ``res``: tokens counted, first-token and inter-token
    times (``t``: when the bytes arrived, before any decoding)."""

    def __init__(self, res: Result) -> None:
        self.res = res
        self.last = res.submit
        self.buf = bytearray()

    def feed(self, t: float, data: bytes) -> None:
        res = self.res
        self.buf += data
        for payload in _events(self.buf):
            if payload == b"[DONE]":
                continue
            chunk = _decode_chunk(payload)
            if chunk.error is not None:
                res.error = "stream error: " + bytes(chunk.error)[:300].decode("utf-8", "replace")
                continue
            if chunk.usage is not None:
                res.usage_tokens = chunk.usage.completion_tokens
            k, finish = _count(chunk)
            if k:
                if res.first is None:
                    res.first = t
                    res.itl.extend([0.0] * (k - 1))
                else:
                    res.itl.extend([(t - self.last) / k] * k)
                self.last = t
                res.tokens += k
            res.finish = finish or res.finish


async def one(client, path: str, item: Item, res: Result) -> None:
    """One request through httpx (``client``: an ``httpx.AsyncClient`` of one connection)."""
    import httpx

    res.submit = time.monotonic()
    reader = _Reader(res)
    try:
        async with client.stream("POST", path, content=bytes(item.body),
                                 headers={"content-type": "application/json"}) as resp:
            res.head = time.monotonic()
            if resp.status_code != 200:
                text = (await resp.aread())[:300].decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {text}"
                return
            async for data in resp.aiter_raw():
                reader.feed(time.monotonic(), data)
    except (httpx.HTTPError, msgspec.DecodeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:  # (also when the request's timeout cancels it)
        res.end = time.monotonic()


async def one_raw(address: tuple[str, int], path: str, item: Item, res: Result) -> None:
    """One request on a connection of its own, HTTP/1.1 read by hand: the status line and
    headers, then the chunked body (``Connection: close``: the server ends it).

    Why by hand: httpx (httpcore + h11 + anyio streams) spent ~170 µs of CPU per streamed token
    in these processes, twice the server's own, so on a small machine the clients took the CPU
    the server was being measured on; this reader spends a fraction of that."""
    import asyncio

    host, port = address
    body = bytes(item.body)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    res.submit = time.monotonic()
    reader = _Reader(res)
    writer = None
    try:
        stream, writer = await asyncio.open_connection(host, port)
        writer.write(head + body)
        raw = bytearray()
        while b"\r\n\r\n" not in raw:
            data = await stream.read(65536)
            if not data:
                raise ConnectionError("closed before the response head")
            raw += data
        res.head = time.monotonic()
        end = raw.index(b"\r\n\r\n")
        status_line, *lines = bytes(raw[:end]).decode("latin-1").split("\r\n")
        del raw[:end + 4]
        status = int(status_line.split(" ", 2)[1])
        chunked = any(ln.lower().replace(" ", "") == "transfer-encoding:chunked" for ln in lines)
        if status != 200 or not chunked:
            raw += await stream.read()  # (Connection: close: the rest, then EOF)
            res.error = f"HTTP {status}: {bytes(raw[:300]).decode('utf-8', 'replace')}"
            return
        t = time.monotonic()
        while True:  # chunks: SIZE (hex) CRLF DATA CRLF ... 0 CRLF CRLF
            eol = raw.find(b"\r\n")
            if eol >= 0:
                size = int(bytes(raw[:eol]).split(b";", 1)[0], 16)
                if size == 0:
                    break
                if len(raw) >= eol + 2 + size + 2:
                    reader.feed(t, bytes(raw[eol + 2:eol + 2 + size]))
                    del raw[:eol + 2 + size + 2]
                    continue
            data = await stream.read(65536)
            if not data:
                raise ConnectionError("closed mid-response")
            t = time.monotonic()
            raw += data
    except (OSError, ValueError, IndexError, msgspec.DecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:  # (also when the request's timeout cancels it)
        res.end = time.monotonic()
        if writer is not None:
            writer.close()


async def run(job: Job, t0: float, clients: list) -> list[Result]:
    """Every item of ``job``, each sent at ``t0`` + its offset on a free client of ``clients``
    (httpx clients of one connection each -- httpx's pool looks at all its connections on every
    request and response, which costs more than the request itself with a hundred of them --
    or, for the raw client, the server's address once per concurrency slot)."""
    import anyio

    results = [Result(i=it.i) for it in job.items]
    free = list(clients)
    slots = anyio.Semaphore(len(free))
    send = one if job.client == "httpx" else one_raw

    async def go(item: Item, res: Result) -> None:
        delay = t0 + item.at - time.monotonic()
        if delay > 0:
            await anyio.sleep(delay)
        async with slots:
            client = free.pop()
            try:
                with anyio.move_on_after(job.timeout) as scope:
                    await send(client, job.path, item, res)
                if scope.cancelled_caught:
                    res.error = f"timeout after {job.timeout:g} s"
            finally:
                free.append(client)

    async with anyio.create_task_group() as tg:
        for item, res in zip(job.items, results):
            tg.start_soon(go, item, res)
    return results


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _main() -> int:
    import contextlib

    import anyio
    import httpx

    stdin = sys.stdin.buffer
    out = sys.stdout.buffer
    job = msgspec.json.decode(stdin.readline(), type=Job)
    # no timeout per read (each is a cancel scope more per token): one per request, in run()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context()  # unused (plain HTTP), but each client would make its own
    slots = max(1, min(job.concurrency, len(job.items)))
    async with contextlib.AsyncExitStack() as stack:
        if job.client == "httpx":
            clients = [await stack.enter_async_context(httpx.AsyncClient(
                base_url=job.base_url, limits=limits, timeout=httpx.Timeout(None), verify=tls))
                for _ in range(slots)]
        else:
            url = httpx.URL(job.base_url)
            clients = [(url.host, url.port or 80)] * slots
        out.write(b'{"ready": true}\n')
        out.flush()
        line = await anyio.to_thread.run_sync(stdin.readline)
        if not line:
            return 1
        start = msgspec.json.decode(line, type=Start)
        cpu0 = _cpu()
        results = await run(job, start.t0, clients)
        cpu_s = _cpu() - cpu0
    enc = msgspec.json.Encoder()
    for r in results:
        out.write(enc.encode(r) + b"\n")
    out.write(enc.encode(Done(cpu_s=cpu_s)) + b"\n")
    out.flush()
    return 0


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets of ``n`` requests at ``rate`` a second (exponential gaps; all 0 for inf)."""
    import random

    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def main() -> int:
    import anyio

    return anyio.run(_main)


__all__ = ["Item", "Job", "Start", "Result", "Done", "poisson_offsets", "run", "one", "one_raw"]

if __name__ == "__main__":
    sys.exit(main())
