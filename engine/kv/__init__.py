"""The paged KV cache's bookkeeping: the block allocator and KV tensor (``kv_cache``), the target's
``BlockManager`` with reference counts and the prefix cache's index, and chained block hashes."""
