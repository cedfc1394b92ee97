"""Structured outputs: one constraint per request (``spec``), compiled off the event loop and
cached (``grammars``), a matcher per request (``matcher``) and one token bitmask per step for the
whole batch, applied to the logits on the device before sampling (``bitmask``). The grammar
engine is xgrammar; only ``spec`` is imported without it."""

from .spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
