"""Incremental detokenization that never emits broken UTF-8, plus stop-string handling.

Byte-level BPE tokens can end in the middle of a UTF-8 character. We decode a short window of
recent tokens and emit only the text that has become stable (no trailing U+FFFD). Stop strings
are searched in the pending text; text that could still be the start of a stop string is held
back until it cannot, so a stop string never appears in any streamed delta.
"""

from __future__ import annotations

from typing import Sequence

from engine.loader.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_JOIN_EVERY = 32  # pieces of the emitted text kept apart before they are joined


class IncrementalDetokenizer:
    __slots__ = ("_tok", "_ids", "_prefix", "_read", "_stops", "_hold", "_pending", "_out",
                 "stopped", "_skip", "_keep_stop", "_stream")

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int], stop: Sequence[str],
                 skip_special_tokens: bool = True, include_stop_str: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._keep_stop = include_stop_str  # the text ends with the stop string, not before it
        # A few prompt tokens give the decoder context (e.g. a leading space merges correctly).
        self._ids: list[int] = list(prompt_tail[-4:])
        self._prefix = 0
        self._read = len(self._ids)
        self._stops = list(stop)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""  # decoded but not yet emitted (could start a stop string)
        # everything emitted so far, in pieces joined every _JOIN_EVERY: ``self.text += out``
        # copied the whole text on every token (CPython concatenates in place only into a
        # local), quadratic in the output's length on the step thread
        self._out: list[str] = []
        self.stopped = False
        # the tokenizer's own incremental decoder when it has one (one call a token);
        # otherwise windows of tokens are decoded (two calls a token)
        stream = getattr(tokenizer, "decode_stream", None)
        self._stream = stream(self._ids, skip_special_tokens) if stream is not None else None

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the newly stable text (possibly ""). Sets ``stopped`` when a
        stop string was found (the text then ends right before it)."""
        if self._stream is not None:
            step = self._stream.step
            for t in token_ids:
                self._pending += step(t)
            return self._release(final=False)
        for t in token_ids:
            self._ids.append(t)
            prefix_text = self._decode(self._ids[self._prefix:self._read])
            full = self._decode(self._ids[self._prefix:])
            if full.endswith(_REPLACEMENT) or len(full) < len(prefix_text):
                continue  # an incomplete character: wait for more bytes
            self._pending += full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._out)

    def _decode(self, ids) -> str:
        return self._tok.decode(ids) if self._skip else self._tok.decode(ids, False)

    def flush(self) -> str:
        """The request finished: emit whatever is still held back."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        if self._stops:
            # NOTE: searching the pending text alone is enough: at least len(longest stop) - 1
            # characters are always held back, so a stop string starting in text already
            # emitted would have been complete (and found) when that text was emitted.
            found = [(i, -len(s)) for s in self._stops if (i := self._pending.find(s)) >= 0]
            if found:
                i, neg = min(found)
                cut = i - neg if self._keep_stop else i
                out = self._pending[:cut]
                self.stopped = True
                self._out.append(out)
                self._pending = ""
                return out
        if final or not self._stops:
            out, self._pending = self._pending, ""
        else:
            keep = min(self._hold, len(self._pending))
            out = self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
        if out:
            self._out.append(out)
            if len(self._out) > _JOIN_EVERY:
                self._out[:] = ["".join(self._out)]
        return out
