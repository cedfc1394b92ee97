"""The wire between the engine and its compile server (``compile_worker.py``): msgspec msgpack
messages in length-prefixed frames over the server's stdin and stdout pipes.

A frame is a 4-byte big-endian length then that many bytes of one message. A reader checks the
length against its bound before it takes the body (a frame over it is a broken peer), and the body
must decode as one of the messages it expects. The engine writes :class:`Start` once, then
:class:`Job` and :class:`Cancel` frames; the server answers :class:`Ready` once, then for each job
one of :class:`Done`, :class:`Failed`, :class:`Ended` (its process died) or :class:`Cancelled`.
NOTE: written here, not ``ipc/``'s framing (a layer above the engine, over sockets and anyio
streams): a blocking reader over a pipe, and an incremental one for the server's poll loop.
"""

from __future__ import annotations

import io
import os
import select
import struct
import time
from typing import Optional, Union

import msgspec

#: the largest frame the server reads: a job is at most a 64 K-character schema; the start
#: frame carries the vocabulary's tokenizer info (1.6 MB of JSON for SmolLM2's 49,152 ids)
MAX_TO_WORKER = 64 * 2**20
#: the largest frame the engine reads: a compiled grammar as JSON (~3x its memory size:
#: 0.6 MB for a 200 KB schema grammar with SmolLM2's vocabulary); a larger one is refused
#: (the request gets a 400)
MAX_FROM_WORKER = 256 * 2**20
HEADER = struct.Struct(">I")


class Start(msgspec.Struct, tag="start", forbid_unknown_fields=True):
    """The vocabulary every job compiles against: ``TokenizerInfo.serialize_json()``."""
    tokenizer_info: str


class Job(msgspec.Struct, tag="job", forbid_unknown_fields=True):
    id: int
    kind: str  # StructuredOutputs.kind
    text: str  # StructuredOutputs.text


class Cancel(msgspec.Struct, tag="cancel", forbid_unknown_fields=True):
    """Stop job ``id`` (its process is killed and reaped, then :class:`Cancelled` answers)."""
    id: int


class Ready(msgspec.Struct, tag="ready", forbid_unknown_fields=True):
    pid: int
    seconds: float  # from the process's start to its compiler's


class Done(msgspec.Struct, tag="done", forbid_unknown_fields=True):
    id: int
    grammar: str  # CompiledGrammar.serialize_json()
    seconds: float  # the compile's


class Failed(msgspec.Struct, tag="failed", forbid_unknown_fields=True):
    id: int
    message: str  # for the client: names the problem


class Ended(msgspec.Struct, tag="ended", forbid_unknown_fields=True):
    """Job ``id``'s process died before it answered (``status``: as ``waitpid`` says)."""
    id: int
    status: str


class Cancelled(msgspec.Struct, tag="cancelled", forbid_unknown_fields=True):
    id: int


ToWorker = Union[Start, Job, Cancel]
FromWorker = Union[Ready, Done, Failed, Ended, Cancelled]


class PeerGone(Exception):
    """The other end closed its pipe (exited, was killed) or sent a frame that is not one."""


_encoder = msgspec.msgpack.Encoder()


def frame(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


def write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to the blocking pipe ``fd``; :class:`PeerGone` if its reader is gone."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:  # BrokenPipeError included
        raise PeerGone(f"pipe closed ({exc.strerror or exc})") from None


def write_frame(fd: int, msg: msgspec.Struct) -> None:
    write_all(fd, frame(msg))


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
        (n,) = HEADER.unpack(self._exact(HEADER.size, deadline))
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


class FrameBuffer:
    """Frames out of bytes as they arrive (a poll loop's non-blocking reads), each at most
    ``limit`` bytes: :meth:`feed` returns the complete frames' bodies, undecoded;
    :class:`PeerGone` once a frame's length is over the bound (nothing of it is kept)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > self.limit:
                self._buf.clear()
                raise PeerGone(f"a frame of {n} bytes, over the bound of {self.limit}")
            if len(self._buf) < HEADER.size + n:
                break
            out.append(bytes(self._buf[HEADER.size:HEADER.size + n]))
            del self._buf[:HEADER.size + n]
        return out

    def __len__(self) -> int:
        return len(self._buf)


__all__ = ["Start", "Job", "Cancel", "Ready", "Done", "Failed", "Ended", "Cancelled",
           "ToWorker", "FromWorker", "PeerGone", "FrameReader", "FrameBuffer", "frame",
           "write_all", "write_frame", "MAX_TO_WORKER", "MAX_FROM_WORKER"]
