"""engine/loader/gguf_index.py against gguf-py's own reader and writer, and hostile headers: every
count and length is checked against the bytes left, so a bad file is a ValueError, never a large
allocation or a read past the end."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from engine.loader.gguf_index import read_index


def _written(tmp_path):
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "", "ccc"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, 1.5])
    w.add_tensor("w.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("w.f16", np.ones((2, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_index_equals_gguf_readers(tmp_path):
    path = _written(tmp_path)
    meta, tensors = read_index(path)
    r = gguf.GGUFReader(path)
    keys = {k for k in r.fields if not k.startswith("GGUF.")}
    assert set(meta) == keys
    for k in keys:
        assert meta[k] == r.fields[k].contents(), k
    assert meta["t.strs"] == ["a", "", "ccc"] and meta["t.str"] == "héllo"
    assert [t.name for t in tensors] == [t.name for t in r.tensors]
    for a, b in zip(r.tensors, tensors):
        assert (a.tensor_type, list(a.shape), int(a.n_bytes)) == (b.tensor_type, list(b.shape), b.n_bytes)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    assert tensors[0].data.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()


def _header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


@pytest.mark.parametrize("body, problem", [
    (_header(0, 2**60), "do not fit"),                                      # a huge key count
    (_header(0, 1) + struct.pack("<Q", 2**40) + b"k" * 16, "bytes wanted"),     # a key longer than the file
    (_header(0, 1) + _str(b"k") + struct.pack("<IIQ", 9, 8, 2**50), "do not fit"),  # string array count
    (_header(0, 1) + _str(b"k") + struct.pack("<IIQ", 9, 4, 2**50), "do not fit"),  # number array count
    (_header(0, 1) + _str(b"k") + struct.pack("<I", 77), "unknown GGUF value type"),
    (_header(0, 1) + _str(b"k") + struct.pack("<IIQIQIQ", 9, 9, 1, 9, 1, 9, 1) + b"\0" * 16, "unknown GGUF value type"),
    (_header(0, 2) + (_str(b"k") + struct.pack("<IB", 0, 1)) * 2, "duplicate metadata key"),
    (_header(0, 0, version=1), "version 1"),
    (_header(1, 0) + _str(b"t") + struct.pack("<I", 9) + b"\0" * 64, "dimensions"),
    (_header(1, 0) + _str(b"t") + struct.pack("<IQIQ", 1, 2**40, 0, 0), "pass the end"),
    (_header(0, 1) + _str(b"general.alignment") + struct.pack("<II", 4, 3), "power of two"),
    (b"GGUX" + b"\0" * 20, "magic"),
    (b"GGUF", "shorter than a GGUF header"),
])
def test_hostile_headers_are_value_errors(tmp_path, body, problem):
    path = tmp_path / "bad.gguf"
    path.write_bytes(body)
    with pytest.raises(ValueError, match=problem):
        read_index(path)
