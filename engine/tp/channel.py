"""The control channel between the driver and each worker: length-prefixed msgspec frames over
one TCP connection per worker (loopback on one host). Never pickle.

Frames, in the order they flow (W = worker -> driver, D = driver -> worker):

  W Hello(rank, token)            first frame; a wrong token or rank closes the connection
  D Init(...)                     the process-group rendezvous and the driver's EngineConfig
  W Loaded(rank, max_blocks)      weights filled; the KV blocks this rank's budget allows
  D Blocks(num_blocks)            the minimum over the ranks: every rank builds the same cache
  W Ready(rank)                   KV cache and model state built
  D Step(seqs, logits_rows)       one forward (and its logits rows), in lockstep with the driver
  D Sleep(seq, level, tags)       free this rank's device memory as the driver does (sleep mode)
  D Wake(seq, tags)               bring back what ``tags`` name
  D Update(seq, names, shapes, bucket_bytes, source)
                                  new weights, checked in full by the driver: each rank's slices
                                  follow over the process group (engine/tp/update.py), not here
  W Done(seq, rank, error, ...)   one answer to each Sleep / Wake / Update: error "" is success
  D Shutdown()                    release, report, destroy the process group, exit
  W Released(rank, ...)           the weakref check of what the release left behind
  W Failed(rank, error)           any failure (load, step); the worker exits after it

A closed connection is a dead peer: the driver fails the engine, a worker exits.
"""

from __future__ import annotations

import socket
import struct
from typing import Optional, Union

import msgspec

#: a frame larger than this is a protocol error (a step of 2,048 tokens is ~40 KiB)
MAX_FRAME = 64 * 2**20
_HEADER = struct.Struct("!I")


class Hello(msgspec.Struct, tag=True, array_like=True):
    rank: int
    token: str


class Init(msgspec.Struct, tag=True, array_like=True):
    world: int
    store_host: str
    store_port: int
    backend: str
    timeout_s: float
    config_json: bytes


class Loaded(msgspec.Struct, tag=True, array_like=True):
    rank: int
    max_blocks: int


class Blocks(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


class Ready(msgspec.Struct, tag=True, array_like=True):
    rank: int


class Step(msgspec.Struct, tag=True, array_like=True, gc=False):
    # (token ids, first position, KV block ids, as decode rows): engine.forward.step_inputs.Seq
    seqs: list[tuple[list[int], int, list[int], bool]]
    logits_rows: list[int]


class Sleep(msgspec.Struct, tag=True, array_like=True):
    seq: int
    level: int
    tags: list[str]


class Wake(msgspec.Struct, tag=True, array_like=True):
    seq: int
    tags: list[str]


class Update(msgspec.Struct, tag=True, array_like=True):
    seq: int
    names: list[str]  # full (unsharded) weights, in send order, in the engine's dtype
    shapes: list[list[int]]
    bucket_bytes: int  # each rank's bucket (engine/tp/update.py)
    source: Optional[str]  # where the weights now come from (a level-2 wake reloads it)


class Done(msgspec.Struct, tag=True, array_like=True):
    seq: int
    rank: int
    error: str  # "" on success; else the rank's error (it stays usable: engine/tp/control.py)
    value: int  # the call's result: host bytes kept by a Sleep
    resources: list[str]  # what the rank's owner holds after the call (device or offloaded)
    asleep: list[str]  # the parts the rank has asleep after the call


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Released(msgspec.Struct, tag=True, array_like=True):
    rank: int
    released: list[str]  # resources, in the order released
    alive: int  # weakly referenced tensors still alive after the release and a collection
    alive_bytes: int  # storage bytes they still hold
    reachable: list[str]  # tensors still reachable from the rank's runner


class Failed(msgspec.Struct, tag=True, array_like=True):
    rank: int
    error: str
    startup: bool  # a load failure (a bad checkpoint, a bad size): exit 2 for the engine


Message = Union[Hello, Init, Loaded, Blocks, Ready, Step, Sleep, Wake, Update, Done, Shutdown,
                Released, Failed]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class Closed(ConnectionError):
    """The peer closed the connection (or it broke)."""


class Channel:
    """One blocking socket; ``send`` from one thread, ``recv`` from one thread."""

    def __init__(self, sock: socket.socket):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def send(self, msg: Message) -> None:
        body = _encoder.encode(msg)
        try:
            self.sock.sendall(_HEADER.pack(len(body)) + body)
        except OSError as exc:
            raise Closed(f"send failed: {exc}") from None

    def recv(self, timeout: Optional[float] = None) -> Message:
        self.sock.settimeout(timeout)
        (n,) = _HEADER.unpack(self._exactly(_HEADER.size))
        if n > MAX_FRAME:
            raise Closed(f"frame of {n} bytes (max {MAX_FRAME})")
        try:
            return _decoder.decode(self._exactly(n))
        except msgspec.DecodeError as exc:
            raise Closed(f"bad frame: {exc}") from None

    def _exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                chunk = self.sock.recv(n - len(out))
            except socket.timeout:
                raise
            except OSError as exc:
                raise Closed(f"recv failed: {exc}") from None
            if not chunk:
                raise Closed("connection closed by peer")
            out += chunk
        return bytes(out)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
