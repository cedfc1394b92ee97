"""From ``EngineConfig.model`` to a filled model: checkpoint resolution (``checkpoint``), GGUF,
the local Hugging Face cache, tokenizers and chat templates, load progress. Every failure is a
``CheckpointError``."""
