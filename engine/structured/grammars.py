"""``GrammarService``: constraints compiled into xgrammar grammars, out of the engine's process,
cached.

* The vocabulary xgrammar masks over is built once, lazily (on the first constrained request),
  from our own tokenizer's byte table (:func:`tokenizer_info`): every token's exact bytes, so
  byte-level BPE tokens (SmolLM2's GPT-2 alphabet) and byte-fallback tokens both decode right.
* :meth:`GrammarService.compiled` runs the compile in a worker process
  (:class:`~engine.structured.compile_pool.CompilePool`) with a deadline: a constraint that does
  not compile, or does not within ``compile_timeout`` seconds, is a :class:`BadRequestError`
  naming the problem. A compile past its deadline is stopped (its process is killed, CPU and
  memory with it), and at most ``compile_workers`` compiles run at once; one that finds no
  worker free within :data:`SLOT_WAIT` deadlines is a retryable :class:`EngineOverloadedError`.
* :class:`GrammarCache` keeps compiled grammars by constraint hash, least recently used first
  out, bounded in entries and in bytes (xgrammar's own ``memory_size_bytes``). Equal constraints
  arriving together share one compile.
"""

from __future__ import annotations

from collections import OrderedDict
import logging
from typing import Callable, Optional

import anyio

from ..errors import BadRequestError, EngineError, EngineOverloadedError
from .compile_pool import CompilePool, CompileTimeout, SlotTimeout
from .spec import StructuredOutputs

log = logging.getLogger("enginecore.structured")

#: how long a compile may wait for a free worker, in compile deadlines: beyond it, the request
#: gets the retryable EngineOverloadedError (the workers are busy with others' compiles: not the
#: constraint's fault). A worker's start (seconds: xgrammar imports torch) is not counted.
SLOT_WAIT = 6


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
                 compile_timeout: float = 10.0, compile_workers: int = 2,
                 cache: Optional[GrammarCache] = None,
                 refused: Callable[[str], Optional[str]] = lambda key: None) -> None:
        self.compile_timeout = compile_timeout
        #: constraint key -> why it is refused (structured/budget.py ``refused``), or None
        self._refused = refused
        self.pool = CompilePool(lambda: tokenizer_info(tokenizer(), vocab_size()),
                                compile_workers)
        self.cache = cache or GrammarCache()
        self._pending: dict[str, _Pending] = {}
        self.compile_seconds: list[float] = []  # of the compiles finished (bench reads them)

    def check(self, c: StructuredOutputs) -> None:
        """A :class:`BadRequestError` if ``c`` is refused: a request with the same constraint
        was ended over the per-step grammar budget a short while ago."""
        why = self._refused(c.key)
        if why is not None:
            raise BadRequestError(why)

    def cached(self, c: StructuredOutputs):
        """The compiled grammar if it is cached (never blocks), else None."""
        return self.cache.get(c.key)

    async def compiled(self, c: StructuredOutputs):
        """The compiled grammar of ``c``; :class:`BadRequestError` if it does not compile in
        time."""
        key = c.key
        grammar = self.cache.get(key)
        if grammar is not None:
            return grammar
        pending = self._pending.get(key)
        if pending is not None:
            await pending.done.wait()
            err = pending.error
            if isinstance(err, EngineError):
                raise type(err)(str(err))  # (an exception object is raised in one place)
            if err is not None:
                raise err
            return pending.grammar
        pending = self._pending[key] = _Pending()
        try:
            grammar, seconds = await self.pool.compile(
                c.kind, c.text, self.compile_timeout, SLOT_WAIT * self.compile_timeout)
        except CompileTimeout:
            pending.error = BadRequestError(
                f"invalid structured output: the {c.kind} constraint did not compile within "
                f"{self.compile_timeout:g} s (too large or too complex)")
            raise pending.error from None
        except SlotTimeout:
            pending.error = EngineOverloadedError(
                f"every grammar compile worker is busy: the {c.kind} constraint waited "
                f"{SLOT_WAIT * self.compile_timeout:g} s for one; retry later")
            raise pending.error from None
        except BaseException as exc:
            # (cancelled too: whoever waits on this compile gets an error, never no grammar)
            pending.error = exc if isinstance(exc, Exception) else BadRequestError(
                f"invalid structured output: the {c.kind} constraint's compile was cancelled")
            raise
        finally:
            pending.done.set()
            del self._pending[key]
        self.compile_seconds.append(seconds)
        self.cache.put(key, grammar, int(grammar.memory_size_bytes))
        pending.grammar = grammar
        return grammar

    def close(self) -> None:
        """Stop every compile and its process (waits for their end); drop the cache."""
        self.pool.close()
        self.cache.clear()


__all__ = ["GrammarService", "GrammarCache", "tokenizer_info", "grammar_vocab_size"]
