"""``Engine``: the one interface every engine satisfies -- the in-process :class:`AsyncEngine`,
the IPC client (``ipc.EngineClient``) and the tests' fake -- so that frontends and the IPC server
take an ``Engine`` and probe nothing.

Also here, because every layer above needs them and they must not drift apart:

* :class:`Health`, the one health snapshot type. It is the wire's ``Health`` message itself
  (``ipc.messages`` puts it in its tagged union), so an engine's answer crosses the socket as is.
* :func:`unavailable_error`, the one function that turns (state, death) into the error a caller
  gets when the engine cannot take a call.
"""

from __future__ import annotations

from typing import (Annotated, AsyncIterator, Callable, NamedTuple, Optional, Protocol, Union,
                    runtime_checkable)

import msgspec
from msgspec import Meta

from states import InvalidTransitionError, State

from .errors import (EngineDeadError, EngineDrainingError, EnginePausedError, EngineShutdownError,
                     EngineSleepingError)
from .params import RequestOutput, SamplingParams

Prompt = Union[str, list[int]]
_Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
MAX_HISTOGRAM_BUCKETS = 64
_Counts = Annotated[list[_Count], Meta(max_length=MAX_HISTOGRAM_BUCKETS)]
_Sum = Annotated[float, Meta(ge=0.0)]


class Health(msgspec.Struct, tag_field="t", tag="Health", forbid_unknown_fields=True,
             omit_defaults=True, kw_only=True, gc=False):
    """A snapshot of the engine's health. ``live``: not dead (also while draining); ``ready``:
    accepting requests (SERVING only). ``call_id`` only correlates the wire's answer."""

    state: State
    live: bool
    ready: bool
    running: _Count = 0
    waiting: _Count = 0
    kv_usage: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    call_id: Optional[_Count] = None
    # Engine counters since it started serving (0 = unknown), for /metrics: steps run, requests
    # preempted, prefix-cache queries and hits (tokens). Then two histograms as per-bucket counts
    # over engine/core/stats.py's fixed bounds (STEP_TIME_BUCKETS, QUEUE_TIME_BUCKETS; the last
    # count is the +Inf bucket; empty = unknown) with their sums in seconds. Appended with
    # defaults (omitted on the wire when unset): a frame without them decodes as before.
    steps: _Count = 0
    preemptions: _Count = 0
    prefix_cache_queries: _Count = 0
    prefix_cache_hits: _Count = 0
    step_time_counts: _Counts = []
    step_time_sum: _Sum = 0.0
    queue_time_counts: _Counts = []
    queue_time_sum: _Sum = 0.0
    # Then more, the same way (engine/core/stats.py's histogram_bounds): per finished request,
    # its prefill, decode and running times, prefill time per prompt token and prompt tokens
    # computed (not from the prefix cache); tokens per step. Speculative decoding: drafts
    # verified, draft tokens, accepted ones and, by draft position, drafts that accepted it
    # (empty without a speculator). ``sleep_level``: 1 or 2 while SLEEPING, else 0.
    prefill_time_counts: _Counts = []
    prefill_time_sum: _Sum = 0.0
    decode_time_counts: _Counts = []
    decode_time_sum: _Sum = 0.0
    inference_time_counts: _Counts = []
    inference_time_sum: _Sum = 0.0
    prefill_token_time_counts: _Counts = []
    prefill_token_time_sum: _Sum = 0.0
    prefill_computed_counts: _Counts = []
    prefill_computed_sum: _Sum = 0.0
    iteration_tokens_counts: _Counts = []
    iteration_tokens_sum: _Sum = 0.0
    spec_drafts: _Count = 0
    spec_draft_tokens: _Count = 0
    spec_accepted_tokens: _Count = 0
    spec_accepted_per_pos: _Counts = []
    sleep_level: Annotated[int, Meta(ge=0, le=2)] = 0
    # the engine runs in deterministic mode (EngineConfig.deterministic)
    deterministic: bool = False


class TokenizerInfo(NamedTuple):
    """What a client needs to build prompts itself (absent = unknown): the Jinja chat template
    and the texts of the BOS / (lowest) EOS tokens, as ``engine.loader.tokenizer.render_chat_template``
    takes them, and the vocabulary size (prompt token ids must be below it; 0 = unknown)."""

    chat_template: Optional[str] = None
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    vocab_size: int = 0
    max_logprobs: int = 20  #: the most top logprobs a request may ask for per token


def unavailable_error(state: State, call: str, death: Optional[BaseException] = None,
                      message: Optional[str] = None) -> Exception:
    """The error for ``call`` on an engine in ``state`` that cannot take it (``death``: why it
    failed, if it did). Draining, sleeping and paused are retryable; shut down and dead are final."""
    if death is not None or state is State.FAILED:
        return EngineDeadError(message or "engine is dead", death)
    if state is State.DRAINING:
        return EngineDrainingError()
    if state is State.SLEEPING:
        return EngineSleepingError(f"engine is sleeping; {call}() is not possible until wake_up()")
    if state is State.PAUSED:
        return EnginePausedError(f"engine is paused; {call}() is not possible until resume()")
    if state is State.SHUTDOWN:
        return EngineShutdownError(f"engine is shut down; {call}() is not possible")
    return InvalidTransitionError(state, call, ["serving"])


@runtime_checkable
class RequestStreamLike(Protocol):
    """What ``generate`` returns: one request's outputs. Leaving it early aborts the request."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """The engine's surface, in process and over the wire.

    ``generate`` submits at once and raises what it can tell at once (bad input, not serving);
    the stream raises what the engine refuses later, at the latest on its first ``__anext__``.
    Every accepted request gets exactly one terminal output or an error.
    """

    @property
    def state(self) -> State: ...

    @property
    def model(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                 request_id: Optional[str] = None, *, client: str = "") -> RequestStreamLike:
        """``client``: who the request is for ("": the caller's own); waiting requests are
        admitted round-robin across clients, each within its share of the admission limits."""

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None: ...

    async def health(self) -> Health: ...

    async def drain(self, timeout: Optional[float] = None) -> None: ...

    async def shutdown(self) -> None: ...

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  **options) -> str:
        """``messages`` rendered with the model's chat template; ``options``: ``tools``,
        ``documents``, ``continue_final_message``, ``template_kwargs``
        (``engine.loader.tokenizer.render_chat_template``)."""
        ...

    def tokenizer_info(self) -> TokenizerInfo:
        """The tokenizer's description (all unknown until the model is loaded)."""
        ...

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, as a prompt would have them."""
        ...

    async def detokenize(self, ids: list[int], each: bool = False,
                         tokens: bool = False) -> list[str]:
        """``[the text of ids]``, or with ``each`` one string per token, or with ``tokens`` each
        id's vocabulary entry (as the tokenizer spells it, e.g. "Ġhello")."""
        ...

    async def token_bytes(self) -> list[bytes]:
        """Every token's bytes, by id (what logprobs' token ids are shown with)."""
        ...

    def on_state_change(self, listener: Callable[[State, State], None]) -> None: ...

    async def wait_stopped(self) -> None: ...

    # sleep mode (engine/serving/sleep.py); update_weights_from_tensors is in-process only
    async def sleep(self, level: int = 1, mode: str = "abort", timeout: Optional[float] = None,
                    tags: Optional[list[str]] = None) -> None: ...

    async def wake_up(self, tags: Optional[list[str]] = None) -> None: ...

    @property
    def is_sleeping(self) -> bool: ...

    async def update_weights(self, path: str, version: Optional[int] = None) -> None: ...

    # RL loops: pause (engine/serving/pause.py), weights from a trainer (engine/serving/transfer.py)
    async def pause(self, mode: str = "abort", timeout: Optional[float] = None) -> None: ...

    async def resume(self) -> None: ...

    def is_paused(self) -> bool: ...

    async def abort_all(self, reason: str = "abort_all") -> int: ...

    async def init_weight_transfer(self, backend: str, address: str, port: int, rank: int,
                                   world_size: int, timeout: float = 300.0) -> None: ...

    async def update_weights_from_distributed(self, metadata, version: Optional[int] = None,
                                              bucket_bytes: int = 256 * 2**20) -> None: ...

    async def update_weights_from_ipc(self, handles, version: Optional[int] = None) -> None: ...

    async def close_weight_transfer(self) -> None: ...


__all__ = ["Engine", "Health", "Prompt", "RequestStreamLike", "TokenizerInfo", "unavailable_error"]
