"""Framing: round trips over streams, limits checked before reading, and fuzzing.

The fuzz tests check that nothing a peer can send makes ``decode`` raise anything but
``ProtocolError``, or the stream reader anything but ``ProtocolError``/``ConnectionClosed``, and
that nothing hangs -- through both ways of reading, ``FrameReader.read`` (the server and the
handshake) and ``FrameReader.run`` (the client's hot path), which must agree frame for frame.
"""

from __future__ import annotations

import random
import struct
from collections import deque

import anyio
import anyio.lowlevel
from anyio.abc import ByteReceiveStream
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc.errors import ConnectionClosed, FrameTooLargeError, ProtocolError
from ipc.framing import FrameCodec, FrameReader, FrameWriter
from ipc.messages import ALL_MESSAGES, DEFAULT_MAX_FRAME, ClientMessage, Generate, Outputs
from ipc_samples import messages, sample_messages
from engine.params import RequestOutput

SAMPLES = sample_messages()
FRAMES = [FrameCodec().encode(m) for m in SAMPLES]
FUZZ = settings(max_examples=2000, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class ChunkStream(ByteReceiveStream):
    """An in-memory peer: yields ``chunks`` (split further to ``max_bytes``), then EOF -- or,
    with ``close=False``, never sends anything more (a peer that went quiet)."""

    def __init__(self, chunks: list[bytes], *, close: bool = True) -> None:
        self._chunks = deque(c for c in chunks if c)
        self._close = close
        self.received = 0

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()
        if self._chunks:
            chunk = self._chunks.popleft()
            if len(chunk) > max_bytes:
                self._chunks.appendleft(chunk[max_bytes:])
                chunk = chunk[:max_bytes]
            self.received += len(chunk)
            return chunk
        if self._close:
            raise anyio.EndOfStream
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self._chunks.clear()


def _stream_of(chunks: list[bytes], *, close: bool = True) -> ChunkStream:
    return ChunkStream(chunks, close=close)


async def read_frame(stream, max_frame: int = DEFAULT_MAX_FRAME, incoming=None):
    """One message through a fresh :class:`FrameReader` (the server's and handshake's path)."""
    codec = FrameCodec() if incoming is None else FrameCodec(incoming)
    return await FrameReader(stream, codec, max_frame=max_frame).read()


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


async def _read_all(stream, codec: FrameCodec, max_frame: int = DEFAULT_MAX_FRAME) -> list:
    out = []
    reader = FrameReader(stream, codec, max_frame=max_frame)
    with anyio.fail_after(5):
        while True:
            try:
                out.append(await reader.read())
            except ConnectionClosed:
                return out


async def _run_all(stream, codec: FrameCodec, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[list, BaseException]:
    """Every message through :meth:`FrameReader.run` (the client's path), and how it ended."""
    out: list = []
    with anyio.fail_after(5):
        try:
            await FrameReader(stream, codec, max_frame=max_frame).run(out.append)
        except (ConnectionClosed, ProtocolError) as exc:
            return out, exc
    raise AssertionError("run() returned normally")


# ------------------------------------------------------------------------------ round trips


@pytest.mark.asyncio
async def test_all_samples_round_trip_over_a_stream():
    codec = FrameCodec()
    data = b"".join(FRAMES)
    # Byte by byte, in one piece, and in uneven pieces.
    for chunks in ([data[i:i + 1] for i in range(len(data))], [data], _chunks(data, [3, 7, 100, 501])):
        assert await _read_all(_stream_of(chunks), codec) == SAMPLES
        msgs, end = await _run_all(_stream_of(chunks), codec)
        assert msgs == SAMPLES and isinstance(end, ConnectionClosed)


@pytest.mark.asyncio
async def test_encode_many_equals_concatenated_frames():
    codec = FrameCodec()
    assert codec.encode_many(SAMPLES) == b"".join(FRAMES)
    stream = _stream_of([codec.encode_many(SAMPLES)])
    assert await _read_all(stream, codec) == SAMPLES


@pytest.mark.asyncio
async def test_frame_writer_and_reader_over_a_unix_socket(tmp_path):
    from ipc.transport import connect, open_listener

    address = f"unix://{tmp_path}/s.sock"
    codec = FrameCodec()
    received: list = []
    async with await open_listener(address) as listener, anyio.create_task_group() as tg:
        async def serve_one():
            conn = await listener.accept()
            async with conn:
                received.extend(await _read_all(conn, FrameCodec()))

        tg.start_soon(serve_one)
        async with await connect(address) as client:
            writer = FrameWriter(client, codec.encode_many, send_timeout=5)
            for msg in SAMPLES:
                writer.put(msg)
            await writer.run(lambda: True)
        # the client closed: the server sees EOF after the last frame
    assert received == SAMPLES


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, min_size=1, max_size=5), st.lists(st.integers(0, 10**6), max_size=6))
@pytest.mark.asyncio
async def test_random_messages_round_trip_in_random_chunks(msgs, cuts):
    codec = FrameCodec()
    data = codec.encode_many(msgs)
    assert await _read_all(_stream_of(_chunks(data, cuts)), codec) == msgs
    assert (await _run_all(_stream_of(_chunks(data, cuts)), codec))[0] == msgs


def test_reused_buffer_does_not_leak_between_messages():
    codec = FrameCodec()
    big = Generate(request_id="a", prompt="x" * 2_000_000)
    small = Generate(request_id="b", prompt="y")
    assert codec.decode(codec.encode(big)[4:]) == big
    frame = codec.encode(small)
    assert len(frame) == 4 + len(msgspec.msgpack.encode(small))
    assert codec.decode(frame[4:]) == small


def test_encode_over_the_limit_raises():
    codec = FrameCodec(max_frame=1000)
    with pytest.raises(FrameTooLargeError):
        codec.encode(Generate(request_id="a", prompt="x" * 2000))
    # The codec is still usable, and a batch that fails does not leave partial frames behind.
    ok = Generate(request_id="a", prompt="ok")
    with pytest.raises(FrameTooLargeError):
        codec.encode_many([ok, Generate(request_id="a", prompt="x" * 2000)])
    assert codec.decode(codec.encode(ok)[4:]) == ok


def test_bad_max_frame():
    with pytest.raises(ValueError):
        FrameCodec(max_frame=0)
    with pytest.raises(ValueError):
        FrameCodec(max_frame=2**32)


# ------------------------------------------------------------------------------ limits


@pytest.mark.asyncio
async def test_oversize_header_rejected_before_the_body_is_read():
    # Header claims max+1 bytes; no body is ever sent and the stream stays open. Reading the body
    # would hang, so a prompt FrameTooLargeError proves the header was checked first.
    stream = _stream_of([struct.pack(">I", 1025)], close=False)
    with anyio.fail_after(1):
        with pytest.raises(FrameTooLargeError) as info:
            await read_frame(stream, max_frame=1024)
    assert info.value.size == 1025 and info.value.limit == 1024


@pytest.mark.asyncio
async def test_huge_header_rejected_at_default_limit():
    stream = _stream_of([b"\xff\xff\xff\xff" + b"\x00" * 10], close=False)
    with anyio.fail_after(1), pytest.raises(FrameTooLargeError):
        await read_frame(stream)


@pytest.mark.asyncio
async def test_frame_exactly_at_the_limit_is_accepted():
    body = msgspec.msgpack.encode({"t": "Generate", "request_id": "a", "prompt": "x" * 100})
    stream = _stream_of([struct.pack(">I", len(body)) + body])
    assert await read_frame(stream, max_frame=len(body)) == Generate(request_id="a", prompt="x" * 100)


@pytest.mark.asyncio
async def test_zero_length_frame_is_a_protocol_error():
    stream = _stream_of([b"\x00\x00\x00\x00"], close=False)
    with anyio.fail_after(1), pytest.raises(ProtocolError):
        await read_frame(stream)


@pytest.mark.asyncio
@pytest.mark.parametrize("data", [b"", b"\x00\x00", b"\x00\x00\x00\x10abc"], ids=["eof", "mid-header", "mid-body"])
async def test_eof_is_connection_closed(data):
    stream = _stream_of([data])
    with anyio.fail_after(1), pytest.raises(ConnectionClosed):
        await read_frame(stream)


@pytest.mark.asyncio
async def test_closed_stream_is_connection_closed():
    class Closed(ChunkStream):
        async def receive(self, max_bytes: int = 65536) -> bytes:
            raise anyio.ClosedResourceError

    with pytest.raises(ConnectionClosed):
        await read_frame(Closed([]))


@pytest.mark.asyncio
async def test_run_rejects_an_oversize_header_without_waiting_for_its_body():
    # The client's path: valid frames first are dispatched, then the bad header raises at once.
    ok = FRAMES[0]
    stream = _stream_of([ok + struct.pack(">I", 1025)], close=False)
    msgs: list = []
    with anyio.fail_after(1), pytest.raises(FrameTooLargeError):
        await FrameReader(stream, FrameCodec(), max_frame=1024).run(msgs.append)
    assert msgs == SAMPLES[:1]


@pytest.mark.asyncio
async def test_run_decodes_every_buffered_frame_before_receiving_again():
    stream = _stream_of([b"".join(FRAMES)], close=False)
    msgs: list = []

    def dispatch(msg):
        msgs.append((msg, stream.received))

    with anyio.move_on_after(0.2):
        await FrameReader(stream, FrameCodec()).run(dispatch)
    assert [m for m, _ in msgs] == SAMPLES and all(r == len(b"".join(FRAMES)) for _, r in msgs)


# ------------------------------------------------------------------------------ hostile bodies


DEPTH = 200_000


@pytest.mark.parametrize(
    "body",
    [
        b"\x91" * DEPTH + b"\xc0",                                          # [[[[...nil]]]]
        b"\x81\xc0" * DEPTH + b"\xc0",                                      # {nil: {nil: ...}}
        b"\x84\xa1t\xa8Generate\xaarequest_id\xa1a\xa6prompt" + b"\x91" * DEPTH + b"\x01",
        b"\x82\xa1t\xa7Outputs\xa7outputs" + b"\x91" * DEPTH + b"\xc0",
        b"\x82\xa1t\xa5Hello\xa1x" + b"\x91" * DEPTH + b"\xc0",             # unknown field, deep
        b"\xdd\xff\xff\xff\xff",                                            # array32 claiming 4G items
        b"\xdf\xff\xff\xff\xff",                                            # map32 claiming 4G pairs
        b"\xdb\xff\xff\xff\xff",                                            # str32 claiming 4 GiB
        b"\xc6\xff\xff\xff\xff",                                            # bin32 claiming 4 GiB
        b"\xc1",                                                            # never-used byte
        b"\xd4\x01\x00",                                                    # ext type
        b"\xc0\xc0",                                                        # trailing data
    ],
)
def test_hostile_bodies_are_protocol_errors(body):
    with pytest.raises(ProtocolError):
        FrameCodec().decode(body)


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_decode_only_raises_protocol_error(body):
    codec = FrameCodec()
    try:
        msg = codec.decode(body)
    except ProtocolError:
        return
    assert isinstance(msg, ALL_MESSAGES)


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    """Apply 1-4 random mutations: bit flips, byte overwrites, truncation, insertion, header
    rewrites and splices with other frames. (Driven by a hypothesis-drawn seed: a handful of
    draws per example keeps thousands of examples fast; a failure prints the seed.)"""
    buf = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(("flip", "byte", "truncate", "insert", "header", "splice"))
        if op == "flip" and buf:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif op == "byte" and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == "truncate":
            del buf[rng.randint(0, len(buf)):]
        elif op == "insert":
            i = rng.randint(0, len(buf))
            buf[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == "header" and len(buf) >= 4:
            n = rng.choice((rng.randrange(2**32), rng.randint(0, len(buf) + 8), 0, len(buf) - 4))
            buf[:4] = struct.pack(">I", n)
        elif op == "splice":
            other = rng.choice(FRAMES)
            buf[rng.randint(0, len(buf)):] = other[rng.randint(0, len(other)):]
    return bytes(buf)


_seeds = st.integers(0, 2**64 - 1)
VARIANTS = 5  # mutated frames per hypothesis example


@FUZZ
@given(_seeds)
def test_fuzz_mutated_frames_decode_only_raises_protocol_error(seed):
    rng = random.Random(seed)
    codecs = (FrameCodec(), FrameCodec(ClientMessage))
    for _ in range(VARIANTS):
        mutated = _mutate(rng.choice(FRAMES), rng)
        for codec in codecs:
            try:
                msg = codec.decode(mutated[4:])
            except ProtocolError:
                continue
            assert isinstance(msg, ALL_MESSAGES)


async def _drain_fuzzed_stream(chunks: list[bytes], max_frame: int) -> None:
    """The same bytes through the server's path (``read``) and the client's (``run``): only
    ConnectionClosed/ProtocolError, never a hang, and both see the same messages and end."""
    reader = FrameReader(_stream_of(chunks), FrameCodec(), max_frame=max_frame)
    seen: list = []
    while True:
        try:
            msg = await reader.read()
        except (ConnectionClosed, ProtocolError) as exc:  # ProtocolError incl. FrameTooLargeError
            end = exc
            break
        assert isinstance(msg, ALL_MESSAGES)
        seen.append(msg)
    msgs, run_end = await _run_all(_stream_of(chunks), FrameCodec(), max_frame)
    enc = msgspec.msgpack.encode  # not ==: a fuzzed float may be NaN
    assert [enc(m) for m in msgs] == [enc(m) for m in seen] and type(run_end) is type(end)


@FUZZ
@given(_seeds)
@pytest.mark.asyncio
async def test_fuzz_read_frame_over_a_stream(seed):
    """Sequences of mutated frames plus random tails, split into random chunks, through both
    reading paths: only ConnectionClosed/ProtocolError, and the reader always finishes."""
    rng = random.Random(seed)
    with anyio.fail_after(5):
        for _ in range(VARIANTS):
            data = b"".join(_mutate(rng.choice(FRAMES), rng) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.3:
                data += rng.randbytes(rng.randint(1, 64))
            cuts = [rng.randrange(len(data) + 1) for _ in range(rng.randint(0, 5))]
            max_frame = rng.choice((DEFAULT_MAX_FRAME, 64, 512))
            await _drain_fuzzed_stream(_chunks(data, cuts), max_frame)


@FUZZ
@given(st.binary(max_size=256), st.lists(st.integers(0, 300), max_size=4))
@pytest.mark.asyncio
async def test_fuzz_random_bytes_over_a_stream(data, cuts):
    with anyio.fail_after(5):
        await _drain_fuzzed_stream(_chunks(data, cuts), 128)


def test_large_outputs_batch_round_trip():
    outs = [RequestOutput(request_id=f"req-{i}", token_ids=[i], text="abc", num_prompt_tokens=10,
                          num_output_tokens=i) for i in range(4096)]
    codec = FrameCodec()
    msg = Outputs(outputs=outs)
    assert codec.decode(codec.encode(msg)[4:]) == msg
