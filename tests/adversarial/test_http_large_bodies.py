"""Large request bodies wait for a slot (``body_gate.LargeBodyGate``, in ``guards.BodyGuard``):
one that has none is not read -- its sender's writes block (TCP pushes back) and the server
holds no more of it -- small requests pass meanwhile, and a wait past ``body_timeout`` is
answered (503 with a length, 408 for a chunked one, whose wait counts in its body's time) and
the connection closed. Both HTTP parsers."""

from __future__ import annotations

import importlib.util
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
from http_helpers import served  # noqa: E402

from entrypoints.http.limits import HttpLimits  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("torch_one_thread")]
MiB = 2**20
IMPLS = pytest.mark.parametrize("impl", ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    importlib.util.find_spec("httptools") is None, reason="httptools not installed"))])
WAIT_S = 2.0  # body_timeout: the longest wait for a slot


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Upload(threading.Thread):
    """POSTs ``total`` bytes (with a ``Content-Length``, or chunked), counting what the kernel
    took (``sent``), until the server answers or closes; ``answer``: what it sent back."""

    def __init__(self, port: int, total: int, chunked: bool = False) -> None:
        super().__init__(daemon=True)
        self.port, self.total, self.chunked = port, total, chunked
        self.sent = 0
        self.answer = b""
        self.closed = False  # the server closed the connection after its answer

    def run(self) -> None:
        framing = b"Transfer-Encoding: chunked" if self.chunked else b"Content-Length: %d" % self.total
        piece = b"[" * (64 * 1024)
        if self.chunked:
            piece = b"%x\r\n" % len(piece) + piece + b"\r\n"
        with socket.create_connection(("127.0.0.1", self.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\n" + framing + b"\r\n\r\n")
            sock.setblocking(False)
            view = memoryview(piece)
            try:
                while self.sent < self.total:
                    readable, writable, _ = select.select([sock], [sock], [], 0.05)
                    if readable:
                        break
                    if writable:
                        n = sock.send(view[(self.sent % len(piece)):])
                        self.sent += n
            except OSError:
                pass
            sock.setblocking(True)
            sock.settimeout(5)
            try:
                while chunk := sock.recv(65536):
                    self.answer += chunk
                self.closed = True
            except ConnectionResetError:
                self.closed = True
            except OSError:
                pass


@IMPLS
async def test_a_large_body_without_a_slot_is_not_read_small_requests_pass_and_the_wait_ends(impl):
    # one slot, paced so slowly that after one large body no other starts within the test
    limits = HttpLimits(http_impl=impl, large_body_slots=1, large_body_cpu_share=1e-4,
                        body_timeout=WAIT_S, max_body_bytes=64 * MiB)
    async with served(limits=limits) as s, s.http() as c:
        gate = s.app.state.large_bodies
        small = {"prompt": "hi", "max_tokens": 2}
        big = {"prompt": "a" * (300 * 1024), "max_tokens": "many"}  # over 256 KiB: a slot
        r = await c.post("/v1/completions", json=big)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert gate.granted == 1 and gate.free == 1  # given back, its cost paced far ahead

        before = rss()
        t0 = time.monotonic()
        uploads = [Upload(s.port, 48 * MiB), Upload(s.port, 48 * MiB, chunked=True)]
        for u in uploads:
            u.start()
        with anyio.fail_after(WAIT_S / 2):
            while gate.waiting < 2:
                await anyio.sleep(0.01)
        await anyio.sleep(0.3)
        held = [u.sent for u in uploads]
        await anyio.sleep(0.3)
        # the senders are stuck: the kernel's buffers are full and the server reads no more
        assert [u.sent for u in uploads] == held, (held, [u.sent for u in uploads])
        print(f"\n{impl}: held by the kernel {[n / MiB for n in held]} MiB, RSS +{(rss() - before) / MiB:.1f} MiB")
        assert all(n < 8 * MiB for n in held), held
        assert rss() - before < 8 * MiB, (rss() - before) / MiB
        # a small request never waits for a slot
        r = await c.post("/v1/completions", json=small)
        assert r.status_code == 200 and gate.waiting == 2
        assert all(u.is_alive() and not u.answer for u in uploads)

        await anyio.to_thread.run_sync(lambda: [u.join(WAIT_S + 10) for u in uploads])
        waited = time.monotonic() - t0
        assert WAIT_S - 0.2 < waited < WAIT_S + 5, waited
        sized, chunked = uploads
        assert sized.answer.startswith(b"HTTP/1.1 503"), sized.answer[:200]
        assert b'"code":"server_busy"' in sized.answer and b"connection: close" in sized.answer
        assert chunked.answer.startswith(b"HTTP/1.1 408"), chunked.answer[:200]
        assert sized.closed and chunked.closed
        assert gate.waiting == 0 and gate.granted == 1
        assert (await c.post("/v1/completions", json=small)).status_code == 200
        assert (await c.get("/health")).status_code == 200
