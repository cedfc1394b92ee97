"""The engine's wire protocol: every message, as msgspec Structs in one tagged union.

This module is the protocol's documentation; a client in any language can be written from it.

Transport
=========
A byte stream: a Unix socket (``unix:///path``, mode 0600, the default) or TCP
(``tcp://host:port``; 127.0.0.1 unless told otherwise; a non-loopback address requires a token).
An engine started with a token requires it from every client, on every kind of address
(loopback TCP and Unix sockets included).

Limits: the engine keeps at most ``max_connections`` connections (256 by default), counting
those whose handshake is not done yet. A connection beyond that gets
``Error(kind=OVERLOADED, fatal=True, retry_after=...)`` ("too many connections (max N)") as its
first frame, without waiting for a Hello, and is closed.

Framing
=======
Each message is one frame::

    +----------------------------+---------------------------------+
    | length N: 4 bytes, uint32, | body: N bytes, one MessagePack  |
    | big-endian (network order) | map (the message)               |
    +----------------------------+---------------------------------+

* ``1 <= N <= max_frame``. ``max_frame`` is 16 MiB (:data:`DEFAULT_MAX_FRAME`) unless configured;
  the engine tells it in ``Welcome.max_frame``. Before the handshake is done the engine accepts at
  most :data:`HANDSHAKE_MAX_FRAME` (64 KiB). A header outside the bounds is rejected *before the
  body is read*: the engine answers ``Error(kind=TOO_LARGE, fatal=True)`` (``PROTOCOL`` for 0) and
  closes the connection.
* The body is a MessagePack map. Key ``"t"`` holds the message type, which is the class name below
  (``"Hello"``, ``"Generate"``, ...). The other keys are the fields by name. Fields equal to their
  default are left out by the sender and may be left out by you; unknown keys, wrong types and
  values outside the bounds given below make the whole frame invalid (``Error(kind=PROTOCOL,
  fatal=True)``, then the connection is closed). Enums travel as their values: ``State`` as a
  string ("init", "loaded", "serving", "paused", "sleeping", "draining", "shutdown", "failed"), :class:`ErrorKind` as an
  integer. ``SamplingParams`` and ``RequestOutput`` (engine/params.py) are nested maps with their
  field names as keys and no ``"t"`` key: SamplingParams {max_tokens: int = 16, temperature: float
  = 0.0 (greedy), top_k: int = 0, top_p: float = 1.0, seed: int | nil, stop: [str],
  stop_token_ids: [int], ignore_eos: bool, logprobs: bool, min_tokens: int = 0, top_logprobs: int
  = 0, prompt_logprobs: int | nil, echo: bool, presence_penalty, frequency_penalty: float = 0,
  repetition_penalty: float = 1, min_p: float = 0, logit_bias: {int: float}, allowed_token_ids:
  [int], skip_special_tokens: bool = true, include_stop_str_in_output: bool,
  truncate_prompt_tokens: int | nil, bad_words: [str], structured: StructuredOutputs | nil,
  logprobs_mode: "raw" | "processed", truncation_side: "left" | "right",
  max_tokens_within_context: bool, return_prompt_token_ids: bool} (unknown keys rejected); a StructuredOutputs (engine/structured/spec.py) is a map with exactly
  one of json_schema: str (the schema's JSON text, <= 64 KiB), json_object: true, regex: str
  (<= 16 KiB), choice: [str] (<= 256 of <= 1 KiB), grammar: str (EBNF, <= 16 KiB); RequestOutput {request_id: str,
  token_ids: [int] (new tokens), text: str (new text), num_prompt_tokens: int, num_output_tokens:
  int (cumulative), finished: bool, finish_reason: "stop" | "length" | "abort" | "error" | nil,
  reason: str | nil, logprobs: [float] | nil, token_logprobs: Logprobs | nil,
  prompt_logprobs: Logprobs | nil, prompt_text: str | nil, weight_version: int,
  num_cached_tokens: int, prompt_token_ids: [int] | nil}; a Logprobs: [k: int (0..1024), rows:
  bin], ``rows`` one row of 3 + 2k little-endian 4-byte words per token: token id (int32), logprob
  (float32; NaN: none), rank (int32; 0: not computed), k top ids (int32), k top logprobs
  (float32). Token ids only: a client that shows tokens as text takes their bytes from
  :class:`Vocabulary` once.
* Example: ``Hello(protocol_version=1, client_name="cli")`` is the header ``00 00 00 2b``
  (43) followed by the 43-byte body ``{"t": "Hello", "protocol_version": 1, "client_name":
  "cli"}``: ``83 a1 74 a5 48 65 6c 6c 6f b0 70 72 6f 74 6f 63 6f 6c 5f 76 65 72 73 69 6f 6e 01
  ab 63 6c 69 65 6e 74 5f 6e 61 6d 65 a3 63 6c 69``.

Handshake
=========
1. The client connects and sends :class:`Hello` (``protocol_version`` =
   :data:`PROTOCOL_VERSION`, and the ``token`` if the engine was started with one). It must
   arrive within the engine's handshake timeout (10 s).
2. The engine answers :class:`Welcome` -- or, for a wrong version, a missing/wrong token or
   anything but a Hello, ``Error(kind=VERSION | AUTH | PROTOCOL, fatal=True)`` and closes.
   Tokens are compared first, in constant time: the right one gets its Welcome at once, always.
   Failures are throttled per peer (TCP host, or the Unix socket's user): after a few, the
   answer to a failure is held (doubling, up to 4 s: under half a client's 10 s), and while too
   many are held, a failure gets ``Error(kind=AUTH, fatal=True, retry_after=...)`` at once.
   ``Hello``, ``Welcome`` and ``Error`` keep their layout
   in every protocol version, so a version mismatch is always reported as ``VERSION``.
   Besides the engine's state and frame limit, ``Welcome`` describes the model (``model``,
   ``chat_template``, ``bos_token``, ``eos_token``, ``max_model_len``, ``vocab_size``,
   ``max_logprobs``), so a
   client can render chat prompts and check token ids without asking.

Message flow (after the handshake)
==================================
Both directions are asynchronous: the client may pipeline requests without waiting for
replies, and the engine pushes frames whenever it has something to say.

Client -> engine:

* :class:`Generate` starts a request. ``request_id`` is chosen by the client and scoped to the
  connection (other connections' ids never collide with it); it must not be in use by one of
  the connection's unfinished requests. Requests waiting for a batch slot are admitted
  round-robin across clients -- each connection, and each ``client`` a connection names, is one
  -- in arrival order within one; a client holds at most its share of the engine's admission
  limits. The engine streams the request's :class:`RequestOutput`
  pieces (new tokens/text since the previous piece) inside :class:`Outputs` frames; exactly one
  piece has ``finished=True`` (with ``finish_reason``), after which the id is free again. If the
  request is refused or fails, the engine sends ``Error(request_id=...)`` instead, and nothing
  else for that id (it is finished). Refusals: ``BAD_REQUEST`` (invalid params/prompt, id in
  use, too many requests in flight on the connection -- 16,384 by default), ``DRAINING``
  (``retry_after`` seconds: try another replica / later), ``OVERLOADED`` (the engine's
  admission limits are reached; nothing was queued; retry after ``retry_after``), ``SLEEPING``
  (asleep: retry after ``retry_after`` or once woken), ``SHUTDOWN``, ``DEAD`` (also for a
  running request when the engine fails), ``TOO_LARGE`` (non-fatal: one piece did not fit in a
  frame; the request was aborted).
* :class:`Abort` ends a request early: if still running, its last piece has
  ``finish_reason="abort"`` and ``reason`` = the Abort's ``reason`` (default "aborted by
  client"). Aborting an unknown or finished id is not an error.
* :class:`HealthRequest` asks for a :class:`Health` snapshot.
* :class:`Drain` stops admission (new Generates get ``DRAINING``; every connection gets
  ``StateChanged(draining)``), waits up to ``timeout`` seconds for running requests to finish,
  aborts the rest, and shuts the engine down (``StateChanged(shutdown)``). The Ack comes then,
  after which the engine closes every connection.
* :class:`Shutdown` is ``Drain(timeout=0)``: running requests end with ``"abort"`` at once.
* Sleep mode (types appended to version 1; an older engine answers them ``PROTOCOL``):
  :class:`Sleep` moves the engine to ``sleeping`` at once, ends or finishes the requests in
  flight, frees the device, then answers; :class:`WakeUp` brings memory back; :class:`UpdateWeights`
  loads a checkpoint while asleep (refused: ``BAD_REQUEST``, the old weights stay). A Drain or
  Shutdown while sleeping releases what is left; a call in the wrong state: ``INVALID_TRANSITION``.
  ``Sleep.tags`` (appended) frees only what it names; ``UpdateWeights.version`` (appended) is
  the version outputs carry from then on.
* Pause, abort-all and weights from a trainer (appended to version 2): ``control.py``.
* :class:`Tokenize` / :class:`Detokenize` (appended too) ask the engine's tokenizer: :class:`Tokens` (``ids``
  / ``texts``) or an ``Error`` answers, with their ``call_id``. :class:`Vocabulary` (appended in
  version 2) asks for every token's bytes, by id: :class:`Tokens` (``pieces``).

Correlation: every client message but Hello and Generate takes an optional ``call_id``
(client-chosen integer). With it, the engine answers with a message carrying the same
``call_id``: :class:`Health` for a HealthRequest, :class:`Ack` (with the engine's ``state``) when
an Abort was delivered or another call completed, or :class:`Error` if the call failed.
Without it, only failures are reported. An Ack for an Abort may arrive before the request's last
(``"abort"``) piece.

Engine -> client, unprompted:

* :class:`Outputs`: all of this connection's pieces produced by one engine step, in one frame.
  Pieces of one request are in order; pieces of different requests may interleave.
* :class:`StateChanged` on every lifecycle transition (e.g. serving -> draining).
* :class:`Error` with ``fatal=True`` (protocol violation, oversize frame, failed handshake):
  the engine closes the connection right after it.

Closing
=======
When a connection closes (either side, EOF, half-close, reset), the engine aborts all of that
connection's unfinished requests. A client that stops reading for too long is disconnected.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

import msgspec
from msgspec import Meta

from engine.interface import Health
from engine.params import RequestOutput, SamplingParams
from engine.serving.admission import MAX_REQUEST_ID_LEN as _ENGINE_MAX_REQUEST_ID_LEN
from states import State

from .control import CONTROL_REPLIES, CONTROL_REQUESTS, ControlReply, ControlRequest
from .errors import ErrorKind
from .wire_base import MAX_PATH_LEN, CallId, Count, Seconds, Version, _Message

#: Bumped on any incompatible change of the messages below (2: ``RequestOutput``'s logprobs are
#: packed ``Logprobs``; ``Vocabulary`` appended).
PROTOCOL_VERSION = 2
#: Largest frame body (bytes) unless configured otherwise; told in ``Welcome.max_frame``.
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
#: Largest frame the engine accepts before the handshake is done.
HANDSHAKE_MAX_FRAME = 64 * 1024

MAX_REQUEST_ID_LEN = _ENGINE_MAX_REQUEST_ID_LEN  # the engine's own bound
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_PROMPT_TOKENS = 1024 * 1024
MAX_TOKEN_LEN = 1024
MAX_NAME_LEN = 256
MAX_ERROR_MESSAGE_LEN = 8192
MAX_CHAT_TEMPLATE_LEN = 1024 * 1024
MAX_VOCAB = 1 << 21  # tokens in a Vocabulary answer
MAX_PIECE_LEN = 1024  # bytes of one token

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Prompt = Union[
    Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)],
    Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)],
]


# --------------------------------------------------------------------------- client -> engine


class Hello(_Message, tag="Hello"):
    """First frame of every connection (layout frozen across versions)."""

    protocol_version: Version
    token: Optional[Annotated[str, Meta(max_length=MAX_TOKEN_LEN)]] = None
    client_name: Annotated[str, Meta(max_length=MAX_NAME_LEN)] = ""


class Generate(_Message, tag="Generate"):
    """Start a request; its outputs stream back in :class:`Outputs` frames. ``client``: the user
    it is for, as the connection names them (an HTTP frontend: one per API user); absent: the
    connection itself. Each is a client of its own, within this connection."""

    request_id: RequestId
    prompt: Prompt
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    client: Optional[Annotated[str, Meta(max_length=MAX_NAME_LEN)]] = None  # appended


class Abort(_Message, tag="Abort"):
    """End a request early (idempotent); ``reason`` ends up in its last piece's ``reason``."""

    request_id: RequestId
    call_id: Optional[CallId] = None
    reason: Optional[Annotated[str, Meta(max_length=MAX_NAME_LEN)]] = None


class Tokenize(_Message, tag="Tokenize"):
    """Ask for ``text``'s token ids (answered by :class:`Tokens`)."""
    call_id: CallId
    text: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
    add_special_tokens: bool = True


class Detokenize(_Message, tag="Detokenize"):
    """Ask for the text of ``ids`` (``each``: one string per token; ``tokens``, appended: each
    id's vocabulary entry, e.g. "Ġhello")."""
    call_id: CallId
    ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)]
    each: bool = False
    tokens: bool = False


class Vocabulary(_Message, tag="Vocabulary"):
    """Ask for every token's bytes, by id (answered by :class:`Tokens` with ``pieces``)."""
    call_id: CallId


class HealthRequest(_Message, tag="HealthRequest"):
    """Ask for a :class:`Health` snapshot."""

    call_id: Optional[CallId] = None


class Drain(_Message, tag="Drain"):
    """Stop admission; wait up to ``timeout`` s for running requests, abort the rest, shut down."""

    timeout: Seconds = 30.0
    call_id: Optional[CallId] = None


class Shutdown(_Message, tag="Shutdown"):
    """Shut the engine down (running requests are aborted); all connections close after it."""

    call_id: Optional[CallId] = None


class Sleep(_Message, tag="Sleep"):
    """End (``"abort"``) or finish (``"wait"``: until ``timeout`` s, absent = none) the requests
    in flight, free the device (level 1: weights kept in host memory; 2: dropped)."""

    level: Literal[1, 2] = 1
    mode: Literal["abort", "wait"] = "abort"
    timeout: Optional[Seconds] = None
    call_id: Optional[CallId] = None
    tags: Optional[Annotated[list[Literal["weights", "kv_cache"]], Meta(min_length=1, max_length=2)]] = None


class WakeUp(_Message, tag="WakeUp"):
    """Bring back ``tags`` (absent: both); the Ack's ``state`` is "sleeping" after a partial wake."""

    tags: Optional[Annotated[list[Literal["weights", "kv_cache"]], Meta(min_length=1, max_length=2)]] = None
    call_id: Optional[CallId] = None


class UpdateWeights(_Message, tag="UpdateWeights"):
    """Load the checkpoint at ``path`` (on the engine's machine; same architecture, no NUL)."""

    path: Annotated[str, Meta(min_length=1, max_length=MAX_PATH_LEN, pattern="^[^\\x00]+$")]
    call_id: Optional[CallId] = None
    version: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None


# --------------------------------------------------------------------------- engine -> client


class Welcome(_Message, tag="Welcome"):
    """Handshake accepted (layout frozen across versions)."""

    protocol_version: Version
    state: State
    max_frame: Count = DEFAULT_MAX_FRAME
    client_id: Count = 0
    model: Annotated[str, Meta(max_length=MAX_NAME_LEN)] = ""
    # What a client needs to build prompts itself (all optional; absent = unknown):
    # the tokenizer's Jinja chat template and the texts of its BOS / (lowest) EOS tokens, as
    # engine.loader.tokenizer.render_chat_template takes them; the context limit and the vocabulary
    # size (prompt token ids must be < vocab_size; 0 = unknown).
    chat_template: Optional[Annotated[str, Meta(max_length=MAX_CHAT_TEMPLATE_LEN)]] = None
    bos_token: Optional[Annotated[str, Meta(max_length=MAX_NAME_LEN)]] = None
    eos_token: Optional[Annotated[str, Meta(max_length=MAX_NAME_LEN)]] = None
    max_model_len: Count = 0
    vocab_size: Count = 0
    max_logprobs: Optional[Count] = None  # appended; None: an older engine (20)


class Outputs(_Message, tag="Outputs"):
    """All of one connection's output pieces from one engine step."""

    outputs: list[RequestOutput]


class Error(_Message, tag="Error"):
    """A failure (layout frozen across versions).

    ``request_id`` set: that request is finished. ``call_id`` set: the answer to that call.
    ``fatal``: the engine closes the connection right after this frame. ``state``/``trigger``/
    ``allowed`` describe an ``INVALID_TRANSITION``.
    """

    kind: ErrorKind
    message: Annotated[str, Meta(max_length=MAX_ERROR_MESSAGE_LEN)] = ""
    request_id: Optional[RequestId] = None
    call_id: Optional[CallId] = None
    retry_after: Optional[Seconds] = None
    fatal: bool = False
    state: Optional[State] = None
    trigger: Optional[Annotated[str, Meta(max_length=MAX_NAME_LEN)]] = None
    allowed: Optional[Annotated[list[Annotated[str, Meta(max_length=MAX_NAME_LEN)]], Meta(max_length=64)]] = None


class StateChanged(_Message, tag="StateChanged"):
    """The engine's lifecycle moved from ``previous`` to ``state``."""

    state: State
    previous: Optional[State] = None


class Tokens(_Message, tag="Tokens"):
    """The answer to a Tokenize (``ids``) / a Detokenize (``texts``) / a Vocabulary (``pieces``)."""
    call_id: CallId
    ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)] = []
    texts: Annotated[list[str], Meta(max_length=MAX_PROMPT_TOKENS)] = []
    pieces: Annotated[list[Annotated[bytes, Meta(max_length=MAX_PIECE_LEN)]],
                      Meta(max_length=MAX_VOCAB)] = []


class Ack(_Message, tag="Ack"):
    """Completion of a call (Abort, Drain, Sleep, ...) that carried a ``call_id``."""

    call_id: Optional[CallId] = None
    request_id: Optional[RequestId] = None
    state: Optional[State] = None


ClientMessage = Union[Hello, Generate, Abort, HealthRequest, Drain, Shutdown, Sleep, WakeUp, UpdateWeights,
                      Tokenize, Detokenize, Vocabulary, ControlRequest]
EngineMessage = Union[Welcome, Outputs, Health, Error, StateChanged, Ack, Tokens, ControlReply]
Message = Union[ClientMessage, EngineMessage]

CLIENT_MESSAGES: tuple[type, ...] = (Hello, Generate, Abort, HealthRequest, Drain, Shutdown, Sleep,
                                     WakeUp, UpdateWeights, Tokenize, Detokenize, Vocabulary,
                                     *CONTROL_REQUESTS)
ENGINE_MESSAGES: tuple[type, ...] = (Welcome, Outputs, Health, Error, StateChanged, Ack, Tokens,
                                     *CONTROL_REPLIES)
ALL_MESSAGES: tuple[type, ...] = CLIENT_MESSAGES + ENGINE_MESSAGES

#: Kinds after which the engine closes the connection.
FATAL_KINDS = frozenset({ErrorKind.PROTOCOL, ErrorKind.AUTH, ErrorKind.VERSION, ErrorKind.TOO_LARGE})


__all__ = [
    "PROTOCOL_VERSION", "DEFAULT_MAX_FRAME", "HANDSHAKE_MAX_FRAME", "ErrorKind", "FATAL_KINDS",
    "Hello", "Generate", "Abort", "HealthRequest", "Drain", "Shutdown", "Sleep", "WakeUp", "UpdateWeights",
    "Welcome", "Outputs", "Health", "Error", "StateChanged", "Ack",
    "Tokenize", "Detokenize", "Vocabulary", "Tokens",
    "ClientMessage", "EngineMessage", "Message",
    "CLIENT_MESSAGES", "ENGINE_MESSAGES", "ALL_MESSAGES",
    "SamplingParams", "RequestOutput", "State",
]
