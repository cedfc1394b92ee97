"""Valid sample messages and hypothesis strategies for the IPC tests (imported by them)."""

from __future__ import annotations

import struct

from hypothesis import strategies as st

from engine.params import Logprobs, RequestOutput, SamplingParams
from engine.weight_ipc import IpcHandles, IpcStorage, IpcTensor
from ipc.control import (AbortAll, CloseWeightTransfer, ControlReply, InitWeightTransfer,
                         Pause, Resume, UpdateWeightsFromDistributed, UpdateWeightsFromIpc,
                         WeightInfoRequest)
from ipc.messages import (
    Abort,
    Ack,
    Drain,
    Error,
    ErrorKind,
    Generate,
    Health,
    HealthRequest,
    Hello,
    Outputs,
    Shutdown,
    Sleep,
    StateChanged,
    UpdateWeights,
    WakeUp,
    Detokenize,
    Tokenize,
    Tokens,
    Vocabulary,
    Welcome,
)
from states import State



def sample_messages() -> list:
    """At least one instance of every message type, with non-default fields set."""
    params = SamplingParams(max_tokens=32, temperature=0.7, top_k=40, top_p=0.9, seed=7,
                            stop=["\n\n"], stop_token_ids=[2], ignore_eos=True, logprobs=True,
                            min_tokens=1)
    outs = [
        RequestOutput(request_id="r1", token_ids=[42], text=" the", num_prompt_tokens=5,
                      num_output_tokens=1),
        RequestOutput(request_id="r2", token_ids=[7, 8], text="ok", num_prompt_tokens=3,
                      num_output_tokens=16, finished=True, finish_reason="length",
                      logprobs=[-0.5, -1.25],
                      token_logprobs=Logprobs(1, struct.pack("<ifiif", 7, -0.5, 0, 9, -0.25)
                                              + struct.pack("<ifiif", 8, -1.25, 0, 8, -1.25))),
        RequestOutput(request_id="r3", finished=True, finish_reason="abort", reason="client gone"),
    ]
    return [
        Hello(protocol_version=1),
        Hello(protocol_version=1, token="s3cret", client_name="bench"),
        Generate(request_id="r1", prompt="Hello, world", params=params),
        Generate(request_id="r2", prompt=[1, 2, 3, 2**31 - 1]),
        Generate(request_id="r3", prompt=""),
        Abort(request_id="r1"),
        Abort(request_id="r1", call_id=3),
        HealthRequest(),
        HealthRequest(call_id=2**63 - 1),
        Drain(timeout=12.5, call_id=1),
        Drain(),
        Shutdown(),
        Shutdown(call_id=9),
        Sleep(level=2, mode="wait", timeout=3.0, call_id=10),
        Sleep(),
        WakeUp(tags=["kv_cache"], call_id=11),
        WakeUp(),
        UpdateWeights(path="/models/step-2", call_id=12),
        UpdateWeights(path="/models/step-3", version=3),
        Sleep(level=1, tags=["kv_cache"]),
        Pause(mode="keep", timeout=2.0, call_id=20),
        Resume(call_id=21),
        AbortAll(reason="rollout over", call_id=22),
        WeightInfoRequest(call_id=23),
        InitWeightTransfer(backend="gloo", address="127.0.0.1", port=29500, rank=1, world_size=2),
        UpdateWeightsFromDistributed(metadata=[("model.norm.weight", [64], "bfloat16")], version=4),
        UpdateWeightsFromIpc(handles=IpcHandles(
            pid=42, storages=[IpcStorage(0, b"\x01" * 64, 128, 0, b"/torch_1_2_3", 0, b"", False)],
            tensors=[IpcTensor("model.norm.weight", "bfloat16", [64], [1], 0, 0)]), version=5),
        CloseWeightTransfer(call_id=24),
        ControlReply(call_id=22, count=3),
        ControlReply(call_id=23, weights=[("lm_head.weight", [49152, 576], "float32")]),
        Tokenize(call_id=4, text="hello", add_special_tokens=False),
        Detokenize(call_id=5, ids=[1, 2, 3], each=True),
        Tokens(call_id=4, ids=[7, 8]),
        Tokens(call_id=5, texts=["a", "b"]),
        Vocabulary(call_id=6),
        Tokens(call_id=6, pieces=[b"a", b"\xe2\x82", b""]),
        Welcome(protocol_version=1, state=State.SERVING, max_frame=1 << 20, client_id=4,
                model="random:tiny-llama"),
        Outputs(outputs=outs),
        Outputs(outputs=[]),
        Health(state=State.DRAINING, live=True, ready=False, running=3, waiting=1, kv_usage=0.25,
               call_id=5),
        Error(kind=ErrorKind.DRAINING, message="draining", request_id="r9", retry_after=2.0),
        Error(kind=ErrorKind.SLEEPING, message="asleep", request_id="r8", retry_after=1.0),
        Health(state=State.SLEEPING, live=True, ready=False),
        StateChanged(state=State.SLEEPING, previous=State.SERVING),
        Ack(call_id=10, state=State.SLEEPING),
        Error(kind=ErrorKind.PROTOCOL, message="bad frame", fatal=True),
        Error(kind=ErrorKind.INVALID_TRANSITION, message="nope", call_id=1, state=State.SHUTDOWN,
              trigger="drain", allowed=[]),
        StateChanged(state=State.DRAINING, previous=State.SERVING),
        StateChanged(state=State.FAILED),
        Ack(call_id=1, state=State.SHUTDOWN),
        Ack(call_id=2, request_id="r1"),
        Ack(),
    ]


# ------------------------------------------------------------------------------ strategies

_text = st.text(max_size=24)
_rid = st.text(min_size=1, max_size=24)
_call_id = st.none() | st.integers(0, 2**63 - 1)
_count = st.integers(0, 2**63 - 1)
_state = st.sampled_from(list(State))
_opt_state = st.none() | _state
_token = st.integers(0, 2**31 - 1)
_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
_seconds = st.floats(0.0, 1e9, allow_nan=False)

sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 1 << 16),
    temperature=st.floats(0.0, 100.0, allow_nan=False),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0.0, 1.0, allow_nan=False),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=6), max_size=4),
    stop_token_ids=st.lists(_token, max_size=4),
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
    min_tokens=st.integers(0, 8),
)

request_outputs = st.builds(
    RequestOutput,
    request_id=_rid,
    token_ids=st.lists(_token, max_size=4),
    text=_text,
    num_prompt_tokens=st.integers(0, 1 << 20),
    num_output_tokens=st.integers(0, 1 << 20),
    finished=st.booleans(),
    finish_reason=st.sampled_from([None, "stop", "length", "abort", "error"]),
    reason=st.none() | _text,
    logprobs=st.none() | st.lists(_finite, max_size=4),
)

messages = st.one_of(
    st.builds(Hello, protocol_version=st.integers(0, 2**31 - 1),
              token=st.none() | st.text(max_size=64), client_name=_text),
    st.builds(Generate, request_id=_rid,
              prompt=st.text(max_size=64) | st.lists(_token, max_size=64), params=sampling_params),
    st.builds(Abort, request_id=_rid, call_id=_call_id),
    st.builds(HealthRequest, call_id=_call_id),
    st.builds(Drain, timeout=_seconds, call_id=_call_id),
    st.builds(Shutdown, call_id=_call_id),
    st.builds(Sleep, level=st.sampled_from([1, 2]), mode=st.sampled_from(["abort", "wait"]),
              timeout=st.none() | _seconds, call_id=_call_id),
    st.builds(WakeUp, tags=st.none() | st.sampled_from([["weights"], ["kv_cache"], ["kv_cache", "weights"]]),
              call_id=_call_id),
    st.builds(UpdateWeights, path=st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
                                          min_size=1, max_size=64),
              call_id=_call_id),
    st.builds(Welcome, protocol_version=st.integers(0, 2**31 - 1), state=_state,
              max_frame=_count, client_id=_count, model=_text),
    st.builds(Outputs, outputs=st.lists(request_outputs, max_size=8)),
    st.builds(Health, state=_state, live=st.booleans(), ready=st.booleans(), running=_count,
              waiting=_count, kv_usage=st.floats(0.0, 1.0), call_id=_call_id),
    st.builds(Error, kind=st.sampled_from(list(ErrorKind)), message=_text,
              request_id=st.none() | _rid, call_id=_call_id, retry_after=st.none() | _seconds,
              fatal=st.booleans(), state=_opt_state, trigger=st.none() | _text,
              allowed=st.none() | st.lists(_text, max_size=4)),
    st.builds(StateChanged, state=_state, previous=_opt_state),
    st.builds(Ack, call_id=_call_id, request_id=st.none() | _rid, state=_opt_state),
)
