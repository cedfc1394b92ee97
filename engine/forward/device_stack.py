"""``device_stack``: what a model needs on the device besides its weights -- the paged KV cache,
the persistent step-input buffers and (CUDA) the decode graphs -- built the same way for the
runner's target model and the draft speculator's model."""

from __future__ import annotations

from typing import Iterator, Union

import torch

from engine.kv.kv_cache import KVCache
from engine.memory.owner import Resource

from . import cuda_graphs
from .model_state import ModelState

Part = Union[KVCache, ModelState, "cuda_graphs.CudaGraphs"]


def device_stack(model_config, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, use_graphs: bool, max_tokens: int, max_rows: int,
                 max_model_len: int, mixed_graphs: bool = True) -> Iterator[tuple[Resource, Part]]:
    """Yield ``(Resource.KV_CACHE, KVCache)``, ``(Resource.MODEL_STATE, ModelState)`` and, with
    ``use_graphs``, ``(Resource.CUDA_GRAPHS, CudaGraphs)``, in creation order, each as soon as it
    exists: the caller adopts each before the next is allocated, so a failure part way
    releases what was made. ``max_rows``: rows (sequences) one step may carry.
    ``mixed_graphs``: the graphs may replay prompt steps too (``EngineConfig.mixed_cuda_graphs``;
    the runner captures them at load, engine/forward/mixed_inputs.py)."""
    # with CUDA graphs, one extra block (the last) is the scratch block padded rows write to
    yield Resource.KV_CACHE, KVCache(num_layers=model_config.num_layers,
                              num_blocks=num_blocks + int(use_graphs), block_size=block_size,
                              num_kv_heads=model_config.num_kv_heads,
                              head_dim=model_config.head_dim, dtype=dtype, device=device)
    width = -(-max_model_len // block_size) + 1
    yield Resource.MODEL_STATE, ModelState(max_tokens=max_tokens, max_seqs=max_rows,
                                    max_blocks_per_seq=width, device=device)
    if use_graphs:  # after model_state, so that it is released first
        yield Resource.CUDA_GRAPHS, cuda_graphs.CudaGraphs(
            max_num_seqs=max_rows, scratch_block=num_blocks, block_size=block_size, device=device,
            max_tokens=max_tokens, table_width=width,
            mixed=mixed_graphs)
