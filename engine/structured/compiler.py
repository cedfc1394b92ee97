"""One constraint compiled by xgrammar: what the compile process (``compile_worker.py``) runs for
each job. A constraint arrives as its kind and its source text (``StructuredOutputs.kind`` /
``.text``); a constraint that does not compile is a :class:`BadRequestError` naming the problem.
"""

from __future__ import annotations

import json
import logging
import re

from ..errors import BadRequestError
from .spec import KINDS

log = logging.getLogger("enginecore.structured")

#: the "[time] file.cc:line: " prefix of xgrammar's messages (not the user's business)
_SOURCE = re.compile(r"^\[[\d:.]+\] [^ ]+:\d+: ")
#: JSON as the grammar emits it: compact (no whitespace runs a small model can loop on).
_SEPARATORS = (",", ":")


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are ``choices`` (JSON string escapes are EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)


#: ``"\"" NAME{lo, hi} "\""``: a string of lo..hi characters in xgrammar's EBNF of a schema
#: (``minLength`` / ``maxLength``)
_BOUNDED = re.compile(r'"\\"" ([A-Za-z_][A-Za-z0-9_]*)\{(\d+), (\d+)\} "\\""')
#: the largest bound written out as rules (one rule a character: compiling them costs about what
#: xgrammar's own form does up to 64 -- SmolLM2, two strings: 0.94 s against 1.12 s -- and more
#: beyond: 8.4 s against 5.3 s at 256, measured)
MAX_COUNTED = 64


def count_bounded_strings(ebnf: str) -> str:
    """``ebnf`` with each bounded string ``"\"" X{lo, hi} "\""`` written as lo ``X`` then
    rules that count the characters left: ``L0 ::= "\""``, ``Lk ::= "\"" | X L(k-1)``, the
    same language (``X{0, k} Y`` is ``Y | X X{0, k-1} Y``). NOTE: xgrammar 0.2.8 fills a
    token mask inside a repetition slowly when tokens span several characters: with SmolLM2's
    vocabulary a row inside a ``maxLength`` string took ~500-750 us, and ~10-14 us counted this
    way (a string without bounds: ~9-11 us; ``python -m tools.xgrammar_costs --model default``).
    Bounds above :data:`MAX_COUNTED` and names already taken are left as they are."""
    left: dict[str, int] = {}  # rule name -> the most characters left that it counts

    def count(m: re.Match) -> str:
        x, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        if hi < lo or hi > MAX_COUNTED or f"{x}_left_" in ebnf:
            return m.group(0)
        left[x] = max(left.get(x, 0), hi - lo)
        return " ".join(['"\\""', *[x] * lo, f"{x}_left_{hi - lo}"])

    out = _BOUNDED.sub(count, ebnf)
    rules = []
    for x, n in left.items():
        rules.append(f'{x}_left_0 ::= "\\""')
        rules += [f'{x}_left_{k} ::= "\\"" | {x} {x}_left_{k - 1}' for k in range(1, n + 1)]
    return out if not rules else out + "\n" + "\n".join(rules) + "\n"


def _compile_json_schema(compiler, schema):
    """A schema's grammar, its bounded strings counted (:func:`count_bounded_strings`)."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                            separators=_SEPARATORS))
    counted = count_bounded_strings(ebnf)
    if counted != ebnf:
        try:
            return compiler.compile_grammar(counted)
        except (RuntimeError, ValueError) as exc:  # not expected: xgrammar's own form then
            log.warning("bounded strings counted, the grammar does not compile (%s); "
                        "compiling the schema as it is", str(exc).splitlines()[0][:200])
    return compiler.compile_json_schema(schema, any_whitespace=False, separators=_SEPARATORS)


# NOTE: no check for ambiguous grammars here. xgrammar 0.2.8 detects none (nothing in its API
# or its library's messages), and CFG ambiguity is undecidable in general. The one sound cheap
# check, a cyclic grammar (a rule deriving itself, A =>+ A: infinitely ambiguous, and never
# needed for a language), misses the costly cases and hits harmless ones: with SmolLM2's
# vocabulary a mask fill for ``s ::= "" | s s | [a-z]`` took over 2 s by step 13, the same
# without ``""`` (not cyclic) 2.7 s by step 20, and ``([a-z]*[a-z]*){10}`` 0.3 s by step 25,
# while ``("a"*)*``, cyclic once xgrammar writes the stars as rules, stays under 1 ms (measured).
# A grammar's per-step cost is for the step loop to bound, not for a heuristic here.


def compile_constraint(compiler, kind: str, text: str):
    """The compiled grammar of a constraint of ``kind`` whose source is ``text``
    (``StructuredOutputs.text``: choices as a JSON list of strings, nothing for json_object);
    :class:`BadRequestError` naming the problem if it does not compile."""
    if kind not in KINDS:
        raise BadRequestError(f"invalid structured output: unknown kind {kind!r}")
    try:
        if kind == "json_schema":
            return _compile_json_schema(compiler, text)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                separators=_SEPARATORS)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            if not isinstance(choices, list) or not all(isinstance(s, str) for s in choices):
                raise ValueError("choice must be a list of strings")
            return compiler.compile_grammar(choice_grammar(choices))
        return compiler.compile_grammar(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        # xgrammar raises RuntimeError / its own ValueError subclasses, with the parser's
        # message; the message may be long: the first line names the problem
        lines = str(exc).strip().splitlines()
        msg = _SOURCE.sub("", lines[0])[:500] if lines else type(exc).__name__
        raise BadRequestError(f"invalid structured output: the {kind} constraint does not "
                              f"compile: {msg}") from None


__all__ = ["compile_constraint", "count_bounded_strings", "choice_grammar", "MAX_COUNTED"]
