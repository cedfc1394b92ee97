"""``Request``: one request's whole state on the engine side (tokens, progress, blocks)."""

from __future__ import annotations

import enum
import time
from typing import Optional

from .params import SamplingParams


#: The client of a request whose caller named none: every in-process caller by default. The
#: scheduler admits waiting requests round-robin across clients (engine/core/waiting.py); the IPC
#: server names each connection (and each user an HTTP frontend names) a client of its own.
DEFAULT_CLIENT = ""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    __slots__ = (
        "request_id", "params", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "block_ids", "status", "arrival", "finish_reason", "reason", "detok", "spec_token_ids",
        "num_preemptions", "first_token_time", "num_cached_tokens",
        "stop_ids", "sampling_row",
        "num_sealed_blocks", "block_hashes", "hash_root", "cache_epoch", "first_scheduled",
        "prompt_lps", "num_prompt_lps", "prompt_sent", "bad_words", "matcher",
        "pending", "pending_row", "hold", "overlappable", "token_limit",
        "block_epoch", "block_mirror", "client", "num_cached_tokens",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 client: str = DEFAULT_CLIENT):
        self.request_id = request_id
        self.client = client  # whose request it is: the scheduler's waiting queue is per client
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of its prompt, found in the prefix cache when first admitted
        self.block_ids: list[int] = []  # written only by the BlockManager
        # bumped by the BlockManager at every change of block_ids other than blocks added at
        # the end: host_arrays.block_table's int32 mirror of them is current while it holds
        self.block_epoch = 0
        self.block_mirror = None  # (epoch, count, buffer, view): host_arrays.block_table's
        self.num_sealed_blocks = 0  # leading block_ids that are full, computed and read-only
        self.block_hashes: list[bytes] = []  # chained hashes of full token blocks (memo)
        self.hash_root: Optional[bytes] = None  # the root block_hashes were computed from
        self.cache_epoch = -1  # the prefix cache's epoch when the blocks were taken
        self.status = Status.WAITING
        self.arrival = time.monotonic()
        self.finish_reason: Optional[str] = None
        self.reason: Optional[str] = None
        self.detok = None  # IncrementalDetokenizer, set by the engine core
        self.spec_token_ids: list[int] = []  # proposed draft tokens for this step
        self.num_preemptions = 0
        self.first_token_time: Optional[float] = None
        self.first_scheduled: Optional[float] = None  # monotonic time it was first scheduled
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at its first admission
        self.stop_ids = frozenset(params.stop_token_ids)
        self.bad_words: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences
        # prompt_logprobs: the rows (engine.params.Logprobs) of prompt positions 1.., one chunk
        # per prefill step that computed some, and how many rows; sent on the first output
        self.prompt_lps: list = []
        self.num_prompt_lps = 0
        self.prompt_sent = False
        # (temperature, top_k, top_p) as the sampler's tensors take them; set by the runner
        # when the request is admitted (ModelRunner.admit)
        self.sampling_row: tuple[float, int, float] = (0.0, 0, 1.0)
        # with params.structured: its grammar matcher (engine/structured/matcher.py), owned
        # here and gone with the request
        self.matcher = None
        # overlapped scheduling (EngineCore): 1 while the token sampled for this request in
        # the step in flight is still on the device (row ``pending_row`` of the runner's
        # sampled-token buffer), not yet in ``token_ids``; ``hold``: that token is certain to
        # be its last (a length limit), so it is not scheduled again
        self.pending = 0
        self.pending_row = -1
        self.hold = False
        # whether the next step may be scheduled before this one's token is known on the host:
        # nothing that reads its tokens on the host or on the device before sampling (an
        # output constraint's mask needs its matcher to have taken the last token, but only
        # for the sampling: EngineCore.step launches the forward first and samples later)
        self.overlappable = not params.needs_logits_processing and params.max_tokens > 0
        # below this many tokens no length limit can end it (EngineCore._length_limit; set by
        # the engine core when it adds the request: 0 = always check)
        self.token_limit = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Its tokens, counting one still in flight (overlapped scheduling)."""
        return len(self.token_ids) + self.pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed (no cached prefix)."""
        return self.params.prompt_logprobs is not None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
