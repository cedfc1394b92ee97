"""A GGUF file's metadata and tensor index, read with ``struct`` over a memory map: :func:`read_index`
gives the key/value metadata as Python values and one :class:`GgufTensor` per tensor (its data a
read-only numpy view of the mapping, as ``gguf.GGUFReader`` gives it; ``gguf.quants`` dequantizes it).

Why by hand: ``gguf.GGUFReader`` builds numpy views for every element of every array field -- for
SmolLM2's 49k-token vocabulary and 48k merges, ~250k views and 2.1 s of a 3.1 s load on the 2-core
box -- while the loader wants those arrays once, as Python lists. The format (GGUF v2/v3: header,
typed key/values, tensor infos, aligned data) is small; every count and length is checked against
the bytes left before it is used, so a hostile or truncated file raises ``ValueError`` (the loader
reports it as a corrupt file) instead of allocating or reading past the end.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 2  # an array of arrays at most (GGUF writers emit no deeper nesting)
# value types: struct format of the scalars (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# tensor types stored as plain numbers (else: blocks of bytes)
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class GgufTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: fastest-varying first
    n_bytes: int
    data: np.ndarray


class _Cursor:
    """Little-endian reads from ``buf`` at ``pos``, each checked against the end."""

    def __init__(self, buf, pos: int = 0) -> None:
        self.buf, self.pos, self.end = buf, pos, len(buf)

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.end:
            raise ValueError(f"{n} bytes wanted at offset {self.pos}, the file has {self.end}")
        pos = self.pos
        self.pos += n
        return pos

    def scalar(self, fmt: str):
        return struct.unpack_from("<" + fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        pos = self.take(n)
        return bytes(self.buf[pos:pos + n]).decode("utf-8")

    def count(self, n: int, min_size: int) -> int:
        """``n`` items of at least ``min_size`` bytes each must fit in what is left."""
        if n * min_size > self.end - self.pos:
            raise ValueError(f"{n} items at offset {self.pos} do not fit in the file")
        return n

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype != 9 or depth >= MAX_NESTING:
            raise ValueError(f"unknown GGUF value type {vtype} at offset {self.pos}")
        etype = self.scalar("I")
        if etype in _NUMPY:  # numbers: one read
            dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
            n = self.count(self.scalar("Q"), dtype.itemsize)
            pos = self.take(n * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, n, pos).tolist()
        n = self.count(self.scalar("Q"), 8)  # strings and arrays: at least their 8-byte count
        if etype == 8:
            return [self.string() for _ in range(n)]
        return [self.value(etype, depth + 1) for _ in range(n)]


def read_index(path: str | Path) -> tuple[dict[str, Any], list[GgufTensor]]:
    """``(metadata, tensors)`` of the GGUF file at ``path``; ``ValueError`` if it is not one, is
    truncated or is inconsistent. The tensors' data keep the file mapped while they live."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{size} bytes: shorter than a GGUF header")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = np.frombuffer(mapped, np.uint8)  # (the views below keep the mapping alive)
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("missing the GGUF magic bytes")
    cur.take(4)
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    meta: dict[str, Any] = {}
    for _ in range(cur.count(n_kv, 12)):  # a key's length and a value type at least
        key = cur.string()
        if key in meta:
            raise ValueError(f"duplicate metadata key {key!r}")
        meta[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(cur.count(n_tensors, 24)):
        name = cur.string()
        n_dims = cur.scalar("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r}: {n_dims} dimensions")
        dims = tuple(cur.scalar("Q") for _ in range(n_dims))
        raw_type, offset = cur.scalar("I"), cur.scalar("Q")
        infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    start = -(-cur.pos // align) * align
    tensors: list[GgufTensor] = []
    names: set[str] = set()
    for name, dims, qtype, offset in infos:
        if name in names:
            raise ValueError(f"duplicate tensor {name!r}")
        names.add(name)
        n_elems = int(np.prod(dims, dtype=np.uint64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        if n_elems % block or dims[0] % block:
            raise ValueError(f"tensor {name!r}: {dims} is not a whole number of {block}-blocks")
        n_bytes = n_elems // block * type_size
        pos = start + offset
        if pos + n_bytes > size:
            raise ValueError(f"tensor {name!r}: {n_bytes} bytes at {pos} pass the end ({size})")
        np_dims = tuple(reversed(dims))
        if qtype in _PLAIN:
            data = buf[pos:pos + n_bytes].view(_PLAIN[qtype]).reshape(np_dims)
        else:
            data = buf[pos:pos + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, qtype))
        tensors.append(GgufTensor(name, qtype, dims, n_bytes, data))
    return meta, tensors
