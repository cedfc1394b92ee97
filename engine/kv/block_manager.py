"""``BlockManager``: the target model's KV blocks, with reference counts and the prefix cache.

Every block is in exactly one of three places: held (reference count > 0, by one or more
requests), *empty* (free, content meaningless) or *evictable* (free, but its content is a full
block of some prompt prefix, findable by hash). A request's ``block_ids`` are split at
``num_sealed_blocks``: the sealed blocks in front are full, computed and read-only (only they may
be shared or be in the hash index); the ones after are private (reference count 1) and the only
ones the request writes. So a block shared by two requests is never written, and a block
referenced by anyone is never handed out. "Computed" counts the step being scheduled:
``seal_ahead`` registers the blocks a scheduled chunk fills before the step runs, so that a
request admitted later in the same step shares them (see there).

The prefix cache: a full computed block gets a hash chained over (parent hash, its token ids);
the chain's root is derived from ``weights_version`` and a reset epoch, so after
``reset_prefix_cache()`` (a weight update) no earlier hash can ever match again. The index is
keyed by what each hash is computed over, the parent's hash and the block's token ids
(:func:`engine.kv.block_hash.block_key`), so a lookup walks a prompt's blocks with dict lookups
(the parent of the next key is the found block's hash) and computes no hash; the keys are
compared whole. A new request takes the longest registered chain of its full blocks — at most
``(num_tokens - 1) // block_size`` of them, so its last token is always computed and gives
logits — and starts its own chain from the found blocks' hashes. Freed blocks keep their content
and are evicted least recently used when ``allocate`` finds no empty block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from operator import countOf
from typing import Iterable, NamedTuple

from engine.request import Request

from .block_hash import block_digest, block_key, chain_hashes, root_hash, token_bytes


class CacheStats(NamedTuple):
    queries: int  # prompt tokens looked up (first admission of each request)
    hits: int  # of those, tokens served from the cache
    evictions: int  # cached blocks reused for other content
    cached_blocks: int  # blocks in the hash index now


class BlockManager:
    """Paired query/act methods: ``lookup``/``can_admit``/``admit``, ``can_allocate``/``grow``,
    ``advance`` (seal newly computed blocks, give back rolled-back ones), ``free``."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 weights_version: int = 0):
        if num_blocks < 1:
            raise ValueError("need at least one KV block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.weights_version = weights_version
        self.epoch = 0  # bumped by every reset; part of the hash root
        self._root = root_hash(weights_version, self.epoch, block_size)
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # registered hash of a block
        self._key: list[bytes | None] = [None] * num_blocks  # what that hash is computed over
        self._index: dict[bytes, int] = {}  # key (parent hash + token ids) -> block
        self._empty: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._queries = self._hits = self._evictions = 0
        self.closed = False

    # -- capacity ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` may hand out (empty, or cached and unreferenced)."""
        return len(self._empty) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, b: int) -> int:
        return self._ref[b]

    def is_cached(self, b: int) -> bool:
        """``b`` is in the hash index (its content may be served to a new request)."""
        return self._hash[b] is not None

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` private blocks: empty ones first, then the least recently used cached ones."""
        if n > self.num_free:
            raise RuntimeError(f"KV cache out of blocks: want {n}, have {self.num_free}")
        out = []
        for _ in range(n):
            if self._empty:
                b = self._empty.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._unregister(b)
                self._evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def grow(self, req: Request, n: int) -> None:
        """``n`` more private blocks at the end of ``req``'s blocks."""
        req.block_ids += self.allocate(n)

    # -- admission (a request with nothing computed) ---------------------------------------------
    def lookup(self, req: Request) -> list[int]:
        """The cached blocks of ``req``'s longest cached prefix (leaves nothing changed)."""
        if not self.enable_caching or self.closed:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        if limit <= 0:
            return []
        data = token_bytes(req.token_ids[: limit * self.block_size])
        step = len(data) // limit
        index, hashes, parent = self._index, self._hash, self._root
        hit: list[int] = []
        for i in range(0, len(data), step):
            b = index.get(parent + data[i:i + step])  # block_key(parent, the block's tokens)
            if b is None:
                break
            hit.append(b)
            parent = hashes[b]
        return hit

    def can_admit(self, hit: list[int], n_new: int) -> bool:
        """Room for ``n_new`` new blocks once the ``hit`` blocks are taken off the free lists."""
        return n_new <= self.num_free - countOf(map(self._ref.__getitem__, hit), 0)

    def admit(self, req: Request, hit: list[int], n_new: int) -> None:
        """Give ``req`` (holding nothing) the ``hit`` blocks, shared and sealed, plus ``n_new``
        private ones; its computed tokens start after the hit."""
        assert not req.block_ids and req.num_computed_tokens == 0, f"{req} is not fresh"
        ref = self._ref
        if countOf(map(ref.__getitem__, hit), 0):  # (C-level: most hits are held by others)
            for b in hit:
                if ref[b] == 0:
                    del self._evictable[b]
        for b in hit:
            ref[b] += 1
        req.block_ids = list(hit) + self.allocate(n_new)
        req.block_epoch += 1
        req.num_sealed_blocks = len(hit)
        req.num_computed_tokens = len(hit) * self.block_size
        req.cache_epoch = self.epoch
        if hit and (req.hash_root != self._root or len(req.block_hashes) < len(hit)):
            # its chain starts from the hashes the hit blocks are registered under (the same
            # chain over the same tokens): only the blocks it computes are hashed
            req.hash_root, req.block_hashes = self._root, list(map(self._hash.__getitem__, hit))
        if self.enable_caching and req.num_preemptions == 0:  # a resume re-reads its own prefix: not a prompt query
            self._queries += req.num_prompt_tokens
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            self._hits += req.num_cached_tokens

    # -- progress ------------------------------------------------------------------------------
    def advance(self, req: Request, num_computed: int) -> None:
        """``req`` now has ``num_computed`` tokens' K/V in its blocks: give back blocks past
        ``num_computed + 1`` tokens (rejected draft tokens used them) and seal (register) the
        full blocks of known tokens."""
        assert num_computed >= req.num_computed_tokens, "computed tokens never go back"
        req.num_computed_tokens = num_computed
        keep = -(-(num_computed + 1) // self.block_size)
        if len(req.block_ids) > keep:
            tail = req.block_ids[keep:]
            del req.block_ids[keep:]
            req.block_epoch += 1
            self._release(tail)
        self._seal(req, num_computed)

    def seal_ahead(self, req: Request, upto: int) -> None:
        """``req`` is scheduled to compute its tokens up to ``upto`` in the step being built:
        register now the full blocks of known tokens that step fills, so that a request
        admitted after it in the same step (or in a step launched before this one is read back)
        finds them and computes only the rest, as vLLM's allocator caches blocks when it hands
        them out. Safe because every model path writes the whole step's K/V of a layer before
        any row's attention reads the cache (``write_kv`` / the fused write, then
        ``attention.paged_attention``), and a later step runs after this one on the device's
        stream. A 1,000-token system prompt sent by 64 clients at once is then computed once
        in the first step instead of once per step until the first copy is done."""
        self._seal(req, upto)

    def free(self, req: Request) -> None:
        """``req`` leaves (finished, aborted, preempted): seal what it computed, then drop its
        references; its last blocks become the first to be evicted."""
        self._seal(req, req.num_computed_tokens)
        blocks, req.block_ids = req.block_ids, []
        req.block_epoch += 1
        req.num_sealed_blocks = 0
        self._release(reversed(blocks))

    def _release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    self._empty.append(b)
                else:
                    self._evictable[b] = None

    def _seal(self, req: Request, computed: int) -> None:
        """Register ``req``'s full blocks of known tokens below ``computed``."""
        full = min(computed, req.num_tokens, len(req.block_ids) * self.block_size)
        full //= self.block_size
        if full <= req.num_sealed_blocks:
            return
        # NOTE: a request admitted before a reset may hold K/V of the old weights: it seals
        # (stops writing) but never registers.
        if self.enable_caching and req.cache_epoch == self.epoch and not self.closed:
            hashes = self._hashes(req, full)
            bs, first = self.block_size, req.num_sealed_blocks
            data = token_bytes(req.token_ids[first * bs:full * bs])
            step = bs * 4
            for i in range(first, full):
                b = req.block_ids[i]
                k = block_key(hashes[i - 1] if i else self._root,
                              data[(i - first) * step:(i - first + 1) * step])
                if k not in self._index and self._hash[b] is None:
                    self._index[k] = b
                    self._hash[b], self._key[b] = hashes[i], k
        req.num_sealed_blocks = full

    def _hashes(self, req: Request, n: int) -> list[bytes]:
        """The chained hashes of ``req``'s first ``n`` full blocks (memoized on the request)."""
        if req.hash_root != self._root:
            req.hash_root, req.block_hashes = self._root, []
        hs = req.block_hashes
        if len(hs) < n:
            bs = self.block_size
            parent = hs[-1] if hs else self._root
            hs += chain_hashes(parent, req.token_ids[len(hs) * bs:n * bs], bs)
        return hs

    def _unregister(self, b: int) -> None:
        k = self._key[b]
        if k is not None:
            self._hash[b] = self._key[b] = None
            if self._index.get(k) == b:
                del self._index[k]

    # -- invalidation and shutdown -----------------------------------------------------------
    def reset_prefix_cache(self, weights_version: int | None = None) -> None:
        """Drop every cached entry (a weight update calls this); blocks held by running
        requests stay theirs, unregistered. With ``weights_version``, it becomes the new one."""
        if weights_version is not None:
            self.weights_version = weights_version
        self.epoch += 1
        self._root = root_hash(self.weights_version, self.epoch, self.block_size)
        for b in list(self._index.values()):
            self._hash[b] = self._key[b] = None
        self._index.clear()
        self._empty.extend(self._evictable)
        self._evictable.clear()

    invalidate = reset_prefix_cache

    def close(self) -> None:
        """The KV cache is released: forget every block and entry (host bookkeeping only)."""
        self.reset_prefix_cache()
        self.closed = True

    def statistics(self) -> CacheStats:
        return CacheStats(self._queries, self._hits, self._evictions, len(self._index))

    # -- integrity ---------------------------------------------------------------------------
    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Reference counts equal the holders; every block is held, empty or evictable, exactly
        once; the index and the blocks' hashes agree; shared blocks are sealed, private ones
        unregistered; sealed blocks are computed and carry the hash of their tokens."""
        holders = [0] * self.num_blocks
        bs = self.block_size
        for r in requests:
            assert len(set(r.block_ids)) == len(r.block_ids), f"{r} holds a block twice"
            assert r.num_sealed_blocks * bs <= r.num_computed_tokens, f"{r} sealed uncomputed"
            assert len(r.block_ids) * bs >= r.num_computed_tokens, f"{r} lacks blocks"
            for b in r.block_ids:
                holders[b] += 1
            m = r.block_mirror  # host_arrays.block_table's copy, where it claims to be current
            if m is not None and m[0] == r.block_epoch:  # (blocks only appended since it)
                assert m[1] <= len(r.block_ids) and m[2][: m[1]].tolist() == r.block_ids[: m[1]], \
                    f"{r}: its block table's mirror differs from its blocks"
        for r in requests:
            for i, b in enumerate(r.block_ids):
                if i >= r.num_sealed_blocks:
                    assert holders[b] == 1 and self._hash[b] is None, \
                        f"{r}: private block {b} is shared or cached"
                elif self._hash[b] is not None and r.cache_epoch == self.epoch:
                    assert r.hash_root == self._root and r.block_hashes[i] == self._hash[b], \
                        f"{r}: block {b} is cached under other tokens"
        assert holders == self._ref, "reference counts differ from the holders"
        empty, evictable = set(self._empty), set(self._evictable)
        assert len(empty) == len(self._empty), "a block is empty twice"
        assert not (empty & evictable), "a block is both empty and evictable"
        free = {b for b in range(self.num_blocks) if self._ref[b] == 0}
        assert empty | evictable == free, "a free block is missing from the free lists, or a held one is on them"
        assert all(self._hash[b] is None for b in empty), "an empty block is still registered"
        assert all(self._hash[b] is not None for b in evictable), "an evictable block has no hash"
        assert len(self._index) == sum(h is not None for h in self._hash), "index and hashes differ"
        assert all((k is None) == (h is None) for k, h in zip(self._key, self._hash)), \
            "a block has a hash without a key or a key without a hash"
        for k, b in self._index.items():
            assert self._key[b] == k, f"index entry of block {b} is stale"
            assert self._hash[b] == block_digest(k), f"block {b}'s hash is not its key's"
