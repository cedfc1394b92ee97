"""The wire between the engine and a compile process (``compile_worker.py``): msgspec msgpack
messages in length-prefixed frames over the process's stdin and stdout pipes.

A frame is a 4-byte big-endian length then that many bytes of one message. The reader checks
the length against its bound before it reads the body (a frame over it is a broken peer), and
the body must decode as one of the messages it expects. The engine writes :class:`Start` once,
then a :class:`Job` at a time; the worker answers :class:`Ready` once, then :class:`Done` or
:class:`Failed` for each job. NOTE: written here (not ``ipc/``'s framing, a layer above the
engine, over sockets and anyio streams): a blocking reader over a raw pipe fd with a deadline.
"""

from __future__ import annotations

import io
import os
import select
import struct
import time
from typing import Optional, Union

import msgspec

#: the largest frame the worker reads: a job is at most a 64 K-character schema; the start
#: frame carries the vocabulary's tokenizer info (1.6 MB of JSON for SmolLM2's 49,152 ids)
MAX_TO_WORKER = 64 * 2**20
#: the largest frame the engine reads: a compiled grammar as JSON (~3x its memory size:
#: 0.6 MB for a 200 KB schema grammar with SmolLM2's vocabulary); the worker refuses to send
#: a larger one (the request gets a 400)
MAX_FROM_WORKER = 256 * 2**20
_HEADER = struct.Struct(">I")


class Start(msgspec.Struct, tag="start", forbid_unknown_fields=True):
    """The vocabulary every job compiles against: ``TokenizerInfo.serialize_json()``."""
    tokenizer_info: str


class Job(msgspec.Struct, tag="job", forbid_unknown_fields=True):
    id: int
    kind: str  # StructuredOutputs.kind
    text: str  # StructuredOutputs.text


class Ready(msgspec.Struct, tag="ready", forbid_unknown_fields=True):
    pid: int
    seconds: float  # from the process's start to its compiler's


class Done(msgspec.Struct, tag="done", forbid_unknown_fields=True):
    id: int
    grammar: str  # CompiledGrammar.serialize_json()
    seconds: float  # the compile's, in the worker


class Failed(msgspec.Struct, tag="failed", forbid_unknown_fields=True):
    id: int
    message: str  # for the client: names the problem


ToWorker = Union[Start, Job]
FromWorker = Union[Ready, Done, Failed]


class PeerGone(Exception):
    """The other end closed its pipe (exited, was killed) or sent a frame that is not one."""


_encoder = msgspec.msgpack.Encoder()


def write_frame(fd: int, msg: msgspec.Struct) -> None:
    """Write ``msg`` as one frame to the blocking pipe ``fd``; :class:`PeerGone` if the reader
    is gone."""
    body = _encoder.encode(msg)
    data = memoryview(_HEADER.pack(len(body)) + body)
    try:
        while data:
            data = data[os.write(fd, data):]
    except (BrokenPipeError, OSError) as exc:
        raise PeerGone(f"pipe closed ({exc.strerror or exc})") from None


class FrameReader:
    """Frames from the blocking pipe ``fd``, each at most ``limit`` bytes, decoded as ``type``."""

    def __init__(self, fd: int, type, limit: int) -> None:
        self._file = io.FileIO(fd, "rb", closefd=False)
        self._fd = fd
        self._decoder = msgspec.msgpack.Decoder(type)
        self.limit = limit

    def read(self, deadline: Optional[float] = None):
        """The next message; ``TimeoutError`` past ``deadline`` (``time.monotonic()``; None:
        none), :class:`PeerGone` at the end of the pipe or on a frame that is not one."""
        (n,) = _HEADER.unpack(self._exact(_HEADER.size, deadline))
        if n > self.limit:
            raise PeerGone(f"a frame of {n} bytes, over the bound of {self.limit}")
        try:
            return self._decoder.decode(self._exact(n, deadline))
        except msgspec.DecodeError as exc:
            raise PeerGone(f"a frame that is not a message: {exc}") from None

    def _exact(self, n: int, deadline: Optional[float]) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        poller = None
        while got < n:
            if deadline is not None:
                if poller is None:
                    poller = select.poll()
                    poller.register(self._fd, select.POLLIN)
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(max(1, int(left * 1e3) + 1)):
                    if time.monotonic() >= deadline:
                        raise TimeoutError
                    continue
            try:
                k = self._file.readinto(view[got:])
            except OSError as exc:
                raise PeerGone(f"pipe error ({exc.strerror or exc})") from None
            if not k:
                raise PeerGone("end of pipe")
            got += k
        return buf


__all__ = ["Start", "Job", "Ready", "Done", "Failed", "ToWorker", "FromWorker", "PeerGone",
           "FrameReader", "write_frame", "MAX_TO_WORKER", "MAX_FROM_WORKER"]
