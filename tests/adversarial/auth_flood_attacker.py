"""The attacker of test_auth_flood.py, in a process of its own (as a real one would be, and so
that its threads do not share the victim's GIL): ``THREADS`` threads send wrong tokens for
``SECONDS`` seconds, one attempt after another, and print what they got as one JSON object.

    python -m tests.adversarial.auth_flood_attacker ipc HOST PORT THREADS SECONDS
    python -m tests.adversarial.auth_flood_attacker http HOST PORT THREADS SECONDS

``ipc``: a fresh connection per attempt, a Hello with a wrong token, the engine's first frame
read. ``http``: ``POST /sleep`` with a wrong Bearer token over a kept-alive connection.
Outcomes: ``wrong`` (401 / "missing or wrong token"), ``later`` (429 / "try later"),
``admitted`` (a Welcome or a 200: must never happen), ``other`` (anything else, with a sample).
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import sys
import threading
import time

from ipc.framing import FrameCodec
from ipc.messages import PROTOCOL_VERSION, EngineMessage, Error, Hello, Welcome

WRONG = "wrong-token-" + "y" * 20


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def ipc_attempt(host: str, port: int, hello: bytes) -> str:
    codec = FrameCodec(EngineMessage)
    with socket.create_connection((host, port), timeout=20) as sock:
        sock.sendall(hello)
        size = struct.unpack(">I", _recv_exact(sock, 4))[0]
        msg = codec.decode(_recv_exact(sock, size))
    if isinstance(msg, Welcome):
        return "admitted"
    if isinstance(msg, Error) and "try later" in msg.message:
        return "later"
    if isinstance(msg, Error) and msg.message == "missing or wrong token":
        return "wrong"
    return f"other: {msg!r}"[:200]


class HttpAttempts:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.conn = None

    def __call__(self) -> str:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=20)
        try:
            self.conn.request("POST", "/sleep", body=b"{}", headers={
                "Authorization": f"Bearer {WRONG}", "Content-Type": "application/json"})
            r = self.conn.getresponse()
            r.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = None
            raise
        if r.status == 429 and not r.getheader("Retry-After", "").isdigit():
            return "other: 429 without Retry-After"
        return {401: "wrong", 429: "later", 200: "admitted"}.get(r.status, f"other: {r.status}")


def main() -> None:
    kind, host, port, threads, seconds = sys.argv[1:6]
    port, threads, seconds = int(port), int(threads), float(seconds)
    hello = FrameCodec().encode(Hello(protocol_version=PROTOCOL_VERSION, token=WRONG,
                                      client_name="attacker"))
    lock = threading.Lock()
    outcomes: dict[str, list[float]] = {}
    samples: list[str] = []
    end = time.monotonic() + seconds

    def worker() -> None:
        attempt = HttpAttempts(host, port) if kind == "http" else (lambda: ipc_attempt(host, port, hello))
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                what = attempt()
            except (OSError, ConnectionError, http.client.HTTPException) as exc:
                what = f"other: {type(exc).__name__}: {exc}"[:200]
            dt = time.monotonic() - t0
            key = what if not what.startswith("other") else "other"
            with lock:
                outcomes.setdefault(key, []).append(dt)
                if key == "other" and len(samples) < 5:
                    samples.append(what)

    t0 = time.monotonic()
    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    wall = time.monotonic() - t0
    stats = {k: {"n": len(v), "min": min(v), "median": sorted(v)[len(v) // 2], "max": max(v)}
             for k, v in outcomes.items()}
    print(json.dumps({"wall": wall, "attempts": sum(len(v) for v in outcomes.values()),
                      "outcomes": stats, "samples": samples}))


if __name__ == "__main__":
    main()
