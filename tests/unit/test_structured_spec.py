"""StructuredOutputs at the boundary (exactly one constraint, bounded), on the wire, and the
grammar cache's bounds -- no model, no grammar engine."""

from __future__ import annotations

import msgspec
import pytest

from engine.errors import BadRequestError, EngineOverloadedError
from engine.params import SamplingParams
from engine.structured.grammars import GrammarCache
from engine.structured.spec import MAX_CHOICES, MAX_PATTERN_CHARS, MAX_SCHEMA_CHARS, StructuredOutputs


@pytest.mark.parametrize("kw", [
    dict(json_schema={"type": "object"}), dict(json_schema='{"type": "integer"}'),
    dict(json_object=True), dict(regex=r"\d+"), dict(choice=["a", "b"]),
    dict(grammar='root ::= "x"'),
])
def test_one_constraint_is_valid_and_travels(kw):
    p = SamplingParams(structured=StructuredOutputs(**kw)).validate()
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams).validate()
    assert wire == p and wire.structured.key == p.structured.key
    assert isinstance(wire.structured.json_schema, (str, type(None)))


@pytest.mark.parametrize("kw, match", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(json_schema="{}", json_object=True), "exactly one"),
    (dict(json_schema="x" * (MAX_SCHEMA_CHARS + 1)), "json_schema"),
    (dict(regex="a" * (MAX_PATTERN_CHARS + 1)), "regex"),
    (dict(grammar=""), "grammar"),
    (dict(choice=[]), "choice"),
    (dict(choice=["a"] * (MAX_CHOICES + 1)), "choice"),
    (dict(choice=["x" * 1025]), "choice"),
    (dict(choice=[1]), "choice"),
    (dict(regex=5), "regex"),
    (dict(json_object=1), "json_object"),
])
def test_bad_constraints_are_refused(kw, match):
    with pytest.raises(BadRequestError, match=match):
        SamplingParams(structured=StructuredOutputs(**kw)).validate()


def test_schema_dict_is_text_and_bounded():
    deep: dict = {}
    d = deep
    for _ in range(200):
        d["items"] = {}
        d = d["items"]
    with pytest.raises(BadRequestError, match="nests deeper"):
        StructuredOutputs(json_schema=deep)
    with pytest.raises(BadRequestError, match="not JSON"):
        StructuredOutputs(json_schema={"x": object()})
    s = StructuredOutputs(json_schema={"b": 1, "a": 2})
    assert s.json_schema == '{"b":1,"a":2}'  # property order is kept: it is the output's order


def test_wire_refuses_oversize_and_unknown():
    body = msgspec.msgpack.encode({"structured": {"regex": "a" * (MAX_PATTERN_CHARS + 1)}})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(body, type=SamplingParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"structured": {"lark": "x"}}),
                               type=SamplingParams)
    with pytest.raises(msgspec.ValidationError):  # a schema object on the wire: text only
        msgspec.msgpack.decode(msgspec.msgpack.encode({"structured": {"json_schema": {}}}),
                               type=SamplingParams)


def test_constrained_requests_are_speculated():
    assert not SamplingParams(structured=StructuredOutputs(regex="a")).output_dependent_logits


def test_grammar_cache_bounds_entries_and_bytes():
    c = GrammarCache(max_entries=2, max_bytes=100)
    c.put("a", "A", 40)
    c.put("b", "B", 40)
    assert c.get("a") == "A"  # a is now the most recent
    c.put("c", "C", 40)  # over 100 bytes: the least recent (b) goes
    assert c.get("b") is None and c.get("a") == "A" and c.get("c") == "C"
    assert c.nbytes == 80 and len(c) == 2
    c.put("huge", "H", 101)  # larger than the whole cache: not kept
    assert c.get("huge") is None and len(c) == 2
    c.put("d", "D", 1)
    c.put("e", "E", 1)
    assert len(c) == 2 and c.nbytes == 2


class _FakeGrammar:
    memory_size_bytes = 10


class _FakeCompiler:
    """Stands in for xgrammar's compiler: ``regex`` "bad" fails as xgrammar does."""

    def compile_regex(self, rx: str):
        if rx == "bad":
            raise RuntimeError("[01:02:03] /project/cpp/regex_converter.cc:83: Regex parsing "
                               "error at position 1\nmore detail")
        return _FakeGrammar()


def test_a_compile_error_names_the_problem_without_xgrammar_s_source_lines():
    from engine.structured.compiler import compile_constraint

    assert isinstance(compile_constraint(_FakeCompiler(), "regex", "ok"), _FakeGrammar)
    with pytest.raises(BadRequestError, match=r"the regex constraint does not compile: Regex "
                                              r"parsing error at position 1$"):
        compile_constraint(_FakeCompiler(), "regex", "bad")
    with pytest.raises(BadRequestError, match="unknown kind"):
        compile_constraint(_FakeCompiler(), "python", "1")


class _FakePool:
    """Stands in for the compile processes: ``regex`` "slow" outlives any deadline, "bad" does
    not compile; counts the compiles it was asked for."""

    def __init__(self) -> None:
        self.calls = 0

    async def compile(self, kind: str, text: str, timeout: float, wait: float):
        import anyio

        from engine.structured.compile_pool import CompileTimeout

        self.calls += 1
        await anyio.sleep(0.05)
        if text == "slow":
            await anyio.sleep(timeout)
            raise CompileTimeout
        if text == "busy":
            from engine.structured.compile_pool import SlotTimeout

            raise SlotTimeout
        if text == "bad":
            raise BadRequestError("invalid structured output: the regex constraint does not "
                                  "compile: Regex parsing error at position 1")
        return _FakeGrammar(), 0.05

    def close(self) -> None:
        pass


def test_grammar_service_deadline_sharing_and_cache():
    import anyio

    from engine.structured import grammars

    svc = grammars.GrammarService(lambda: None, lambda: 0, compile_timeout=0.2)
    fake = svc.pool = _FakePool()

    async def main():
        c = StructuredOutputs(regex="ok")
        got = []

        async def one():
            got.append(await svc.compiled(c))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one)
        assert fake.calls == 1 and len({id(g) for g in got}) == 1  # one compile, shared
        assert svc.cached(c) is got[0] and await svc.compiled(c) is got[0]
        errors = []

        async def slow():
            try:
                await svc.compiled(StructuredOutputs(regex="slow"))
            except BadRequestError as exc:
                errors.append(str(exc))

        async with anyio.create_task_group() as tg:  # the waiter shares the first's error
            tg.start_soon(slow)
            tg.start_soon(slow)
        assert errors == ["invalid structured output: the regex constraint did not compile "
                          "within 0.2 s (too large or too complex)"] * 2 and fake.calls == 2
        with pytest.raises(BadRequestError, match=r"does not compile: Regex parsing error at "
                                                  r"position 1$"):
            await svc.compiled(StructuredOutputs(regex="bad"))
        assert svc.cached(StructuredOutputs(regex="slow")) is None
        assert svc.cached(StructuredOutputs(regex="bad")) is None  # errors are not cached
        with pytest.raises(EngineOverloadedError, match="every grammar compile worker is busy"):
            await svc.compiled(StructuredOutputs(regex="busy"))

    anyio.run(main)
