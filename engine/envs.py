"""Every ``ENGINECORE_*`` environment variable, in one place.

What a user chooses is an :class:`~engine.config.EngineConfig` field (or a command-line flag).
The environment keeps only what must not travel in a config or on a command line -- secrets --
and kill switches: a way to turn one of our own kernels or helpers off on a machine where it
misbehaves, without a new release. Nothing here is read at import: :func:`switches` is called
when an engine (or a worker, or a frontend) is built, and the object built keeps what it read.
``docs/configuration.md`` is generated from :data:`VARIABLES` (a test keeps it current).
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple, Optional


class EnvVar(NamedTuple):
    name: str
    default: str
    kind: str  # "secret", "kill switch" or "operations"
    doc: str


TOKEN = "ENGINECORE_TOKEN"
TP_TOKEN = "ENGINECORE_TP_TOKEN"
TP_TIMEOUT_S = "ENGINECORE_TP_TIMEOUT_S"
TP_LOG_LEVEL = "ENGINECORE_TP_LOG_LEVEL"
TRITON = "ENGINECORE_TRITON"
FUSED = "ENGINECORE_FUSED"
CPU_EXT = "ENGINECORE_CPU_EXT"
GRAMMAR_WORKER = "ENGINECORE_GRAMMAR_WORKER"
MALLOC_TUNING = "ENGINECORE_MALLOC_TUNING"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(TOKEN, "", "secret",
           "The shared secret IPC clients and the HTTP admin endpoints must present (when there "
           "is no `--token-file`). Read once by `enginecore serve`, then removed from its "
           "environment; children get it only when meant to."),
    EnvVar(TP_TOKEN, "", "secret",
           "The secret every rank of a multi-host tensor-parallel engine presents to the driver "
           "(the same on every host)."),
    EnvVar(TP_TIMEOUT_S, "30", "operations",
           "Seconds a tensor-parallel collective may wait before it raises on every rank."),
    EnvVar(TP_LOG_LEVEL, "WARNING", "operations",
           "Log level of tensor-parallel worker processes."),
    EnvVar(TRITON, "1", "kill switch",
           "`0`: no Triton kernel anywhere (attention, fused decoder ops, the one-pass sampler, "
           "the grammar mask kernel) and so no CUDA graphs: the plain torch path."),
    EnvVar(FUSED, "1", "kill switch",
           "`0`: the fused decoder kernels (residual + RMSNorm, SiLU x mul, q/k norm + rotary + "
           "KV write), fused q/k/v and gate/up linears and the one-pass sampler off; the "
           "attention kernels stay."),
    EnvVar(CPU_EXT, "1", "kill switch",
           "`0`: the CPU C++ extensions (packed 4-bit matmul, the one-call decode step, "
           "deterministic mode's attention) are neither built nor used: torch's kernels and the "
           "Python step run."),
    EnvVar(GRAMMAR_WORKER, "1", "kill switch",
           "`0`: the native grammar worker is neither built nor used: a constrained step's "
           "grammar work runs on the step thread."),
    EnvVar(MALLOC_TUNING, "1", "kill switch",
           "`0`: the HTTP frontends keep glibc's malloc defaults (no single arena, no trims)."),
)
_DEFAULTS = {v.name: v.default for v in VARIABLES}


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """The variable's value now (its documented default when unset). Only names declared in
    :data:`VARIABLES` may be asked for."""
    if name not in _DEFAULTS:
        raise KeyError(f"{name} is not declared in engine/envs.py")
    env = os.environ if environ is None else environ
    return env.get(name, _DEFAULTS[name])


def on(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A kill switch's state: anything but ``0`` leaves the part on."""
    return get(name, environ).strip() != "0"


class Switches(NamedTuple):
    """The kill switches as one engine reads them when it is built."""
    triton: bool = True
    fused: bool = True
    cpu_ext: bool = True
    grammar_worker: bool = True


def switches(environ: Optional[Mapping[str, str]] = None) -> Switches:
    triton = on(TRITON, environ)
    return Switches(triton=triton, fused=triton and on(FUSED, environ),
                    cpu_ext=on(CPU_EXT, environ), grammar_worker=on(GRAMMAR_WORKER, environ))


def tp_timeout_s(environ: Optional[Mapping[str, str]] = None) -> float:
    value = get(TP_TIMEOUT_S, environ)
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TP_TIMEOUT_S} must be a number of seconds, not {value!r}") from None
    if not 0 < seconds <= 3600:
        raise ValueError(f"{TP_TIMEOUT_S} must be in (0, 3600] seconds, not {value!r}")
    return seconds


__all__ = ["EnvVar", "VARIABLES", "Switches", "switches", "get", "on", "tp_timeout_s", "TOKEN",
           "TP_TOKEN", "TP_TIMEOUT_S", "TP_LOG_LEVEL", "TRITON", "FUSED", "CPU_EXT",
           "GRAMMAR_WORKER", "MALLOC_TUNING"]
