"""Hostile connections against the HTTP frontend (findings 4 and 7, and the in-flight
limit): oversized bodies, slowloris heads and bodies, too many connections or requests, and the
accept-error log flood when descriptors run out."""

from __future__ import annotations

import importlib.util
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
from http_helpers import ROOT, TINY, served  # noqa: E402

from entrypoints.http.limits import HttpLimits  # noqa: E402
from entrypoints.http.server import FloodFilter  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("torch_one_thread")]
MODEL = TINY.model
MiB = 2**20
#: The attacks on the connection level run against both HTTP parsers (server.py).
IMPLS = pytest.mark.parametrize("impl", ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    importlib.util.find_spec("httptools") is None, reason="httptools not installed"))])


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def read_response(sock: socket.socket, timeout: float) -> bytes:
    """What the server sent until it stopped sending for a moment (or closed)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def upload_chunked(port: int, total: int, out: list) -> None:
    """POST ``total`` bytes without a length (chunked), stopping at the first answer."""
    piece = b"a" * (256 * 1024)
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        try:
            while sent < total:
                sock.sendall(frame)
                sent += len(piece)
                if select.select([sock], [], [], 0)[0]:
                    break
        except OSError:
            pass
        out.append((sent, read_response(sock, 5.0)))


@IMPLS
@pytest.mark.alone  # asserts wall-clock bounds
async def test_finding4_oversized_bodies_get_413_and_memory_stays_flat(impl):
    async with served(limits=HttpLimits(http_impl=impl)) as s:
        # A Content-Length above the limit: answered from the head, the body is never awaited.
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                         b"Content-Type: application/json\r\n\r\n" % (300 * MiB))
            t0 = time.monotonic()
            data = await anyio.to_thread.run_sync(read_response, sock, 5.0)
        assert data.startswith(b"HTTP/1.1 413"), data[:200]
        assert b'"code":"request_too_large"' in data and time.monotonic() - t0 < 2.0

        # Chunked, no length: three 96 MiB uploads at once; each is cut off after the limit.
        before = rss()
        out: list = []
        threads = [threading.Thread(target=upload_chunked, args=(s.port, 96 * MiB, out))
                   for _ in range(3)]
        for t in threads:
            t.start()
        await anyio.to_thread.run_sync(lambda: [t.join(60) for t in threads])
        grown = rss() - before
        assert len(out) == 3
        for sent, data in out:
            assert data.startswith(b"HTTP/1.1 413"), data[:200]
            assert sent < 32 * MiB, sent  # answered early, not after the whole body
        assert grown < 48 * MiB, grown / MiB
        async with s.http() as c:
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200


@IMPLS
@pytest.mark.alone  # asserts wall-clock bounds
async def test_finding7_slowloris_heads_and_bodies_are_closed_while_a_good_client_is_served(impl):
    limits = HttpLimits(header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0,
                        http_impl=impl)
    async with served(limits=limits) as s:
        closed_after: list[float] = []

        async def slowloris(i: int) -> None:
            async with await anyio.connect_tcp("127.0.0.1", s.port) as conn:
                t0 = time.monotonic()
                await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                with anyio.fail_after(10):
                    while True:
                        try:
                            await conn.send(b"X-Slow-%d: y\r\n" % i)
                            with anyio.move_on_after(0.25):
                                if not await conn.receive():
                                    break
                        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                            break
                closed_after.append(time.monotonic() - t0)

        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(slowloris, i)
            async with s.http() as c:
                r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                assert r.status_code == 200
        assert len(closed_after) == 40
        assert max(closed_after) < 3.0, closed_after

        # A body that trickles: 408, then closed.
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                         b"Content-Type: application/json\r\n\r\n{")
            data = await anyio.to_thread.run_sync(read_response, sock, 4.0)
        assert data.startswith(b"HTTP/1.1 408"), data[:200]

        # An idle kept-alive connection is closed after keep_alive_timeout.
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await anyio.to_thread.run_sync(read_response, sock, 2.0)).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            sock.settimeout(5)
            assert await anyio.to_thread.run_sync(sock.recv, 10) == b""
            assert time.monotonic() - t0 < 2.5


@IMPLS
async def test_finding7_connection_cap_answers_503_then_closes_unread(impl):
    limits = HttpLimits(max_connections=8, header_timeout=5.0, http_impl=impl)
    async with served(limits=limits) as s:
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(8)]
        try:
            await anyio.sleep(0.2)
            with socket.create_connection(("127.0.0.1", s.port)) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                data = await anyio.to_thread.run_sync(read_response, sock, 3.0)
            assert data.startswith(b"HTTP/1.1 503"), data[:200]
            assert b'"code":"too_many_connections"' in data and b"retry-after: 1" in data.lower()
            more = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(30)]
            await anyio.sleep(0.3)
            assert len(s.server.server_state.connections) <= 16  # beyond twice the cap: closed
            for sock in more:
                sock.close()
        finally:
            for sock in idle:
                sock.close()
        await anyio.sleep(0.2)
        async with s.http() as c:
            assert (await c.get("/health")).status_code == 200


async def test_requests_in_flight_limit_answers_429():
    async with served(limits=HttpLimits(max_requests_in_flight=2)) as s, s.http() as c:
        body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as a, \
                c.stream("POST", "/v1/completions", json=body) as b:
            assert a.status_code == b.status_code == 200
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "too_many_requests"
            assert (await c.get("/health")).status_code == 200  # not a generation request
        # the two streams' clients went away: their slots come back once the server has seen it
        # (their generations aborted), not necessarily before the next request arrives
        with anyio.fail_after(30):
            while (r := await c.post("/v1/completions",
                                     json={"prompt": "hi", "max_tokens": 2})).status_code == 429:
                await anyio.sleep(0.1)
        assert r.status_code == 200


# --------------------------------------------------------------------------- descriptors

SERVER = """
import resource, socket, sys
import anyio
from entrypoints.http.limits import HttpLimits
from entrypoints.http.server import event_loop_factory, make_server

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

async def main():
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    print(sock.getsockname()[1], flush=True)
    await make_server(app, LIMITS).serve([sock])

LIMITS = HttpLimits(max_connections=100_000, header_timeout=30.0, http_impl=sys.argv[1])
factory = event_loop_factory(LIMITS)  # as the frontend's entry point runs it
anyio.run(main, backend_options={"loop_factory": factory} if factory else None)
"""


@IMPLS
async def test_finding7_descriptor_exhaustion_neither_floods_the_log_nor_stops_serving(tmp_path, impl):
    """A server with 128 descriptors and 600 connections: it closes what it cannot hold (it
    used to log the accept error 2048 times per retry), and serves again once they are gone."""
    err = tmp_path / "stderr"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(err, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, impl], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=stderr)
    try:
        port = int(await anyio.to_thread.run_sync(proc.stdout.readline))
        conns = []
        for _ in range(600):
            try:
                conns.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                pass
        await anyio.sleep(2.0)
        for sock in conns:
            sock.close()
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
            while True:  # the backlog of dead connections is worked through first
                try:
                    assert (await c.get("/")).text == "ok"
                    break
                except httpx.TransportError:
                    assert time.monotonic() - t0 < 10.0
                    await anyio.sleep(0.2)
        assert proc.poll() is None
        assert err.stat().st_size < 16 * 1024, err.read_text()[:2000]
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


async def test_flood_filter_lets_one_line_per_interval_through():
    logger = logging.getLogger("test.flood")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, flood = Keep(), FloodFilter(interval=60)
    logger.addHandler(handler)
    logger.addFilter(flood)
    logger.propagate = False
    try:
        for _ in range(10_000):
            logger.error("socket.accept() out of system resource")
        logger.error("another message")
        assert records == ["socket.accept() out of system resource", "another message"]
        flood._last["socket.accept() out of system resource"] = (-1e9, 9999)  # the interval passed
        logger.error("socket.accept() out of system resource")
        assert records[-1].endswith("(9999 similar lines swallowed)")
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(flood)


@pytest.mark.slow
@pytest.mark.alone  # asserts wall-clock bounds
async def test_serve_passes_the_limits_to_its_frontend_processes(alone_from_here):
    """``enginecore serve --http ... --max-body-bytes --header-timeout``: the frontend process
    (over its EngineClient) enforces them."""
    from http_helpers import ServeProcess

    sp = ServeProcess(extra=("--max-body-bytes", "4096", "--header-timeout", "1"))
    try:
        await sp.wait_ready(1)
        await anyio.to_thread.run_sync(alone_from_here)  # (the server's start: beside others)
        async with sp.http() as c:
            r = await c.post("/v1/completions", json={"prompt": "x" * 5000})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_k": 2**63})
            assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text  # the chat template, rendered off the loop
        with socket.create_connection(("127.0.0.1", sp.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            t0 = time.monotonic()
            sock.settimeout(5)
            assert await anyio.to_thread.run_sync(sock.recv, 10) == b""
            assert time.monotonic() - t0 < 3.0
    finally:
        sp.cleanup()
