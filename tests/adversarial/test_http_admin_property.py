"""Property: whatever a client puts in the sleep-mode admin endpoints' parameters --
JSON values of any type in the body, any query string (never taken: always a 400) -- the
answer is 200, a typed OpenAI-shaped 400/409, never a 5xx; the engine stays SERVING or SLEEPING and wakes after it.
The app serves an ``ipc.EngineClient`` (as a frontend process does) over an in-process IPC
server and a real AsyncEngine (random:tiny-llama), so every call also crosses the wire."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import urlencode

import anyio.from_thread
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
from http_helpers import served  # noqa: E402

from states import State  # noqa: E402

EDGES = [0, 1, 2, 3, -1, 1.0, 2**63, 1e9, 1e10, -0.0, "", "1", "2", "abort", "wait", "weights",
         "kv_cache", ["weights"], ["kv_cache", "weights"], ["gpu"], [], "/", ".", "/nonexistent",
         "random:tiny-llama", "\x00", "\ud800", "x" * 5000, True, False, None]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.sampled_from(EDGES))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
KEYS = ["level", "mode", "timeout", "tags", "path", "x"]
bodies = st.one_of(st.dictionaries(st.sampled_from(KEYS), values, max_size=4), values)
queries = st.lists(st.tuples(st.sampled_from(KEYS), st.text(max_size=6) | st.sampled_from(
    ["1", "2", "7", "wait", "abort", "weights", "kv_cache", "nan", "inf", "-1", "1e99"])), max_size=3)
ROUTES = ["/sleep", "/wake_up", "/update_weights"]


@pytest.fixture(scope="module")
def server():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(served(via="client", sleep_mode=True)) as s:
            yield s
    torch.set_num_threads(threads)


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(asleep=st.booleans(), route=st.sampled_from(ROUTES), body=bodies, query=queries,
       as_json=st.booleans())
def test_arbitrary_admin_parameters_get_200_or_a_typed_4xx(server, asleep, route, body, query, as_json):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        if asleep:
            assert c.post("/sleep", json={}).status_code == 200
        url = route + ("?" + urlencode(query) if query else "")
        content = json.dumps(body).encode() if as_json else repr(body).encode("utf-8", "replace")
        r = c.post(url, content=content, headers={"content-type": "application/json"})
        assert r.status_code in ((400,) if query else (200, 400, 409)), (r.status_code, r.text[:500])
        if r.status_code != 200:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error" and err["message"], err
        assert server.engine.state in (State.SERVING, State.SLEEPING)
        assert c.get("/is_sleeping").json() == {"is_sleeping": server.engine.state is State.SLEEPING}
        if server.engine.state is State.SLEEPING:
            r = c.post("/wake_up", json={})
            assert r.status_code == 200 and r.json()["state"] == "serving", r.text
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.text
