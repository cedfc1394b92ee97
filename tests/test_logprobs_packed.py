"""Packed logprob rows (engine.params.Logprobs), the step's plan / device rows / unpack
(engine.sample.logprobs) against a log-softmax computed here, and the HTTP rendering of token ids
through the frontend's token table -- all without a model (milliseconds)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from engine.params import Logprobs, RequestOutput, TokenLogprob
from engine.sample import logprobs as L
from entrypoints.http.choices import TokenTable, chat_logprobs, completion_logprobs, prompt_logprobs


def _rows(k, toks, lps, ranks, tops, tlps) -> Logprobs:
    a = np.zeros((len(toks), 3 + 2 * k), dtype="<i4")
    a[:, 0], a[:, 2] = toks, ranks
    a[:, 1:2].view("<f4")[:, 0] = lps
    a[:, 3:3 + k] = tops
    a[:, 3 + k:].view("<f4")[:] = tlps
    return Logprobs(k, a.tobytes())


def test_rows_unpack_slice_join_and_cross_the_wire():
    lp = _rows(2, [5, 6, 7], [-0.5, -1.0, -2.0], [0, 3, 0], [[5, 1], [1, 6], [2, 3]],
               [[-0.5, -1.5], [-0.25, -1.0], [-0.1, -0.2]])
    assert len(lp) == 3 and lp.token_ids == [5, 6, 7] and lp.logprobs == [-0.5, -1.0, -2.0]
    assert lp[1] == TokenLogprob(6, -1.0, 3, [1, 6], [-0.25, -1.0])
    assert lp[-1].top_ids == [2, 3] and lp[0].rank is None  # rank 0: not computed
    assert [e.token_id for e in lp[1:]] == [6, 7] and len(lp[5:]) == 0
    first = Logprobs.first_prompt_token(9, 2)
    whole = Logprobs.join([first, lp[:1], lp[1:]])
    assert whole.entries()[0] == TokenLogprob(9, None, None, [], [])
    assert whole.entries()[1:] == lp.entries()
    with pytest.raises(ValueError):
        Logprobs.join([lp, Logprobs.first_prompt_token(1, 3)])
    out = RequestOutput(request_id="r", token_ids=[5, 6, 7], token_logprobs=lp, prompt_logprobs=whole)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=RequestOutput)
    assert back.token_logprobs.entries() == lp.entries() and back.prompt_logprobs == whole
    with pytest.raises(msgspec.ValidationError):  # k is bounded where it enters
        msgspec.msgpack.decode(msgspec.msgpack.encode(Logprobs(10**9, b"")), type=Logprobs)


def _req(logprobs=False, top=0, plp=None, prompt=(), computed=0):
    params = SimpleNamespace(logprobs=logprobs, top_logprobs=top, prompt_logprobs=plp)
    return SimpleNamespace(params=params, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                           num_computed_tokens=computed, num_prompt_lps=0)


def test_plan_device_rows_and_unpack_match_a_log_softmax():
    """Three entries: sampled rows with k 3 and with k 1, no logprobs, and a prefill chunk with
    prompt logprobs (k 2) that also samples -- mixed widths in one step."""
    torch.manual_seed(0)
    V = 11
    prompt = [1, 4, 2, 8, 5]
    batch = [(_req(True, 3), 1), (_req(False), 1), (_req(True, 1, plp=2, prompt=prompt), 5)]
    sample_rows = [[0], [1], [6]]  # packed rows: entry 2's chunk is rows 2..6
    plp = L.prompt_rows(batch, [0, 1, 2])
    assert [(i, t) for i, _, t in plp] == [(2, t) for t in prompt[1:]]
    logits = torch.randn(3 + len(plp), V)  # the sample rows, then the prompt rows
    sampled = torch.tensor([3, 7, 0])
    p = L.plan(batch, sample_rows, [1, 1, 1], plp, V)
    assert p.k == 3 and p.n_out == 2
    chosen = sampled[torch.tensor(p.rows[: p.n_out])]
    words = L.device_rows(logits, p, chosen).numpy()
    out, prompt_lps, floats = L.unpack(words, p, len(batch))
    lsm = logits.log_softmax(-1)
    assert out[1] is None and floats[1] is None
    for i, row in ((0, 0), (2, 2)):
        e = out[i].entries()
        k = batch[i][0].params.top_logprobs
        assert len(e) == 1 and e[0].token_id == int(sampled[i]) and out[i].k == k
        assert e[0].logprob == pytest.approx(lsm[row, sampled[i]].item(), abs=1e-5)
        assert floats[i] == [e[0].logprob]
        assert e[0].top_ids == lsm[row].topk(k).indices.tolist()
        assert e[0].top_logprobs == pytest.approx(lsm[row].topk(k).values.tolist(), abs=1e-5)
    got = prompt_lps[2].entries()
    assert [g.token_id for g in got] == prompt[1:] and prompt_lps[2].k == 2
    for m, g in enumerate(got):
        row = lsm[3 + m]
        assert g.logprob == pytest.approx(row[prompt[m + 1]].item(), abs=1e-5)
        assert g.rank == int((row > row[prompt[m + 1]]).sum()) + 1
        assert g.top_ids == row.topk(2).indices.tolist()


def test_http_renders_ids_through_the_token_table():
    table = TokenTable([b"a", b" b", b"\xe2\x82", b"\xac"])
    lp = _rows(2, [1, 2], [-0.5, -1.0], [0, 0], [[1, 0], [3, 2]], [[-0.5, -1.0], [-0.2, -1.0]])
    body, end = completion_logprobs(lp.entries(), 4, table)
    assert body["tokens"] == [" b", "\ufffd"] and body["text_offset"] == [4, 6] and end == 7
    assert body["top_logprobs"][0] == {" b": -0.5, "a": -1.0}
    chat = chat_logprobs(lp.entries(), table)
    assert chat[1]["bytes"] == [0xE2, 0x82] and chat[1]["top_logprobs"][0]["bytes"] == [0xAC]
    first = Logprobs.first_prompt_token(0, 2)
    plps = prompt_logprobs(Logprobs.join([first, lp]).entries(), table)
    assert plps[0] is None and plps[1]["1"] == {"logprob": -0.5, "rank": None, "decoded_token": " b"}
    assert table.text(99) == "" and table.piece(99) == b""  # a padded vocabulary's ids
    assert not math.isnan(sum(lp.logprobs))
