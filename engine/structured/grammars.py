"""``GrammarService``: constraints compiled into xgrammar grammars, off the event loop, cached.

* The vocabulary xgrammar masks over is built once, lazily (on the first constrained request),
  from our own tokenizer's byte table (:func:`tokenizer_info`): every token's exact bytes, so
  byte-level BPE tokens (SmolLM2's GPT-2 alphabet) and byte-fallback tokens both decode right.
* :meth:`GrammarService.compiled` runs the compile on a worker thread (xgrammar releases the GIL
  while it compiles, measured) with a deadline: a constraint that does not compile, or does not
  within ``compile_timeout`` seconds, is a :class:`BadRequestError` naming the problem. A compile
  past its deadline cannot be interrupted; it finishes on its thread and its result is dropped,
  and at most ``compile_threads`` compiles run at once, so hostile constraints cost bounded CPU.
* :class:`GrammarCache` keeps compiled grammars by constraint hash, least recently used first
  out, bounded in entries and in bytes (xgrammar's own ``memory_size_bytes``). Equal constraints
  arriving together share one compile.
"""

from __future__ import annotations

from collections import OrderedDict
import logging
import re
import time
from typing import Callable, Optional

import anyio
from anyio import to_thread

from ..errors import BadRequestError
from .spec import StructuredOutputs

log = logging.getLogger("enginecore.structured")

#: the "[time] file.cc:line: " prefix of xgrammar's messages (not the user's business)
_SOURCE = re.compile(r"^\[[\d:.]+\] [^ ]+:\d+: ")
#: JSON as the grammar emits it: compact (no whitespace runs a small model can loop on).
_SEPARATORS = (",", ":")


def grammar_vocab_size(tokenizer, vocab_size: int) -> int:
    """How many ids xgrammar's vocabulary holds: up to the last id that has bytes or is an EOS
    id, rounded up to whole bitmask words (32 ids), at most ``vocab_size``. The ids past it have
    no text (padding): a grammar never allows them, and :class:`TokenBitmask` refuses them
    itself. NOTE: handing them to xgrammar as empty (special) entries gives the same masks but
    costs time that grows with their number: a ``random:`` preset's byte vocabulary is 258 ids
    padded to the model's 151,936, and with all of them a row's fill inside a JSON string took
    ~190-240 us and each ``accept_token`` ~25-45 us, against ~1-4 us each with 288 ids
    (measured: ``python -m tools.xgrammar_costs``, bench/RESULTS.md)."""
    table = tokenizer.byte_table
    last = max((i for i in tokenizer.eos_token_ids if i < vocab_size), default=-1)
    for i in range(min(len(table), vocab_size) - 1, last, -1):
        if table[i]:
            last = i
            break
    return min(vocab_size, max(32, -(-(last + 1) // 32) * 32))


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of ``tokenizer``: each id's bytes (``VocabType.RAW``: the entries are the
    bytes themselves, already decoded from the GPT-2 alphabet / ``<0xNN>`` spellings by
    :attr:`Tokenizer.byte_table`), for the first :func:`grammar_vocab_size` ids. Special tokens
    are given as empty strings, which xgrammar treats as special: never allowed by a grammar,
    except the EOS ids, which end it."""
    import xgrammar as xgr

    n = grammar_vocab_size(tokenizer, vocab_size)
    table = tokenizer.byte_table
    special = set(getattr(tokenizer, "special_token_ids", lambda: ())())
    vocab = [b"" if i in special else table[i] if i < len(table) else b"" for i in range(n)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n,
                             stop_token_ids=sorted(i for i in tokenizer.eos_token_ids if i < n))


class GrammarCache:
    """Compiled grammars by constraint key, bounded in entries and bytes (LRU)."""

    def __init__(self, max_entries: int = 256, max_bytes: int = 512 * 2**20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: str):
        item = self._items.get(key)
        if item is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item[0]

    def put(self, key: str, grammar, nbytes: int) -> None:
        if key in self._items or nbytes > self.max_bytes:
            return  # too large to keep: used by its request, compiled again next time
        self._items[key] = (grammar, nbytes)
        self.nbytes += nbytes
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, n) = self._items.popitem(last=False)
            self.nbytes -= n

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0


class _Pending:
    """A compile in flight that later requests for the same constraint wait on."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.grammar = None
        self.error: Optional[BaseException] = None


class GrammarService:
    def __init__(self, tokenizer: Callable[[], object], vocab_size: Callable[[], int], *,
                 compile_timeout: float = 10.0, compile_threads: int = 2,
                 cache: Optional[GrammarCache] = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self._limiter = anyio.CapacityLimiter(compile_threads)
        self._info_lock = anyio.Lock()
        self._compiler = None
        self.cache = cache or GrammarCache()
        self._pending: dict[str, _Pending] = {}
        self.compile_seconds: list[float] = []  # of the compiles finished (bench reads them)

    def cached(self, c: StructuredOutputs):
        """The compiled grammar if it is cached (never blocks), else None."""
        return self.cache.get(c.key)

    async def compiled(self, c: StructuredOutputs):
        """The compiled grammar of ``c``; :class:`BadRequestError` if it does not compile in time."""
        key = c.key
        grammar = self.cache.get(key)
        if grammar is not None:
            return grammar
        pending = self._pending.get(key)
        if pending is not None:
            await pending.done.wait()
            if pending.error is not None:
                raise BadRequestError(str(pending.error))
            return pending.grammar
        pending = self._pending[key] = _Pending()
        try:
            compiler = await self._compiler_now()
            # NOTE: the pending entry's compile runs on a thread; past the deadline the thread
            # is abandoned (it cannot be stopped) but still holds its limiter slot until done.
            with anyio.fail_after(self.compile_timeout):
                grammar, seconds = await to_thread.run_sync(
                    _compile, compiler, c, abandon_on_cancel=True, limiter=self._limiter)
        except TimeoutError:
            pending.error = BadRequestError(
                f"invalid structured output: the {c.kind} constraint did not compile within "
                f"{self.compile_timeout:g} s (too large or too complex)")
            raise pending.error from None
        except BadRequestError as exc:
            pending.error = exc
            raise
        finally:
            pending.done.set()
            del self._pending[key]
        self.compile_seconds.append(seconds)
        self.cache.put(key, grammar, int(grammar.memory_size_bytes))
        pending.grammar = grammar
        return grammar

    async def _compiler_now(self):
        async with self._info_lock:
            if self._compiler is None:
                tok, vocab = self._tokenizer(), self._vocab_size()
                self._compiler = await to_thread.run_sync(_new_compiler, tok, vocab)
        return self._compiler

    def close(self) -> None:
        self.cache.clear()
        self._compiler = None


def _new_compiler(tokenizer, vocab_size: int):
    import xgrammar as xgr

    t0 = time.perf_counter()
    # its own cache is off: ours is keyed by the constraint and bounded in entries and bytes
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size), max_threads=1,
                                   cache_enabled=False)
    log.info("grammar compiler ready (vocabulary of %d tokens, %.0f ms)", vocab_size,
             1e3 * (time.perf_counter() - t0))
    return compiler


def _choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are ``choices`` (JSON string escapes are EBNF escapes)."""
    import json

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


def _compile(compiler, c: StructuredOutputs):
    """Compile ``c`` (on a worker thread); (grammar, seconds)."""
    t0 = time.perf_counter()
    kind = c.kind
    try:
        if kind == "json_schema":
            g = _compile_json_schema(compiler, c.json_schema)
        elif kind == "json_object":
            g = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             separators=_SEPARATORS)
        elif kind == "regex":
            g = compiler.compile_regex(c.regex)
        elif kind == "choice":
            g = compiler.compile_grammar(_choice_grammar(c.choice))
        else:
            g = compiler.compile_grammar(c.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        # xgrammar raises RuntimeError / its own ValueError subclasses, with the parser's
        # message; the message may be long: the first line names the problem
        lines = str(exc).strip().splitlines()
        msg = _SOURCE.sub("", lines[0])[:500] if lines else type(exc).__name__
        raise BadRequestError(f"invalid structured output: the {kind} constraint does not "
                              f"compile: {msg}") from None
    return g, time.perf_counter() - t0


__all__ = ["GrammarService", "GrammarCache", "tokenizer_info", "grammar_vocab_size"]
