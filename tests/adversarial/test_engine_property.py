"""Property test: whatever values a caller puts into SamplingParams, the in-process
engine refuses the request with a typed BadRequestError or serves it -- never fails."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import AsyncEngine, BadRequestError, EngineConfig, SamplingParams
from states import State

TINY = "random:tiny-llama"


_values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.lists(st.integers(min_value=-5, max_value=2**40), max_size=4),
                    st.lists(st.text(max_size=4), max_size=3))
_fields = st.fixed_dictionaries({}, optional={
    f: _values for f in ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                         "stop_token_ids", "ignore_eos", "logprobs", "min_tokens")})


@pytest.fixture(scope="module")
def shared_engine():
    """One engine, driven from a portal, for the property test's many examples."""
    from anyio.from_thread import start_blocking_portal

    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(AsyncEngine.open(EngineConfig(model=TINY))) as eng:
            yield portal, eng


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=_fields)
def test_property_any_params_are_refused_or_served_in_process(shared_engine, fields) -> None:
    portal, eng = shared_engine
    fields = {**fields, "max_tokens": fields.get("max_tokens", 3)}
    if type(fields["max_tokens"]) is int and fields["max_tokens"] > 8:
        fields["max_tokens"] = 8  # keep served examples short

    async def go():
        try:
            params = SamplingParams(**fields)
            stream = eng.generate([5, 6, 7], params)
        except BadRequestError:
            return "refused"
        async for out in stream:
            pass
        assert out.finished
        return out.finish_reason

    result = portal.call(go)
    assert result in ("refused", "stop", "length")
    assert eng.state is State.SERVING
