"""The ``Host`` allow-list against DNS rebinding (entrypoints/http/hosts.py): a page whose own name
is made to resolve to 127.0.0.1 reaches a loopback server with its name in ``Host``. Bound to
loopback the server answers only its own names (every route, from the head, nothing done);
bound to 0.0.0.0 it answers any name unless ``--allowed-hosts`` names them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio
import pytest

from entrypoints.http.hosts import HostPolicy, check_allowed_host, host_of, is_loopback
from entrypoints.http.limits import HttpLimits, add_http_limit_args, limits_from_args
from states import State

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ipc"))
from http_helpers import ServeProcess, served  # noqa: E402
from test_http_origin import VALID, WatchedEngine, routes  # noqa: E402

EVIL = "evil.example"


@pytest.mark.parametrize("header,host", [
    (b"localhost", "localhost"), (b"LocalHost:8000", "localhost"), (b"localhost.:80", "localhost"),
    (b"127.0.0.1:8000", "127.0.0.1"), (b"[::1]:8000", "::1"), (b"[::1]", "::1"),
    (b"[0:0:0:0:0:0:0:1]:1", "::1"), (b"api.example.com", "api.example.com"),
    (b"a.localhost:9", "a.localhost"), (b"10.0.0.7", "10.0.0.7"),
    # not hosts
    (b"", None), (b"evil.example:80x", None), (b"[::1", None), (b"[::1]x", None),
    (b"[127.0.0.1]:80", None), (b"a b", None), (b"*.example.com", None), (b"\xffx", None),
    (b"evil.example:123456", None), (b"a@evil.example", None),
])
def test_host_header_parsing(header, host):
    assert host_of(header) == host


def test_loopback_names_and_addresses():
    for h in ("localhost", "x.localhost", "127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(h), h
    for h in ("localhost.evil.example", "10.0.0.1", "0.0.0.0", "::", "evil.example", "localhostx"):
        assert not is_loopback(h), h


def test_policy_is_on_when_bound_to_loopback_or_given_names():
    loop = HostPolicy((), "127.0.0.1")
    assert loop.on and loop.allows("localhost") and loop.allows("::1")
    assert not loop.allows(EVIL) and not loop.allows("10.0.0.7")
    assert HostPolicy((), "::1").on
    for bound in ("0.0.0.0", "::", "10.0.0.7", None):  # a load balancer's names: any
        p = HostPolicy((), bound)
        assert not p.on and p.allows(EVIL), bound
    named = HostPolicy(("API.example", "*.corp.example", "10.1.2.3"), "0.0.0.0")
    assert named.on
    for h in ("api.example", "x.corp.example", "a.b.corp.example", "10.1.2.3", "localhost",
              "127.0.0.1"):
        assert named.allows(h), h
    for h in (EVIL, "corp.example", "xcorp.example", "api.example.evil.example", "10.0.0.7"):
        assert not named.allows(h), h
    bound = HostPolicy(("api.example",), "192.168.1.5")  # the bound address itself is allowed
    assert bound.allows("192.168.1.5") and not bound.allows("192.168.1.6")
    assert not HostPolicy(("*",), "127.0.0.1").on  # "*": the check off


def test_allowed_hosts_flag():
    ap = argparse.ArgumentParser()
    add_http_limit_args(ap)
    assert limits_from_args(ap.parse_args([])).allowed_hosts == ()
    for text in ('["api.example", "*.corp.example"]', "api.example,*.corp.example"):
        got = limits_from_args(ap.parse_args(["--allowed-hosts", text]))
        assert got.allowed_hosts == ("api.example", "*.corp.example")
        assert "--allowed-hosts" in got.to_argv()
    for bad in ("api.example:8000", "http://api.example", "a..b", "*", "evil.*", "a/b", "-"):
        if bad == "*":
            assert check_allowed_host(bad) == "*"
            continue
        with pytest.raises(ValueError, match="allowed-hosts"):
            limits_from_args(ap.parse_args(["--allowed-hosts", bad]))
    assert check_allowed_host("[::1]") == "::1" and check_allowed_host("Api.Example.") == "api.example"


@pytest.mark.asyncio
async def test_bound_to_loopback_every_route_refuses_another_name_and_nothing_happens() -> None:
    fake = WatchedEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.run)
        async with served(engine=fake, sleep_mode=True, bound="127.0.0.1") as s, s.http() as c:
            fake.work.clear()
            paths = [("POST", p) for p in routes(s.app, "POST")] + \
                    [("GET", p) for p in routes(s.app, "GET")]
            assert ("POST", "/v1/completions") in paths and ("GET", "/metrics") in paths
            for method, path in paths:
                for host in (f"{EVIL}:{s.port}", EVIL, f"localhost.{EVIL}", "10.0.0.7"):
                    r = await c.request(method, path, json=VALID.get(path, {}),
                                        headers={"host": host})
                    assert r.status_code == 400, (method, path, host, r.status_code, r.text[:200])
                    err = r.json()["error"]
                    assert err["code"] == "invalid_host" and "Host" in err["message"], err
            assert fake.work == [] and fake.submitted == [] and fake.calls == []
            assert fake.state is State.SERVING
            # this machine's own names are served (the port is not compared)
            for host in (f"localhost:{s.port}", "127.0.0.1", f"[::1]:{s.port}", "ui.localhost"):
                r = await c.post("/v1/completions", json=VALID["/v1/completions"],
                                 headers={"host": host})
                assert r.status_code == 200, (host, r.text[:200])
            assert len(fake.submitted) == 4
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_bound_to_any_address_any_name_unless_allowed_hosts() -> None:
    fake = WatchedEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.run)
        async with served(engine=fake, bound="0.0.0.0") as s, s.http() as c:
            r = await c.post("/v1/completions", json=VALID["/v1/completions"],
                             headers={"host": "api.lb.example"})
            assert r.status_code == 200, r.text
        limits = HttpLimits(allowed_hosts=("api.example", "*.corp.example"))
        async with served(engine=fake, bound="0.0.0.0", limits=limits) as s, s.http() as c:
            for host, status in (("api.example", 200), ("a.corp.example", 200), ("localhost", 200),
                                 (EVIL, 400), ("corp.example", 400)):
                r = await c.get("/v1/models", headers={"host": host})
                assert r.status_code == status, (host, r.text[:200])
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_serve_process_bound_to_loopback_refuses_a_rebinding_host() -> None:
    """Through ``enginecore serve --http 127.0.0.1:PORT``: the frontend process knows its
    socket's address; ``--allowed-hosts`` reaches it."""
    sp = ServeProcess(extra=("--allowed-hosts", "api.example"))
    try:
        await sp.wait_ready(1)
        async with sp.http() as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            r = await c.post("/v1/completions", json=body, headers={"host": f"{EVIL}:{sp.port}"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", r.text
            for host in (f"localhost:{sp.port}", "api.example"):
                r = await c.post("/v1/completions", json=body, headers={"host": host})
                assert r.status_code == 200, (host, r.text)
            metrics = (await c.get("/metrics")).text
            assert 'enginecore_requests_rejected_total{reason="bad_request"} 1.0' in metrics
    finally:
        sp.cleanup()
