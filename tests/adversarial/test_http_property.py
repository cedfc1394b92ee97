"""Property: whatever JSON values a client puts in the sampling fields, the HTTP
frontend answers a typed, OpenAI-shaped 4xx or serves the request -- never a 5xx -- and the
engine keeps SERVING. The app runs in process over a real AsyncEngine (random:tiny-llama) on
a background event loop; hypothesis drives it over real HTTP."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import anyio
import anyio.from_thread
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
from http_helpers import served  # noqa: E402

from states import State  # noqa: E402

FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "n", "stream", "stream_options", "min_tokens", "ignore_eos", "stop_token_ids",
          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
          "best_of", "echo", "user", "model", "prompt", "messages", "response_format"]
EDGES = [0, 1, -1, 2, 16, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 0.5, 1e308,
         -0.0, 1e-320, "", "a", "stop", "yes", True, False, None]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(EDGES))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from(["include_usage", "role", "content", "type", "text", "x"]) | st.text(max_size=6),
        inner, max_size=4),
    max_leaves=12)
fields = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)


@pytest.fixture(scope="module")
def server():
    """The app over an AsyncEngine, served on a loop of its own (a blocking portal)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(served()) as s:
            yield s
    torch.set_num_threads(threads)


def check(r_status: int, body: bytes, stream: bool) -> None:
    assert r_status < 500, (r_status, body[:500])
    if r_status == 200:
        if not stream:
            assert json.loads(body)["choices"], body[:500]
        return
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] in ("invalid_request_error", "rate_limit_error"), err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert isinstance(err["message"], str) and err["message"], err


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(chat=st.booleans(), extra=fields)
def test_arbitrary_sampling_values_get_a_typed_4xx_or_are_served(server, chat, extra):
    base = ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} if chat
            else {"prompt": "hi", "max_tokens": 4})
    content = json.dumps({**base, **extra}).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    timeout = httpx.Timeout(10.0, read=3.0)
    with httpx.Client(base_url=server.base_url, timeout=timeout) as c:
        try:
            with c.stream("POST", path, content=content,
                          headers={"content-type": "application/json"}) as r:
                stream = r.headers.get("content-type", "").startswith("text/event-stream")
                if stream:  # read the first event only: a valid huge max_tokens runs long
                    first = next(r.iter_lines(), "")
                    assert r.status_code == 200 and first.startswith("data: "), first
                else:
                    check(r.status_code, r.read(), stream=False)
        except httpx.ReadTimeout:
            pass  # accepted and still generating (e.g. max_tokens 2**31 - 1): served
    assert server.engine.state is State.SERVING


def test_after_the_storm_the_engine_is_idle_and_serving(server):
    """The requests left early (streams, timeouts) were aborted in the engine."""
    deadline = time.monotonic() + 20
    while True:
        h = server.engine.health_nowait()
        if h.running == 0 and h.waiting == 0:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    assert server.engine.state is State.SERVING
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        assert c.get("/health").status_code == 200
