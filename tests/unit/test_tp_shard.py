"""engine/tp/shard.py: which slice of each weight a rank keeps, and the shape check."""

from __future__ import annotations

import pytest
import torch

from engine.errors import CheckpointError
from engine.tp.shard import ShardedTensors, shard_dim


def test_shard_dims() -> None:
    assert shard_dim("model.layers.0.self_attn.q_proj.weight") == 0
    assert shard_dim("model.layers.0.self_attn.k_proj.bias") == 0
    assert shard_dim("model.layers.3.mlp.up_proj.weight") == 0
    assert shard_dim("model.embed_tokens.weight") == 0
    assert shard_dim("lm_head.weight") == 0
    assert shard_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert shard_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert shard_dim("model.layers.0.input_layernorm.weight") is None
    assert shard_dim("model.norm.weight") is None


def test_slices_and_refuses_a_wrong_full_shape() -> None:
    w = torch.arange(24.0).view(4, 6)
    shapes = {"a.q_proj.weight": (4, 6), "a.o_proj.weight": (4, 6), "n.norm.weight": (6,)}
    src = lambda: iter([("a.q_proj.weight", w), ("a.o_proj.weight", w),  # noqa: E731
                        ("n.norm.weight", w[0])])
    got = dict(ShardedTensors(src, shapes, 1, 2, "ckpt")())
    assert torch.equal(got["a.q_proj.weight"], w[2:])
    assert torch.equal(got["a.o_proj.weight"], w[:, 3:])
    assert torch.equal(got["n.norm.weight"], w[0])
    bad = lambda: iter([("a.q_proj.weight", w[:3])])  # noqa: E731
    with pytest.raises(CheckpointError, match=r"shape mismatch for a.q_proj.weight: checkpoint "
                                              r"\(3, 6\), model \(4, 6\) \(rank 1 of "
                                              r"tensor_parallel_size 2"):
        list(ShardedTensors(bad, shapes, 1, 2, "ckpt")())


def test_channel_frames_round_trip_and_bound() -> None:
    import socket
    import struct

    from engine.tp.channel import MAX_FRAME, Channel, Closed, Step

    a, b = socket.socketpair()
    ca, cb = Channel(a), Channel(b)
    try:
        msg = Step([([1, 2, 3], 0, [7], False), ([4], 3, [7, 8], True)], [2, 3])
        ca.send(msg)
        assert cb.recv(timeout=5) == msg
        a.sendall(struct.pack("!I", MAX_FRAME + 1))  # an oversize header: refused unread
        with pytest.raises(Closed, match="frame of"):
            cb.recv(timeout=5)
        a.sendall(struct.pack("!I", 3) + b"\x93\x01\x02")  # not a tagged frame
        with pytest.raises(Closed, match="bad frame"):
            cb.recv(timeout=5)
        ca.close()
        with pytest.raises(Closed, match="closed by peer"):
            cb.recv(timeout=5)
    finally:
        ca.close()
        cb.close()
