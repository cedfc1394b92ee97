"""``Tokenizer``: one interface over a ``tokenizers`` tokenizer (from tokenizer.json or GGUF
metadata) and the byte-level tokenizer used with ``random:`` presets."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from engine.errors import BadRequestError, CheckpointError


class Tokenizer:
    """Encode/decode plus the model's special ids and chat template."""

    def __init__(
        self,
        backend,  # tokenizers.Tokenizer, or None for the byte-level tokenizer
        *,
        vocab_size: int,
        bos_token_id: Optional[int] = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: Optional[str] = None,
        add_bos: bool = False,
        special_tokens: Optional[dict[str, int]] = None,
    ):
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.special_tokens = dict(special_tokens or {})
        self._max_token_chars: Optional[int] = None
        self._token_bytes: Optional[list[bytes]] = None

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: Path, *, vocab_size: int, bos_token_id=None, eos_token_ids=(),
                  tokenizer_config: Optional[dict] = None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            backend = HFTokenizer.from_file(str(path))
        except FileNotFoundError as exc:
            raise CheckpointError(path, "tokenizer.json is missing") from exc
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise CheckpointError(path, f"cannot read tokenizer.json: {exc}") from exc
        cfg = tokenizer_config or {}
        eos = set(eos_token_ids)
        eos_tok = cfg.get("eos_token")
        if isinstance(eos_tok, dict):
            eos_tok = eos_tok.get("content")
        if isinstance(eos_tok, str) and backend.token_to_id(eos_tok) is not None:
            eos.add(backend.token_to_id(eos_tok))
        return cls(
            backend, vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_ids=sorted(eos),
            chat_template=cfg.get("chat_template"), add_bos=bool(cfg.get("add_bos_token", False)),
        )

    @classmethod
    def bytes(cls, vocab_size: int) -> "Tokenizer":
        """Byte-level tokenizer: ids 0..255 are bytes; 256 = BOS, 257 = EOS; vocab padded."""
        if vocab_size < 258:
            raise ValueError("byte tokenizer needs vocab_size >= 258")
        return cls(None, vocab_size=vocab_size, bos_token_id=256, eos_token_ids=(257,),
                   special_tokens={"<s>": 256, "</s>": 257})

    # -- use ---------------------------------------------------------------------------------
    @property
    def max_token_chars(self) -> int:
        """An upper bound of the characters one token stands for (the longest vocabulary entry:
        byte-level entries spell each byte as one character, so bytes >= characters)."""
        n = self._max_token_chars
        if n is None:
            if self._backend is None:
                n = 1
            else:
                n = max((len(t) for t in self._backend.get_vocab(with_added_tokens=True)), default=1)
            self._max_token_chars = n
        return n

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is None:
            ids = list(text.encode("utf-8"))
        elif len(text) > 2048:
            # NOTE: tokenizers' single ``encode`` holds the GIL for the whole text (a 760k-char
            # prompt stalled the event loop ~1 s on a worker thread); its batch path releases it.
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, prompt_tail: Sequence[int], skip_special_tokens: bool = True):
        """An incremental decoder of the tokens generated after ``prompt_tail``: ``step(id)``
        returns the text that token completes ("" while a character is still partial). None
        when there is none for this tokenizer, or when ``prompt_tail`` itself ends in a partial
        character (the incremental decoders would then emit the prompt's own bytes): the caller
        decodes windows of tokens instead (engine/core/detokenizer.py).

        One call per token, against two window decodes: tokenizers' ``DecodeStream`` (Rust) for
        a ``tokenizers`` backend (measured ~2 against ~18 µs a token on the default model's
        tokenizer), Python's incremental UTF-8 decoder for the byte-level tokenizer."""
        tail = list(prompt_tail)
        if tail and self.decode(tail, skip_special_tokens).endswith("\ufffd"):
            return None
        if self._backend is None:
            return _ByteStream(tail)
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers < 0.21
            return None
        return _BackendStream(DecodeStream(ids=tail, skip_special_tokens=skip_special_tokens),
                              self._backend)

    def special_token_ids(self) -> list[int]:
        """Ids of the special (control) tokens: BOS, EOS, chat markers -- never text."""
        if self._backend is None:
            return sorted(self.special_tokens.values())
        return sorted(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's entry as the vocabulary spells it (e.g. "Ġhello" for a byte-level BPE: not
        its text); the byte tokenizer spells byte ``b`` as ``chr(b)``. Unknown ids: ""."""
        if self._backend is None:
            names = {v: k for k, v in self.special_tokens.items()}
            return [chr(i) if 0 <= i < 256 else names.get(i, "") for i in ids]
        to_token = self._backend.id_to_token
        return [to_token(i) or "" for i in ids]

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for (its UTF-8 text may be a partial character)."""
        table = self.byte_table
        return table[i] if 0 <= i < len(table) else b""

    @property
    def byte_table(self) -> list[bytes]:
        """Every token's bytes, by id (built once, on first use)."""
        table = self._token_bytes
        if table is None:
            table = self._token_bytes = _token_byte_table(self)
        return table

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **options) -> str:
        """Render ``messages`` with the model's chat template (Jinja, sandboxed); ``options``:
        :func:`render_chat_template`'s keyword arguments."""
        return render_chat_template(self.chat_template, messages, self.bos_token, self.eos_token,
                                    add_generation_prompt, **options)

    @property
    def bos_token(self) -> Optional[str]:
        """The BOS token's text (for chat templates), or None."""
        return self._id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> Optional[str]:
        """The (lowest-id) EOS token's text (for chat templates), or None."""
        return self._id_to_token(min(self.eos_token_ids)) if self.eos_token_ids else None

    def _id_to_token(self, i: Optional[int]) -> Optional[str]:
        if i is None:
            return None
        if self._backend is None:
            return {v: k for k, v in self.special_tokens.items()}.get(i)
        return self._backend.id_to_token(i)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is spelled with."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_byte_table(tok: "Tokenizer") -> list[bytes]:
    if tok._backend is None:
        return [bytes([i]) if i < 256 else b"" for i in range(tok.vocab_size)]
    dec = _byte_decoder()
    backend = tok._backend
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    out = []
    for i in range(tok.vocab_size):
        t = backend.id_to_token(i)
        if t is None:
            out.append(b"")
        elif t not in added and all(c in dec for c in t):
            out.append(bytes(dec[c] for c in t))
        elif t.startswith("<0x") and t.endswith(">") and len(t) == 6:  # SentencePiece byte
            out.append(bytes([int(t[3:5], 16)]))
        else:
            out.append(t.replace("\u2581", " ").encode("utf-8"))
    return out


#: the names the renderer itself gives the template: ``template_kwargs`` may not set them
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                                     "tools", "documents", "raise_exception",
                                     "continue_final_message"})


def render_chat_template(template: Optional[str], messages: list[dict], bos_token: Optional[str],
                         eos_token: Optional[str], add_generation_prompt: bool = True, *,
                         continue_final_message: bool = False, tools: Optional[list] = None,
                         documents: Optional[list] = None,
                         template_kwargs: Optional[dict] = None) -> str:
    """Render ``messages`` with a chat ``template`` (Jinja, sandboxed) -- shared by
    :meth:`Tokenizer.apply_chat_template` and the IPC client, which gets the template in its
    handshake. Without a template: plain "role: content" lines (so chat works on random presets).

    As transformers' ``apply_chat_template`` renders: ``tools`` and ``documents`` (None when not
    given) and ``template_kwargs`` (any other names the template reads, e.g. a model's
    ``enable_thinking``; none of :data:`RESERVED_TEMPLATE_NAMES`) reach the template;
    ``continue_final_message`` ends the text right after the last message's content, without
    whatever the template closes a message with, so the model continues that message (not with
    ``add_generation_prompt``). A bad combination raises ``BadRequestError``.
    """
    if continue_final_message and add_generation_prompt:
        raise BadRequestError("continue_final_message and add_generation_prompt cannot both be true")
    extra = dict(template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_NAMES.intersection(extra))
    if clash:
        raise BadRequestError(f"chat template arguments may not set {', '.join(clash)}")
    if not template:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        text += "assistant: " if add_generation_prompt else ""
    else:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise BadRequestError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        tmpl = env.from_string(template)
        text = tmpl.render(**extra, messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token or "", eos_token=eos_token or "", tools=tools,
                           documents=documents)
    return _open_final_message(text, messages) if continue_final_message else text


def _open_final_message(text: str, messages: list[dict]) -> str:
    """``text`` cut right after the last message's content (its last occurrence): what the
    template adds after a message (an end-of-turn marker, a newline) is dropped. The content's
    trailing whitespace stays when the template kept it."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):  # content parts: the last text part
        final = next((p.get("text") for p in reversed(final)
                      if isinstance(p, dict) and isinstance(p.get("text"), str)), None)
    core = final.strip() if isinstance(final, str) else ""
    if not core:
        raise BadRequestError("continue_final_message needs a last message with text content")
    at = text.rfind(core)
    if at < 0:
        raise BadRequestError("continue_final_message: the chat template does not render the "
                              "last message's content as given")
    end = at + len(core)
    tail = final[len(final.rstrip()):]
    if tail and text.startswith(tail, end):
        end += len(tail)
    return text[:end]


class _BackendStream:
    """``tokenizers``' ``DecodeStream`` bound to its tokenizer."""

    __slots__ = ("_stream", "_backend")

    def __init__(self, stream, backend):
        self._stream, self._backend = stream, backend

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


class _ByteStream:
    """The byte-level tokenizer's ids as one UTF-8 byte stream (ids >= 256 are special: no
    text). A replacement character (an invalid byte) is held back until more text follows,
    as the window decoder does: one at the very end is never emitted."""

    __slots__ = ("_decoder", "_held", "_clean")

    def __init__(self, tail: list[int]):
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoder.decode(bytes(i for i in tail if i < 256))
        self._held = ""
        # the last byte fed was ASCII: the decoder holds nothing (an ASCII byte completes or
        # ends any sequence before it) and nothing is held back here
        self._clean = False

    def step(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return ""
        if token_id < 0x80:
            if self._clean:  # (one call a token on the step thread: JSON is mostly ASCII)
                return chr(token_id)
            self._clean = True
        else:
            self._clean = False
        text = self._held + self._decoder.decode(bytes((token_id,)))
        if text.endswith("\ufffd"):
            self._held = text
            return ""
        self._held = ""
        return text
