"""Argument parsing shared by the entry points: the model/engine flags and the config they make."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Mapping, Optional

import msgspec

from engine.config import EngineConfig
from ipc.auth import TOKEN_ENV, read_token_file, warn_if_short

log = logging.getLogger("enginecore")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help='"default" (embedded SmolLM2-135M), a HF repo id from the local cache, a HF '
                        'checkpoint dir, a .gguf, or random:<preset>')
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a HF repo id (default: main); never downloads")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto",
                   help='"auto" (bfloat16 on cuda; on cpu the fastest weight format for this CPU, '
                        'logged), float32, bfloat16, float16')
    p.add_argument("--cpu-weights", default="auto", choices=["auto", "float", "woq", "fbgemm_fp16"],
                   help="CPU weight format for quantized GGUF checkpoints (auto: the fastest for this "
                        "CPU when --dtype is auto; float: dequantized, today's exact path)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op CPU threads (default: $OMP_NUM_THREADS, else the CPUs this "
                        "process may use, by affinity and cgroup quota, less one; without a quota "
                        "the engine then follows the machine: as many CPUs as other processes "
                        "leave free, up to all of them)")
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV cache of earlier prompts' full blocks")
    p.add_argument("--no-freeze-gc", dest="freeze_gc", action="store_false",
                   help="leave the garbage collector walking the startup heap (by default it is "
                        "frozen after the load, so full collections skip the model's objects)")
    p.add_argument("--gc-young-threshold", type=int, default=2_000,
                   help="while serving (with the freeze; ignored with --no-freeze-gc), the "
                        "garbage collector's youngest generation threshold: at CPython's 700 a "
                        "young collection ran nearly every decode step; 0, or a value below the "
                        "interpreter's, leaves it as it is")
    p.add_argument("--step-burst-ms", type=float, default=50.0,
                   help="run steps back to back on the step thread for up to this long while the "
                        "event loop has nothing for the engine (0: a round trip through the loop "
                        "after every step)")
    p.add_argument("--grammar-row-budget-ms", type=float, default=10.0,
                   help="the most CPU ms one constrained request's grammar work (its mask fill, "
                        "or its token's accept) may take in a step; over it the request ends with "
                        "finish_reason error (0: no limit)")
    p.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step before this one's tokens are read back "
                        "(default: on CUDA only)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="warm up at load, before ready: real steps and every decode graph "
                        "(default: on CUDA only)")
    p.add_argument("--speculator", choices=["none", "ngram", "draft"], default="none")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most top logprobs one request may ask for per token (400 beyond)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks to shard the model over (this process is rank 0; the others are "
                        "worker processes, gloo on CPU, NCCL on CUDA)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts the ranks span (multi-host TP)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's index: 0 runs the engine, others only start their ranks")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="address of node 0, where the ranks connect (multi-host: a routable one)")
    p.add_argument("--master-port", type=int, default=0,
                   help="node 0's control port (the process group's store uses PORT+1; 0: any "
                        "free port, one host only)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic mode: a request's tokens and logprobs are bitwise the same "
                        "whatever the batch, the prefix cache or the schedule (batch-invariant "
                        "forward; float weights; slower: docs/deterministic.md)")
    p.add_argument("--config-json", default=None, help="a whole EngineConfig as JSON (overrides the flags)")


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    adaptive = getattr(a, "cpu_threads_max", None)  # entrypoints/cli.py: the default thread count
    if a.config_json:
        cfg = msgspec.json.decode(a.config_json, type=EngineConfig)
        if cfg.cpu_threads_max is None and adaptive is not None:
            cfg = msgspec.structs.replace(cfg, cpu_threads_max=adaptive)
        return cfg
    return EngineConfig(cpu_threads_max=adaptive,
        model=a.model, revision=a.revision, device=a.device, dtype=a.dtype, cpu_weights=a.cpu_weights,
        kv_cache_bytes=a.kv_cache_bytes,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len, enable_prefix_caching=a.enable_prefix_caching,
        overlap_scheduling=a.overlap_scheduling, warmup=a.warmup, speculator=a.speculator,
        num_speculative_tokens=a.num_speculative_tokens, draft_model=a.draft_model,
        max_logprobs=a.max_logprobs, tensor_parallel_size=a.tensor_parallel_size,
        nnodes=a.nnodes, node_rank=a.node_rank, master_addr=a.master_addr,
        master_port=a.master_port, freeze_gc=a.freeze_gc, gc_young_threshold=a.gc_young_threshold,
        step_burst_ms=a.step_burst_ms, grammar_row_budget_ms=a.grammar_row_budget_ms,
        deterministic=a.deterministic,
    )


def add_ops_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s operator flags: the names the HTTP API serves the model under, the stats line."""
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) the HTTP API serves the model under (the first is the one "
                        "responses report; `default` stays an alias; default: the HF repo id or "
                        "the checkpoint's name)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, running/waiting, KV usage)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between stats lines (default 10)")


def add_token_args(p: argparse.ArgumentParser) -> None:
    """The shared secret: ``--token-file`` or ``$TOKEN_ENV`` (``--token`` still works,
    but argv is visible to every local user)."""
    p.add_argument("--token-file", default=None,
                   help=f"file holding the shared secret (mode 0600); or set ${TOKEN_ENV}")
    p.add_argument("--token", default=None,
                   help=f"the shared secret on the command line (visible to other users: prefer "
                        f"--token-file or ${TOKEN_ENV})")


def add_listen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-ipc-connections", type=int, default=256,
                   help="IPC connections at once, handshaken or not (more are refused)")


def token_from_args(a: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The token from ``--token-file``, else ``$TOKEN_ENV``, else ``--token`` (with a
    warning); None if none is given. Raises ``OSError``/``ValueError`` for a bad token file."""
    token = None
    if a.token_file:
        token = read_token_file(a.token_file)
    elif environ.get(TOKEN_ENV, "").strip():
        token = environ[TOKEN_ENV].strip()
    elif a.token:
        log.warning("--token is visible to every local user (ps, /proc/PID/cmdline); "
                    "use --token-file or $%s", TOKEN_ENV)
        token = a.token
    warn_if_short(token)
    return token
