"""Requests a web page of another origin can make. A browser sends a POST whose body is
``text/plain``, a form (urlencoded or multipart), or that has no body, to any address without a
CORS preflight; so every POST route of the app (read from its routes, the sleep-mode admin routes
included, so a new route is covered without a change here) answers such a request 415 from its
head, before the body is read, and nothing happens: no generation, no tokenization, no sleep.
The admin routes take no query parameters and need the token on loopback too when one is set;
no GET route does work or changes state; CORS is off by default and, with ``--allowed-origins``,
granted to those origins only."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import anyio
import pytest
from fastapi.routing import APIRoute

from entrypoints.http.limits import HttpLimits, add_http_limit_args, limits_from_args
from states import State

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ipc"))
from fake_engine import FakeEngine  # noqa: E402
from http_helpers import served  # noqa: E402

#: The engine's methods that do work or change its state; the app calls none of them for a
#: refused request, nor for any GET.
WORK = frozenset({"generate", "submit", "abort", "tokenize", "detokenize", "token_bytes",
                  "apply_chat_template", "sleep", "wake_up", "update_weights", "drain",
                  "shutdown", "pause", "resume", "abort_all"})
#: A body each route accepts (as JSON); a route not named here gets ``{}``.
VALID = {"/v1/completions": {"prompt": "a b", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [104, 105]},
         "/sleep": {"level": 2}, "/wake_up": {}, "/update_weights": {"path": "/ckpt"}}
ORIGIN, OTHER = "https://ui.example", "https://evil.example"


class WatchedEngine(FakeEngine):
    """The fake engine, noting each use of a method of :data:`WORK` (in ``work``)."""

    def __init__(self) -> None:
        super().__init__()
        self.work: list[str] = []

    def __getattribute__(self, name: str):
        if name in WORK:
            object.__getattribute__(self, "work").append(name)
        return object.__getattribute__(self, name)


def routes(app, method: str) -> list[str]:
    return sorted(r.path for r in app.routes if isinstance(r, APIRoute) and method in r.methods)


def cross_site(body: dict) -> list[dict]:
    """The requests a page may send anywhere without a preflight (as httpx arguments), each
    carrying the route's own JSON (a form field can spell it: ``<input name='{"prompt": ...'>``);
    and the same JSON with what no browser sends unasked but is not JSON either."""
    raw = json.dumps(body).encode()
    form = {k: json.dumps(v) for k, v in body.items()} or {"x": "1"}
    return [
        dict(content=raw, headers={"content-type": "text/plain"}),
        dict(content=raw, headers={"content-type": "text/plain;charset=UTF-8"}),
        dict(content=raw, headers={"content-type": "application/x-www-form-urlencoded"}),
        dict(data=form),  # urlencoded
        dict(files={"f": ("b.json", raw, "application/json")}, data=form),  # multipart/form-data
        dict(content=raw),  # no Content-Type
        dict(),  # no body, no Content-Type (fetch(url, {method: "POST"}))
        dict(content=raw, headers={"content-type": "text/plain; charset=application/json"}),
        dict(content=raw, headers={"content-type": "application/json-patch+json"}),
        dict(content=raw, headers=[("content-type", "application/json"),
                                   ("content-type", "text/plain")]),
    ]


@pytest.mark.asyncio
async def test_every_post_route_refuses_what_a_page_sends_cross_site_and_nothing_happens() -> None:
    fake = WatchedEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.run)
        async with served(engine=fake, sleep_mode=True) as s, s.http() as c:
            posts = routes(s.app, "POST")
            assert set(VALID) <= set(posts), posts  # the enumeration sees the routes
            fake.work.clear()
            sent = 0
            for path in posts:
                for kw in cross_site(VALID.get(path, {})):
                    r = await c.post(path, **kw)
                    got = r.request.headers.get_list("content-type")
                    assert got != ["application/json"], kw
                    assert r.status_code == 415, (path, got, r.status_code, r.text[:200])
                    err = r.json()["error"]
                    assert (err["type"], err["code"]) == ("invalid_request_error",
                                                          "unsupported_media_type"), err
                    sent += 1
            assert sent == 10 * len(posts)
            assert fake.work == [] and fake.submitted == [] and fake.calls == []
            assert fake.state is State.SERVING and fake.requests == {}
            metrics = (await c.get("/metrics")).text
            assert f'enginecore_requests_rejected_total{{reason="bad_request"}} {sent}.0' in metrics

            # The control: the same bodies as JSON (any case, any parameter) are served (the
            # admin routes last, in an order their states allow).
            admin = ["/sleep", "/update_weights", "/wake_up"]
            for path in [p for p in posts if p not in admin] + admin:
                ctype = "Application/JSON; charset=utf-8" if path == "/tokenize" else "application/json"
                r = await c.post(path, content=json.dumps(VALID.get(path, {})).encode(),
                                 headers={"content-type": ctype})
                assert r.status_code != 415, (path, r.text[:200])
                if path in ("/v1/completions", "/tokenize", *admin):
                    assert r.status_code == 200, (path, r.text[:200])
            assert {"generate", "tokenize", "sleep", "wake_up"} <= set(fake.work), fake.work
            sleeps = [c for c in fake.calls if c[0] in ("sleep", "update_weights", "wake_up")]
            assert sleeps == [("sleep", 2, "abort", None), ("update_weights", "/ckpt"),
                              ("wake_up", None)]
            assert {"pause", "resume", "abort_all"} <= {c[0] for c in fake.calls}
        tg.cancel_scope.cancel()


def _head(port: int, head: bytes) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        t0 = time.monotonic()
        sock.sendall(head)
        sock.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data, time.monotonic() - t0


@pytest.mark.asyncio
async def test_the_refusal_comes_from_the_head_before_the_body() -> None:
    """A head announcing a body (up to over the size limit) that never comes: the 415 is sent at
    once, from the head alone (the body guard would wait body_timeout, 60 s, for it)."""
    fake = WatchedEngine()
    async with served(engine=fake, sleep_mode=True) as s:
        fake.work.clear()
        for length in (1_000, 100 * 2**20):
            head = (b"POST /sleep HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-"
                    b"urlencoded\r\nContent-Length: %d\r\n\r\n" % length)
            data, took = await anyio.to_thread.run_sync(_head, s.port, head)
            assert data.startswith(b"HTTP/1.1 415"), data[:200]
            assert took < 3.0, took
        assert fake.work == [] and fake.state is State.SERVING


@pytest.mark.asyncio
async def test_admin_routes_take_no_query_parameters() -> None:
    fake = WatchedEngine()
    async with served(engine=fake, sleep_mode=True) as s, s.http() as c:
        fake.work.clear()
        for url, body in (("/sleep?level=2", {}), ("/sleep?level=2", {"level": 2}),
                          ("/wake_up?tags=weights", {}), ("/update_weights?path=/ckpt", {}),
                          ("/sleep?=1", {}), ("/sleep?mode", {})):
            r = await c.post(url, json=body)
            assert r.status_code == 400, (url, r.text)
            err = r.json()["error"]
            assert "query" in err["message"] and err["type"] == "invalid_request_error", err
            name = url.split("?")[1].split("=")[0]
            assert err["param"] == (name or None), err
        assert fake.work == [] and fake.state is State.SERVING
        r = await c.post("/sleep", json={"level": 2})  # the same as a JSON body
        assert r.status_code == 200 and fake.calls == [("sleep", 2, "abort", None)], r.text


@pytest.mark.asyncio
async def test_admin_token_is_required_on_loopback_too() -> None:
    fake = WatchedEngine()
    async with served(engine=fake, sleep_mode=True, admin_token="s3cret-t0ken") as s, s.http() as c:
        assert s.base_url.startswith("http://127.0.0.1:")
        fake.work.clear()
        for path in ("/sleep", "/wake_up", "/update_weights"):
            r = await c.post(path, json=VALID[path])
            assert r.status_code == 401, (path, r.text)
        assert (await c.get("/is_sleeping")).status_code == 401
        assert fake.work == [] and fake.state is State.SERVING
        good = {"Authorization": "Bearer s3cret-t0ken"}
        assert (await c.post("/sleep", json={}, headers=good)).status_code == 200
        assert fake.state is State.SLEEPING


@pytest.mark.asyncio
async def test_no_get_route_does_work_or_changes_state() -> None:
    fake = WatchedEngine()
    async with served(engine=fake, sleep_mode=True) as s, s.http() as c:
        gets = routes(s.app, "GET")
        assert {"/health", "/ready", "/metrics", "/v1/models", "/is_sleeping"} <= set(gets), gets
        fake.work.clear()
        for path in gets:
            for query in ("", "?level=2&tags=weights&path=/ckpt&prompt=hi"):
                r = await c.get(path + query)
                assert r.status_code == 200, (path, r.text[:200])
        assert fake.work == [] and fake.calls == [] and fake.state is State.SERVING


PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def _cors_headers(r) -> dict:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


@pytest.mark.asyncio
async def test_cors_is_off_by_default() -> None:
    async with served(engine=FakeEngine(), sleep_mode=True) as s, s.http() as c:
        for origin in (ORIGIN, OTHER, "null"):
            for path in ("/v1/completions", "/sleep", "/v1/models"):
                r = await c.options(path, headers={"Origin": origin, **PREFLIGHT})
                assert not 200 <= r.status_code < 300 and _cors_headers(r) == {}, (path, r.headers)
            r = await c.get("/v1/models", headers={"Origin": origin})
            assert r.status_code == 200 and _cors_headers(r) == {}, r.headers
            r = await c.post("/tokenize", json={"prompt": "hi"}, headers={"Origin": origin})
            assert r.status_code == 200 and _cors_headers(r) == {}, r.headers


@pytest.mark.asyncio
async def test_cors_with_allowed_origins_grants_those_only() -> None:
    limits = HttpLimits(allowed_origins=(ORIGIN,), allow_credentials=True).validate()
    async with served(engine=FakeEngine(), limits=limits, sleep_mode=True) as s, s.http() as c:
        r = await c.options("/v1/completions", headers={"Origin": ORIGIN, **PREFLIGHT})
        assert r.status_code == 200, r.text
        h = _cors_headers(r)
        assert h["access-control-allow-origin"] == ORIGIN
        assert "POST" in h["access-control-allow-methods"]
        assert h["access-control-allow-headers"] == PREFLIGHT["Access-Control-Request-Headers"]
        assert h["access-control-allow-credentials"] == "true"
        for origin in (OTHER, "null", ORIGIN + ":8443", "http://ui.example"):
            r = await c.options("/v1/completions", headers={"Origin": origin, **PREFLIGHT})
            assert r.status_code == 400 and "access-control-allow-origin" not in r.headers, origin
            r = await c.get("/v1/models", headers={"Origin": origin})
            assert "access-control-allow-origin" not in r.headers, origin
        r = await c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.headers["access-control-allow-origin"] == ORIGIN
        # the guards' refusals reach the allowed page readable, and still refuse
        r = await c.post("/sleep", content=b"{}", headers={"Origin": ORIGIN, "content-type": "text/plain"})
        assert r.status_code == 415 and r.headers["access-control-allow-origin"] == ORIGIN


def _parse(*argv: str) -> HttpLimits:
    p = argparse.ArgumentParser()
    add_http_limit_args(p)
    return limits_from_args(p.parse_args(list(argv)))


def test_cors_flags_as_vllm_spells_them_and_through_to_a_frontend() -> None:
    assert not _parse().cors and _parse().allowed_origins == ()
    a = _parse("--allowed-origins", '["https://ui.example", "http://localhost:3000"]',
               "--allowed-methods", '["GET", "POST"]', "--allowed-headers", "authorization,content-type",
               "--allow-credentials")
    assert a.allowed_origins == ("https://ui.example", "http://localhost:3000") and a.cors
    assert (a.allowed_methods, a.allowed_headers) == (("GET", "POST"), ("authorization", "content-type"))
    assert a.allow_credentials is True
    assert _parse(*a.to_argv()) == a  # a frontend process gets the same policy
    assert _parse(*HttpLimits().to_argv()) == HttpLimits()
    assert _parse("--allowed-origins", "https://a.example, http://[::1]:8080").allowed_origins == (
        "https://a.example", "http://[::1]:8080")
    for bad in (["--allowed-origins", "https://ui.example/"], ["--allowed-origins", "null"],
                ["--allowed-origins", "HTTPS://UI.EXAMPLE"], ["--allowed-origins", "ui.example"],
                ["--allowed-origins", "*", "--allow-credentials"],
                ["--allowed-origins", "*", "--allowed-headers", "x y"]):
        with pytest.raises(ValueError):
            _parse(*bad)
    with pytest.raises(SystemExit):
        _parse("--allowed-origins", '["https://a.example", 5]')
