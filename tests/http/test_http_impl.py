"""``--http-impl``: which HTTP/1.1 parser a frontend runs (auto: httptools when installed, with
uvloop at the entry point; else h11), and the head-size bound on both: a head, a header or a
chunked body's trailer past ``MAX_HEAD_BYTES`` is refused (httptools has no bound of its own)."""

from __future__ import annotations

import importlib.util
import socket
import time

import anyio
import pytest

from entrypoints.http import server as server_mod
from entrypoints.http.conn_guard import MAX_HEAD_BYTES
from entrypoints.http.limits import HttpLimits, add_http_limit_args, limits_from_args
from entrypoints.http.server import (GuardedH11, event_loop_factory, make_server, protocol_class,
                                     resolve_impl)

HAVE_HTTPTOOLS = importlib.util.find_spec("httptools") is not None
IMPLS = pytest.mark.parametrize("impl", ["h11", pytest.param("httptools", marks=pytest.mark.skipif(
    not HAVE_HTTPTOOLS, reason="httptools not installed"))])


@pytest.mark.skipif(not HAVE_HTTPTOOLS, reason="httptools not installed")
def test_auto_picks_httptools_and_uvloop_when_installed():
    from entrypoints.http.httptools_guard import GuardedHttpTools

    limits = HttpLimits()
    assert limits.http_impl == "auto" and resolve_impl("auto") == "httptools"
    proto = protocol_class(limits)
    assert issubclass(proto, GuardedHttpTools) and proto.limits is limits
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        assert event_loop_factory(limits) is uvloop.new_event_loop


def test_h11_forced_runs_as_before_on_asyncio():
    limits = HttpLimits(http_impl="h11")
    proto = protocol_class(limits)
    assert issubclass(proto, GuardedH11) and proto.limits is limits
    assert event_loop_factory(limits) is None
    server = make_server(None, limits)
    assert server.config.http is not None and issubclass(server.config.http, GuardedH11)
    assert server.config.h11_max_incomplete_event_size == MAX_HEAD_BYTES


def test_without_the_wheels_auto_falls_back_to_h11(monkeypatch):
    """As on a machine whose Python has no httptools/uvloop wheels."""
    monkeypatch.setattr(server_mod, "has_module", lambda name: False)
    assert resolve_impl("auto") == "h11"
    assert issubclass(protocol_class(HttpLimits()), GuardedH11)
    assert event_loop_factory(HttpLimits()) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "httptools" else real(name, *a))
    with pytest.raises(ValueError, match="httptools package is not installed"):
        HttpLimits(http_impl="httptools").validate()
    HttpLimits(http_impl="auto").validate()


def test_the_flag_parses_checks_and_travels_to_the_frontend():
    import argparse

    p = argparse.ArgumentParser()
    add_http_limit_args(p)
    assert limits_from_args(p.parse_args([])).http_impl == "auto"
    limits = limits_from_args(p.parse_args(["--http-impl", "h11"]))
    assert limits.http_impl == "h11"
    assert limits_from_args(p.parse_args(limits.to_argv())) == limits
    with pytest.raises(SystemExit):
        p.parse_args(["--http-impl", "picohttp"])
    with pytest.raises(ValueError, match="--http-impl"):
        HttpLimits(http_impl="picohttp").validate()


# --------------------------------------------------------------------------- the head bound

async def _echo_length(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    n = 0
    while True:
        message = await receive()
        n += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(str(n))).encode())]})
    await send({"type": "http.response.body", "body": str(n).encode()})


def _exchange(port: int, first: bytes, piece: bytes = b"", pieces: int = 0) -> tuple[int, bytes]:
    """Send ``first``, then ``pieces`` x ``piece`` (a read each, more or less) until the server
    closes; returns how many pieces went out and what came back."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        sock.sendall(first)
        sent = 0
        try:
            for sent in range(1, pieces + 1):
                sock.sendall(piece)
                time.sleep(0.002)
        except OSError:
            pass
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except OSError:
            pass
        return sent, out


@IMPLS
@pytest.mark.asyncio
async def test_heads_past_the_bound_are_refused_and_smaller_ones_served(impl):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    server = make_server(_echo_length, HttpLimits(http_impl=impl, header_timeout=10.0))
    go = lambda *a: anyio.to_thread.run_sync(_exchange, port, *a)  # noqa: E731
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        with anyio.fail_after(10):
            while not server.started:
                await anyio.sleep(0.01)
        try:
            # a head just under the bound, then a body: served
            head = b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 5\r\n"
            _, out = await go(head + b"X: " + b"a" * (MAX_HEAD_BYTES - 1024) + b"\r\n\r\nhello")
            assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"\r\n\r\n5"), out[:200]
            # one endless header value, a read at a time: closed soon after the bound
            sent, out = await go(b"GET / HTTP/1.1\r\nX: ", b"a" * 1024, 400)
            assert sent < 64 and b"HTTP/1.1 200" not in out, (sent, out[:200])
            # endless small headers
            sent, out = await go(b"GET / HTTP/1.1\r\n", b"X-A: b\r\n" * 64, 400)
            assert sent < 64 and b"HTTP/1.1 200" not in out, (sent, out[:200])
            # a chunked body's endless trailer
            body = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nT: "
            sent, out = await go(body, b"a" * 1024, 400)
            assert sent < 64 and b"HTTP/1.1 200" not in out, (sent, out[:200])
            # a chunked body in many small chunks is no head: served
            many = b"".join(b"%x\r\n" % 100 + b"b" * 100 + b"\r\n" for _ in range(2000))
            _, out = await go(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              b"Transfer-Encoding: chunked\r\n\r\n" + many + b"0\r\n\r\n")
            assert out.endswith(b"\r\n\r\n200000"), out[:200]
        finally:
            server.should_exit = True
    sock.close()
