"""The synchronous engine core: ``EngineCore.step()`` (schedule -> execute -> update), the
scheduler, incremental detokenization, and the core's statistics. Knows nothing of async."""
