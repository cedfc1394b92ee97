"""``EngineConfig``: everything that shapes one engine. A msgspec Struct so it crosses process
boundaries as JSON (``enginecore serve --config-json``)."""

from __future__ import annotations

from typing import Literal, Optional

import msgspec
import torch

from .errors import BadRequestError

#: the CPU weight formats ``cpu_weights`` may name (engine/model/cpu_weights.py runs them)
CPU_WEIGHT_FORMATS = ("auto", "float", "woq", "fbgemm_fp16")


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # what to serve: "default" (the embedded SmolLM2-135M-Instruct GGUF), a checkpoint directory
    # (config.json + safetensors + tokenizer.json), a .gguf file, "random:<preset>" (random
    # weights of a real architecture's shape), or a Hugging Face repo id from the local cache
    model: str = "default"
    revision: Optional[str] = None  # of a Hugging Face repo id from the local cache (default main)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    # "auto" = bfloat16 on cuda, float32 on cpu -- except a float checkpoint (safetensors, an
    # unquantized GGUF) on a CPU with AVX512-BF16: bfloat16 (cpu_weights.checkpoint_dtype)
    dtype: str = "auto"
    # CPU weight format (engine/model/cpu_weights.py): "auto" = the fastest packed format for this CPU
    # when dtype is "auto" and the checkpoint is a quantized GGUF, else "float" (dequantized)
    cpu_weights: str = "auto"
    seed: int = 0  # for random: presets' weights and unseeded sampling
    block_size: int = 16  # tokens per paged KV-cache block (a power of two)
    num_kv_blocks: Optional[int] = None  # KV-cache blocks; overrides kv_cache_bytes
    kv_cache_bytes: Optional[int] = None  # default: 512 MiB on cpu, 40% of free memory on cuda
    max_num_seqs: int = 256  # requests running at once (a step's rows)
    # tokens one step may compute (prompt chunks plus one per decode row): the prefill chunk size
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None  # default: the model's context, capped at 8192
    enable_prefix_caching: bool = True  # reuse the K/V of full blocks of earlier prompts
    # speculative decoding (engine/spec_decode/): "ngram" looks the next tokens up in the
    # request's own tokens, "draft" asks a smaller model of the same vocabulary
    speculator: Literal["none", "ngram", "draft"] = "none"
    num_speculative_tokens: int = 4  # tokens proposed a step (k)
    ngram_min: int = 1  # the shortest suffix the n-gram speculator matches
    ngram_max: int = 4  # the longest
    draft_model: Optional[str] = None  # the draft speculator's model (as ``model``)
    # Engine-wide admission limits (beyond them: EngineOverloadedError, retryable): requests
    # accepted but not yet running, and prompt tokens held by unfinished requests.
    max_waiting_requests: int = 4096
    max_queued_tokens: int = 4 * 1024 * 1024
    #: while PAUSED (``AsyncEngine.pause``), refuse new requests (the retryable
    #: EnginePausedError) instead of queueing them until ``resume()``
    reject_while_paused: bool = False
    # One client's share of them (a client: an IPC connection, or one user of an HTTP frontend;
    # in-process callers that name none share the default client, which has no share): beyond
    # it, that client alone is refused. Waiting requests are admitted round-robin across clients.
    max_waiting_per_client: int = 1024
    max_queued_tokens_per_client: int = 1024 * 1024
    #: the most top logprobs (and prompt logprobs) one request may ask for per token
    max_logprobs: int = 20
    # Tensor parallelism (engine/tp/): ranks in all, hosts they span, this host's index, and
    # where rank 0 (this engine process) listens for the others: its control channel on
    # master_port (0: any free port, one host only) and the process group's store on +1.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # Structured outputs (engine/structured/): a constraint that does not compile within this
    # many seconds is refused (400) and its compile stopped; compiled grammars are cached,
    # bounded in entries and bytes.
    grammar_compile_timeout: float = 10.0
    grammar_cache_entries: int = 256
    grammar_cache_bytes: int = 512 * 2**20
    # the most CPU milliseconds one constrained request's grammar work may take in one step
    # (its mask fill, or its token's accept; engine/structured/budget.py): a request over it
    # ends with finish_reason "error", so an ambiguous grammar whose work grows with its output
    # cannot hold every other request's step back. Measured on the default model's 49k-token
    # vocabulary: JSON schemas, JSON objects, regexes and a small EBNF at most 0.24 ms a row
    # (random trajectories, mean 25-60 us); an ambiguous grammar 9 ms by its 5th token, 14 ms
    # by its 6th and 2 s by its 31st. 0: no limit.
    grammar_row_budget_ms: float = 10.0
    # At most this many grammar compiles at once, each a process forked from the compile
    # server (engine/structured/compile_worker.py: started on the first compile, ~280 MB).
    grammar_compile_workers: int = 2
    cuda_graphs: bool = True  # capture decode-only steps as CUDA graphs (CUDA + Triton only)
    # with cuda_graphs, steps with prompt tokens too: a graph per row count up to
    # max_num_batched_tokens, captured at load (an eager prompt step costs the host ~300
    # kernel launches; engine/forward/mixed_inputs.py)
    mixed_cuda_graphs: bool = True
    # warm up at load, before the engine says ready (engine/core/warmup.py): a few real steps
    # (a long prompt, decodes, each sampler and logprobs path), the LM head at every row count
    # up to max_num_seqs (a kernel's first launch waits for the device) and, with cuda_graphs,
    # every decode batch bucket captured, so that the first requests compile and capture nothing.
    # None: on CUDA only (a CPU compiles nothing on first use; its one-request warm-up still
    # cost 0.3-0.6 s of startup, measured, which tests that open many engines would pay)
    warmup: Optional[bool] = None
    # schedule and launch step N+1 before step N's tokens are read back (engine/core/engine_core.py): the
    # host's stop checks, detokenization and outputs of N run while the device runs N+1.
    # None: on CUDA only (a CPU executes each op as it is called: nothing to overlap with, and
    # the deferred bookkeeping cost ~10 % of CPU throughput, measured)
    overlap_scheduling: Optional[bool] = None
    # CPU: intra-op threads that follow the machine, between 1 and this many (engine/serving/cpu_threads.py
    # ThreadGovernor: as many as the CPUs other processes leave free). Process-wide state: None
    # leaves torch's count alone; entry points set it when the count is their default.
    cpu_threads_max: Optional[int] = None
    # after a load, keep the cyclic garbage collector off the startup heap (gc.freeze; thawed
    # at shutdown): a full collection then walks only what serving allocates, not the model's
    # and torch's objects (a 142 ms pause measured otherwise). engine/runner/gc_freeze.py
    freeze_gc: bool = True
    # with freeze_gc, the youngest generation's collection threshold while serving (CPython's
    # 700 made a young collection nearly every decode step: ~6 % of a host-bound run's wall,
    # measured); 0 leaves the interpreter's, and so does a value below it (never lowered).
    # engine/runner/gc_freeze.py
    gc_young_threshold: int = 2_000
    # AsyncEngine: steps run back to back on the step thread for up to this long while the
    # event loop has nothing for the core (no adds or aborts, no transition): a round trip
    # through the loop between two steps cost 4-5 % of a decode step on the H200
    # (AsyncEngine._burst). It bounds how long a cancellation of the loop waits. 0: a round
    # trip after every step.
    step_burst_ms: float = 50.0
    # deterministic mode (docs/deterministic.md): every op of the forward, the LM head and the
    # logprobs batch-invariant (engine/model/invariant.py), so a request's tokens and logprobs
    # are bitwise the same alone or in any batch, with or without a cached prefix, chunked
    # prefill, preemption or overlap. On the CPU: float weights (no packed format), the plain
    # forward, a fixed intra-op thread count; on CUDA: its own Triton GEMM and attention beside
    # the per-row fused kernels, CUDA graphs as usual. Costs throughput (docs/deterministic.md
    # says how much: 0.68x on an H100).
    deterministic: bool = False

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def warms_up(self) -> bool:
        """Whether a load warms up (``warmup``; None: on CUDA)."""
        return self.resolved_device().type == "cuda" if self.warmup is None else self.warmup

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        try:
            return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[self.dtype]
        except KeyError:
            raise BadRequestError(f"unknown dtype {self.dtype!r}") from None

    def validate(self) -> "EngineConfig":
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise BadRequestError("block_size must be a power of two")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise BadRequestError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if min(self.max_waiting_requests, self.max_queued_tokens, self.max_waiting_per_client,
               self.max_queued_tokens_per_client) < 1:
            raise BadRequestError("max_waiting_requests, max_queued_tokens and their per-client "
                                  "shares must be >= 1")
        if self.speculator == "draft" and not self.draft_model:
            raise BadRequestError("speculator 'draft' needs draft_model")
        if not (1 <= self.ngram_min <= self.ngram_max <= 16):
            raise BadRequestError("need 1 <= ngram_min <= ngram_max <= 16")
        if not (1 <= self.num_speculative_tokens <= 16):
            raise BadRequestError("num_speculative_tokens must be in [1, 16]")
        if self.cpu_threads_max is not None and not (1 <= self.cpu_threads_max <= 4096):
            raise BadRequestError("cpu_threads_max must be in [1, 4096]")
        if not (0 <= self.max_logprobs <= 1024):
            raise BadRequestError("max_logprobs must be in [0, 1024]")
        if not (0 < self.grammar_compile_timeout <= 3600):
            raise BadRequestError("grammar_compile_timeout must be in (0, 3600] seconds")
        if not 0 <= self.gc_young_threshold <= 10_000_000:
            raise BadRequestError("gc_young_threshold must be in [0, 10000000]")
        if not 0 <= self.step_burst_ms <= 10_000:
            raise BadRequestError("step_burst_ms must be in [0, 10000]")
        if not 0 <= self.grammar_row_budget_ms <= 60_000:
            raise BadRequestError("grammar_row_budget_ms must be in [0, 60000]")
        if not 1 <= self.grammar_compile_workers <= 64:
            raise BadRequestError("grammar_compile_workers must be in [1, 64]")
        if self.grammar_cache_entries < 0 or self.grammar_cache_bytes < 0:
            raise BadRequestError("grammar_cache_entries and grammar_cache_bytes must be >= 0")
        self._validate_tp()
        self.resolved_dtype()
        if self.deterministic and self.cpu_weights not in ("auto", "float"):
            raise BadRequestError(f"deterministic mode runs float weights: cpu_weights "
                                  f"{self.cpu_weights!r} is not batch-invariant")
        if self.cpu_weights not in CPU_WEIGHT_FORMATS:
            raise BadRequestError(f"unknown cpu_weights {self.cpu_weights!r}; "
                                  f"one of {', '.join(CPU_WEIGHT_FORMATS)}")
        return self

    def _validate_tp(self) -> None:
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if not (1 <= tp <= 512):
            raise BadRequestError("tensor_parallel_size must be in [1, 512]")
        if not (1 <= nodes <= tp) or tp % nodes:
            raise BadRequestError(f"nnodes ({nodes}) must divide tensor_parallel_size ({tp})")
        if not (0 <= self.node_rank < nodes):
            raise BadRequestError(f"node_rank must be in [0, nnodes) = [0, {nodes})")
        if not (0 <= self.master_port <= 65534):
            raise BadRequestError("master_port must be in [0, 65534] (the store uses port + 1)")
        if nodes > 1 and not self.master_port:
            raise BadRequestError("with nnodes > 1, give master_addr and master_port")
        if tp == 1:
            return
        if self.speculator != "none":
            raise BadRequestError("speculative decoding is not supported with "
                                  "tensor_parallel_size > 1")
        if self.cpu_weights not in ("auto", "float"):
            raise BadRequestError("with tensor_parallel_size > 1 the weights stay float: "
                                  f"cpu_weights {self.cpu_weights!r} is not supported")
