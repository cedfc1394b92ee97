"""``enginecore serve --node-rank R`` (R > 0): a host of a multi-host tensor-parallel engine
runs only its ranks -- ``tensor_parallel_size / nnodes`` worker processes, ranks
``R * k .. R * k + k - 1`` on local devices ``0 .. k - 1``, each connecting to the driver at
``master_addr:master_port`` (the same code path as the driver's local workers). It exits when
they have: 0 if every rank shut down cleanly, else the worst code (2: a load failed).
Its ranks watch it (their parent) as local ranks watch the driver."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from engine import envs
from engine.tp.group import _pythonpath

log = logging.getLogger("enginecore.tp")


def run_node(config) -> int:
    k = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * k
    if not os.environ.get(envs.TP_TOKEN):
        print(f"enginecore: multi-host tensor parallel needs the same ${envs.TP_TOKEN} on "
              "every host", file=sys.stderr)
        return 2
    # the driver stops every rank; a signal here must not take ranks away under a drain
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "entrypoints.tp_worker", "--connect",
         f"{config.master_addr}:{config.master_port}", "--rank", str(first + i),
         "--local-rank", str(i), "--parent-pid", str(os.getpid())],
        env=env, stdin=subprocess.DEVNULL) for i in range(k)]
    log.info("node %d: ranks %d..%d started, connecting to %s:%d", config.node_rank, first,
             first + k - 1, config.master_addr, config.master_port)
    codes = [p.wait() for p in procs]
    return max(codes, key=lambda c: (c != 0, abs(c)))
