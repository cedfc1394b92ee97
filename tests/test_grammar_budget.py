"""The per-step grammar budget (``engine/structured/budget.py``, ``EngineConfig.grammar_row_budget_ms``):
a request whose grammar work grows with its output (an ambiguous grammar: each accepted
character leaves xgrammar's parser with more states) is ended with finish_reason "error" and a
reason naming the budget, exactly once, on every path the work runs on -- the synchronous step
(fill on the step thread, accept in the update), a late step (accept batched then row by row,
fill on the helper thread) and the grammar worker (C++) -- while the other requests, constrained
or not, get exactly the tokens they get without it.

On the byte vocabulary of ``random:tiny-llama`` this grammar's accept costs ~2 ms of CPU by its
100th letter and ~20 ms by its 200th (measured), against ~20 us for the other grammars here: a
2 ms budget ends it after a hundred-odd tokens and leaves the others two orders of magnitude
below it, whatever the machine's load (the budget counts CPU time, not wall time).
"""

from __future__ import annotations

import anyio
import pytest
from test_overlap_structured import REGEX, SCHEMA, _order

from engine import StructuredOutputs
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner
from engine.structured import native
from engine.structured.budget import GrammarBudget
from engine.structured.grammars import GrammarService

TINY = "random:tiny-llama"  # byte tokenizer: a byte is a token
# ambiguous (``s s``), and only letters allowed for its first 300 tokens (no logit_bias needed,
# which would keep its steps from overlapping: logits processing)
AMBIGUOUS = StructuredOutputs(grammar='root ::= s [a-z]{300} "!"\ns ::= "" | s s | [a-z]\n')

ORDERS = ["sync", "apply-first", "sample-first", "apply-first-beside", "sample-first-beside"]


def _core(order: str, budget_ms: float) -> EngineCore:
    r = ModelRunner(EngineConfig(model=TINY, device="cpu", dtype="float32",
                                 overlap_scheduling=order != "sync", max_num_seqs=8, seed=3,
                                 grammar_row_budget_ms=budget_ms))
    r.load()
    core = EngineCore(r, check_integrity=True)
    if order != "sync":
        _order(core, order)
    return core


def _requests(attacker: bool):
    reqs = [("regex", [65, 66, 67], SamplingParams(max_tokens=60, structured=REGEX)),
            ("json", [70, 71], SamplingParams(max_tokens=60, structured=SCHEMA)),
            ("free", [72, 73, 74, 75], SamplingParams(max_tokens=150, temperature=0.8, seed=1))]
    if attacker:
        reqs.append(("attacker", [80, 81], SamplingParams(max_tokens=290,
                                                          structured=AMBIGUOUS)))
    return reqs


_COMPILED: dict = {}  # model -> {key: compiled grammar}: compiled once a test process


def _run(core: EngineCore, reqs):
    model = core.runner.config.model
    if model not in _COMPILED:  # (a compile pool's worker process costs ~3 s to start)
        svc = GrammarService(lambda: core.tokenizer, lambda: core.runner.model_config.vocab_size)

        async def compile_all():
            return {c.key: await svc.compiled(c) for c in (REGEX, SCHEMA, AMBIGUOUS)}

        try:
            _COMPILED[model] = anyio.run(compile_all)
        finally:
            svc.close()
    grammars = _COMPILED[model]
    for rid, prompt, params in reqs:
        c = params.structured
        core.add_request(rid, prompt, params, grammars[c.key] if c is not None else None)
    tokens: dict[str, list[int]] = {}
    final: dict[str, tuple] = {}
    while core.has_work():
        for o in core.step():
            assert o.request_id not in final, f"{o.request_id}: output after its terminal one"
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                final[o.request_id] = (o.finish_reason, o.reason)
    assert not core.requests and core.scheduler.check_integrity() is None
    assert core.blocks.num_free == core.blocks.num_blocks
    assert not core.runner.grammar_budget.pending  # nothing left in the ledger
    ended = core.runner.grammar_budget.ended
    # the path the grammar work took: late steps (overlapped), on the worker ("-beside")
    ended = (ended, core.late_sampled_steps > 0, core.grammar_jobs > 0)
    core.runner.shutdown()
    return tokens, final, ended


def _skip_without_worker(order: str) -> None:
    if order.endswith("-beside") and native.worker_module() is None:
        pytest.skip("no grammar worker (no C++ compiler)")


@pytest.mark.parametrize("order", ORDERS)
def test_a_grammar_over_the_budget_ends_its_request_alone(order):
    _skip_without_worker(order)
    quiet_tokens, quiet_final, _ = _run(_core(order, 2.0), _requests(False))
    tokens, final, ended = _run(_core(order, 2.0), _requests(True))
    kind, reason = final["attacker"]
    assert kind == "error", final["attacker"]
    assert "grammar_row_budget_ms" in reason and "2 ms" in reason, reason
    assert ended == (1, order != "sync", order.endswith("-beside")), ended
    # what it took before it was ended is valid output: lowercase letters only
    got = bytes(tokens["attacker"]).decode()
    assert got.isalpha() and got.islower() and 20 < len(got) < 290, got
    # the others: exactly their tokens and endings without the attacker
    del tokens["attacker"], final["attacker"]
    assert (tokens, final) == (quiet_tokens, quiet_final)


@pytest.mark.parametrize("order", ["sync", "apply-first-beside"])
def test_no_budget_lets_the_grammar_run(order):
    """``grammar_row_budget_ms=0``: nothing is timed, the same request runs to its length."""
    _skip_without_worker(order)
    reqs = [r if r[0] != "attacker" else ("attacker", r[1], SamplingParams(
        max_tokens=120, structured=AMBIGUOUS)) for r in _requests(True)]
    tokens, final, ended = _run(_core(order, 0.0), reqs)
    assert final["attacker"] == ("length", None) and len(tokens["attacker"]) == 120
    assert ended[0] == 0


class _Matcher:
    """A stand-in for an xgrammar matcher whose fill and accept burn ``cost`` CPU seconds."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.stop_token_ids = [0]

    def _burn(self) -> None:
        import time

        end = time.thread_time() + self.cost
        while time.thread_time() < end:
            pass

    def fill_next_token_bitmask(self, host, row) -> None:
        self._burn()

    def accept_token(self, token) -> bool:
        self._burn()
        return True

    def is_terminated(self) -> bool:
        return False


def test_the_ledger_charges_rows_by_their_own_cpu_time():
    """Row by row: the slow row alone is charged (fill and accept), named with its cost;
    a verdict is given once; forget and prune drop entries; no limit times nothing."""
    budget = GrammarBudget(5.0)
    slow, fast = _Matcher(0.02), _Matcher(0.0)
    budget.fill_rows([(fast, 0, ()), (slow, 1, ()), (fast, 2, ())], None)
    assert budget.pending and budget.verdict(fast) is None
    kind, reason = budget.verdict(slow)
    assert kind == "error" and "fill" in reason and "5 ms" in reason
    assert budget.verdict(slow) is None and not budget.pending
    assert budget.advance(slow, 1) == (None, None)
    assert budget.verdict(slow)[1].startswith("structured output: the grammar's accept")
    # a batch over the limit: the next accept runs row by row (and charges the slow row)
    budget.batch(0.01, "accept")
    budget.advance_all([fast, slow], [1, 2])
    assert budget.verdict(slow) is not None and not budget.pending
    budget.advance(slow, 1)
    budget.forget(slow)
    assert not budget.pending
    budget.advance(slow, 1)

    class Req:
        matcher = fast

    budget.prune([Req()])  # the slow matcher's request is gone
    assert not budget.pending
    off = GrammarBudget(0)
    off.fill_rows([(slow, 0, ())], None)
    off.advance(slow, 1)
    assert not off.pending and not off.on


def test_a_constraint_ended_over_the_budget_is_refused_for_a_while(monkeypatch):
    """The verdict remembers the request's constraint (by its cache key); the grammar service
    then refuses the same constraint at once, names why, lets others through, and forgets it
    after REFUSE_S; at most REMEMBERED are kept."""
    from engine import BadRequestError
    from engine.structured import budget as budget_mod

    budget = GrammarBudget(5.0)
    slow = _Matcher(0.02)
    spec = StructuredOutputs(grammar='root ::= "a"')
    other = StructuredOutputs(grammar='root ::= "b"')
    budget.fill_rows([(slow, 0, ())], None)
    assert budget.verdict(slow, spec)[0] == "error"
    why = budget.refused(spec.key)
    assert why and "refused" in why and "grammar_row_budget_ms" in why
    assert budget.refused(other.key) is None
    service = GrammarService(lambda: None, lambda: 0, refused=budget.refused)
    with pytest.raises(BadRequestError, match="refused"):
        service.check(spec)
    service.check(other)
    service.close()
    now = budget_mod.time.monotonic()
    monkeypatch.setattr(budget_mod.time, "monotonic", lambda: now + budget_mod.REFUSE_S + 1)
    assert budget.refused(spec.key) is None
    monkeypatch.undo()
    for i in range(budget_mod.REMEMBERED + 5):
        budget.remember(f"k{i}", "x")
    assert budget.refused("k0") is None and budget.refused(f"k{budget_mod.REMEMBERED + 4}")
