"""Tensor parallelism over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

The engine process is rank 0, the *driver*: it schedules, samples and owns the lifecycle. Ranks
1..N-1 are *workers* (``entrypoints/tp_worker.py``), plain subprocesses (or started by ``enginecore serve
--node-rank R`` on other hosts) that hold one shard each and replay the driver's forward:

* :mod:`.shard`   -- which dimension of which weight each rank holds; divisibility checks;
* :mod:`.layers`  -- row-parallel linears and the vocab-parallel embedding / LM head;
* :mod:`.channel` -- the msgspec control channel (handshake, step inputs, reports; no pickle);
* :mod:`.group`   -- the driver's side: start, rendezvous, per-step send, death watch, teardown;
* :mod:`.control` -- sleep, wake and weight updates across the ranks (one frame, every answer);
* :mod:`.update`  -- a weight update's bytes over the process group, each rank keeping its slice;
* ``entrypoints/tp_worker.py`` -- a worker's main loop (a process entry point);

TP=1 never imports this package: the single-device path is today's code, unchanged.
"""
