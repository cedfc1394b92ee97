"""The wire protocol's messages: one tagged union, bounded, and the error mapping."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from engine.errors import (
    BadRequestError,
    EngineDeadError,
    EngineDrainingError,
    EngineShutdownError,
    EngineSleepingError,
)
from ipc.errors import (
    AuthError,
    FrameTooLargeError,
    ProtocolError,
    RemoteError,
    VersionError,
)
from ipc.framing import FrameCodec
from ipc.messages import (
    ALL_MESSAGES,
    CLIENT_MESSAGES,
    ENGINE_MESSAGES,
    MAX_REQUEST_ID_LEN,
    ClientMessage,
    EngineMessage,
    Error,
    ErrorKind,
    Generate,
    Hello,
    Sleep,
    UpdateWeights,
    WakeUp,
)
from ipc.wire_errors import error_to_message, message_to_error
from ipc_samples import messages, sample_messages
from states import InvalidTransitionError, State

enc = msgspec.msgpack.encode


def test_every_message_type_is_sampled():
    assert {type(m) for m in sample_messages()} == set(ALL_MESSAGES)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_struct_config(cls):
    cfg = cls.__struct_config__
    assert cfg.tag_field == "t"
    assert cfg.tag == cls.__name__
    assert cfg.forbid_unknown_fields and cfg.omit_defaults


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_round_trip_every_message(msg):
    codec = FrameCodec()
    frame = codec.encode(msg)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    back = codec.decode(frame[4:])
    assert type(back) is type(msg) and back == msg
    # The direction-specific decoders accept exactly their side's messages.
    side_ok = ClientMessage if isinstance(msg, CLIENT_MESSAGES) else EngineMessage
    side_bad = EngineMessage if isinstance(msg, CLIENT_MESSAGES) else ClientMessage
    assert FrameCodec(side_ok).decode(frame[4:]) == msg
    with pytest.raises(ProtocolError):
        FrameCodec(side_bad).decode(frame[4:])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_round_trip_random_messages(msg):
    codec = FrameCodec()
    assert codec.decode(codec.encode(msg)[4:]) == msg


def test_wire_form_is_a_plain_map():
    body = FrameCodec().encode(Hello(protocol_version=1, client_name="cli"))[4:]
    assert msgspec.msgpack.decode(body) == {"t": "Hello", "protocol_version": 1, "client_name": "cli"}
    body = FrameCodec().encode(Error(kind=ErrorKind.AUTH, message="x", fatal=True))[4:]
    assert msgspec.msgpack.decode(body) == {"t": "Error", "kind": 7, "message": "x", "fatal": True}


@pytest.mark.parametrize(
    "raw",
    [
        {"t": "Hello", "protocol_version": 1, "extra": 1},                       # unknown field
        {"t": "Nope"},                                                          # unknown tag
        {"protocol_version": 1},                                                # no tag
        {"t": "Hello"},                                                         # missing field
        {"t": "Hello", "protocol_version": -1},                                 # below bound
        {"t": "Hello", "protocol_version": 1, "token": "x" * 2000},             # token too long
        {"t": "Generate", "request_id": "", "prompt": "x"},                     # empty id
        {"t": "Generate", "request_id": "x" * (MAX_REQUEST_ID_LEN + 1), "prompt": "x"},
        {"t": "Generate", "request_id": "a", "prompt": [1, -2]},                # negative token
        {"t": "Generate", "request_id": "a", "prompt": [2**31]},                # token too big
        {"t": "Generate", "request_id": "a", "prompt": 5},                      # wrong type
        {"t": "Generate", "request_id": "a", "prompt": "x", "params": {"bogus": 1}},
        {"t": "Generate", "request_id": "a", "prompt": "x", "params": {"max_tokens": "9"}},
        {"t": "Drain", "timeout": -1.0},
        {"t": "Drain", "timeout": float("nan")},
        {"t": "Drain", "timeout": float("inf")},
        {"t": "Abort", "request_id": "a", "call_id": -1},
        {"t": "Health", "state": "serving", "live": True, "ready": True, "kv_usage": 1.5},
        {"t": "Welcome", "protocol_version": 1, "state": "exploded"},           # bad enum
        {"t": "Error", "kind": 99},                                             # bad ErrorKind
        # sleep mode: every field bounded at the boundary
        {"t": "Sleep", "level": 3},
        {"t": "Sleep", "level": 0},
        {"t": "Sleep", "level": True},
        {"t": "Sleep", "level": 1.0},
        {"t": "Sleep", "mode": "later"},
        {"t": "Sleep", "timeout": -1.0},
        {"t": "Sleep", "timeout": float("nan")},
        {"t": "Sleep", "timeout": 2e9},
        {"t": "Sleep", "bogus": 1},
        {"t": "WakeUp", "tags": []},
        {"t": "WakeUp", "tags": ["gpu"]},
        {"t": "WakeUp", "tags": "weights"},
        {"t": "WakeUp", "tags": ["weights", "kv_cache", "weights"]},
        {"t": "UpdateWeights"},
        {"t": "UpdateWeights", "path": ""},
        {"t": "UpdateWeights", "path": "x" * 4097},
        {"t": "UpdateWeights", "path": "/a\x00b"},
        {"t": "UpdateWeights", "path": 5},
        [1, 2, 3],
        "Hello",
        None,
    ],
)
def test_invalid_messages_are_protocol_errors(raw):
    with pytest.raises(ProtocolError):
        FrameCodec().decode(enc(raw))


def test_prompt_length_bounds():
    from ipc.messages import MAX_PROMPT_TOKENS

    codec = FrameCodec(max_frame=64 * 1024 * 1024)
    ok = enc({"t": "Generate", "request_id": "a", "prompt": [1] * MAX_PROMPT_TOKENS})
    assert len(codec.decode(ok).prompt) == MAX_PROMPT_TOKENS
    with pytest.raises(ProtocolError):
        codec.decode(enc({"t": "Generate", "request_id": "a", "prompt": [1] * (MAX_PROMPT_TOKENS + 1)}))


# ------------------------------------------------------------------------------ errors


ERRORS = [
    (BadRequestError("max_tokens must be >= 1"), ErrorKind.BAD_REQUEST),
    (EngineDrainingError("draining", retry_after=3.5), ErrorKind.DRAINING),
    (EngineShutdownError("gone"), ErrorKind.SHUTDOWN),
    (EngineSleepingError("asleep", retry_after=3.5), ErrorKind.SLEEPING),
    (EngineDeadError("engine is dead", cause=RuntimeError("boom")), ErrorKind.DEAD),
    (InvalidTransitionError(State.SHUTDOWN, "drain", []), ErrorKind.INVALID_TRANSITION),
    (InvalidTransitionError(State.SERVING, "load", ["drain", "fail"]), ErrorKind.INVALID_TRANSITION),
    (ProtocolError("bad"), ErrorKind.PROTOCOL),
    (FrameTooLargeError(1 << 30, 1 << 24), ErrorKind.TOO_LARGE),
    (AuthError("wrong token"), ErrorKind.AUTH),
    (VersionError("v2 != v1"), ErrorKind.VERSION),
    (KeyError("x"), ErrorKind.INTERNAL),
]


@pytest.mark.parametrize("exc,kind", ERRORS, ids=lambda x: type(x).__name__)
def test_error_mapping_round_trip(exc, kind):
    codec = FrameCodec()
    msg = error_to_message(exc, request_id="r1", call_id=4)
    assert msg.kind is kind
    assert msg.fatal == (kind in {ErrorKind.PROTOCOL, ErrorKind.AUTH, ErrorKind.VERSION, ErrorKind.TOO_LARGE})
    wire = codec.decode(codec.encode(msg)[4:])
    assert wire == msg
    back = message_to_error(wire)
    expected_type = RemoteError if kind is ErrorKind.INTERNAL else type(exc)
    assert type(back) is expected_type
    assert back.request_id == "r1" and back.call_id == 4
    if kind is ErrorKind.INTERNAL:
        assert str(back) == "KeyError: 'x'"
    else:
        assert str(back) == str(exc)
    if isinstance(exc, (EngineDrainingError, EngineSleepingError)):
        assert back.retry_after == 3.5 and back.retryable
    if isinstance(exc, InvalidTransitionError):
        assert (back.state, back.trigger, back.allowed) == (exc.state, exc.trigger, exc.allowed)


def test_invalid_transition_without_details_keeps_the_text():
    back = message_to_error(Error(kind=ErrorKind.INVALID_TRANSITION, message="not now"))
    assert isinstance(back, InvalidTransitionError) and str(back) == "not now"


def test_error_message_is_clipped_to_its_bound():
    codec = FrameCodec()
    msg = error_to_message(RuntimeError("x" * 100_000))
    assert codec.decode(codec.encode(msg)[4:]) == msg


def test_fatal_override():
    assert error_to_message(BadRequestError("x"), fatal=True).fatal
    assert not error_to_message(ProtocolError("x"), fatal=False).fatal


def test_generate_defaults():
    g = FrameCodec().decode(enc({"t": "Generate", "request_id": "a", "prompt": "hi"}))
    assert isinstance(g, Generate) and g.params.max_tokens == 16 and g.params.greedy


def test_engine_and_client_sets_are_disjoint():
    assert not set(CLIENT_MESSAGES) & set(ENGINE_MESSAGES)


def test_sleep_messages_were_appended_and_old_frames_are_unchanged():
    """Wire compatibility: the sleep-mode types come after every older one in the union, and
    the frames of the older types are byte for byte what they were."""
    assert CLIENT_MESSAGES[6:9] == (Sleep, WakeUp, UpdateWeights)  # then Tokenize, Detokenize, Vocabulary
    assert ErrorKind.SLEEPING == 12 and ErrorKind.PAUSED == 13  # appended
    from ipc.messages import Ack, Drain, SamplingParams

    codec = FrameCodec()
    before = [  # encoded by the protocol as it was before sleep mode (merge 09a7523)
        "0000003784a174a847656e6572617465aa726571756573745f6964a161a670726f6d7074920102a6706172"
        "616d7381aa6d61785f746f6b656e7304",
        "0000002383a174a5447261696ea774696d656f7574cb4004000000000000a763616c6c5f696407",
        "0000001f83a174a341636ba763616c6c5f696401a57374617465a873687574646f776e",
        "0000003b85a174a54572726f72a46b696e6402a76d657373616765a164aa726571756573745f6964a172ab"
        "72657472795f6166746572cb4000000000000000",
    ]
    now = [Generate(request_id="a", prompt=[1, 2], params=SamplingParams(max_tokens=4)),
           Drain(timeout=2.5, call_id=7), Ack(call_id=1, state=State.SHUTDOWN),
           Error(kind=ErrorKind.DRAINING, message="d", request_id="r", retry_after=2.0)]
    # SamplingParams has more than 15 fields since the logprobs fields were appended:
    # msgspec writes its map header as map16 (de 00 01) instead of fixmap (81); same content,
    # and both decode everywhere
    now_hex = [codec.encode(m).hex() for m in now]
    assert now_hex[1:] == before[1:]
    assert now_hex[0] == ("00000039" + before[0][8:].replace("706172616d7381", "706172616d73de0001"))
    assert [codec.decode(bytes.fromhex(h)[4:]) for h in before] == now
    assert msgspec.msgpack.decode(FrameCodec().encode(Sleep(level=2, call_id=1))[4:]) == {
        "t": "Sleep", "level": 2, "call_id": 1}
    assert FrameCodec().decode(enc({"t": "WakeUp", "tags": ["weights", "weights"]})).tags == [
        "weights", "weights"]  # duplicates are harmless: the engine keeps each tag once
    assert FrameCodec().decode(enc({"t": "UpdateWeights", "path": "p" * 4096})).path == "p" * 4096


def test_a_refused_checkpoint_is_a_bad_request_on_the_wire():
    from engine.errors import CheckpointError

    msg = error_to_message(CheckpointError("/ckpt/b", "intermediate_size 96 != 128"), call_id=3)
    assert msg.kind is ErrorKind.BAD_REQUEST and not msg.fatal
    back = message_to_error(msg)
    assert type(back) is BadRequestError and "intermediate_size" in str(back)
