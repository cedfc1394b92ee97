"""Logprobs (sampled, top-k, prompt), scoring-only requests and the logits processors on the
device, checked against a log-softmax of the model's own logits computed here
(``logits_reference.Reference``: a second runner, one uncached prefill of the whole sequence)."""

from __future__ import annotations

import anyio
from logits_reference import Reference
import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.errors import BadRequestError

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Paris is the capital of").strip()


@pytest.fixture(scope="module")
def ref():
    r = Reference()
    yield r
    r.close()


async def _run(eng, prompt, **kw):
    outs = [o async for o in eng.generate(prompt, SamplingParams(**kw))]
    return outs


def test_logprobs_penalties_and_biases_match_the_model(ref):
    """One engine (default model, chunked prefill: budget 8 tokens, blocks of 4) for both halves
    (an engine load is the slow part on CI): logprobs, then the logits processors."""
    ids = ref.tokenizer.encode(PROMPT)
    assert len(ids) > 24
    pids = ref.tokenizer.encode(PEN_PROMPT)

    async def main():
        cfg = EngineConfig(model="default", dtype="float32", max_num_batched_tokens=8,
                           block_size=4)
        async with AsyncEngine.open(cfg) as eng:
            await _run(eng, ids, max_tokens=2)  # fills the prefix cache with this prompt
            outs = await _run(eng, ids, max_tokens=5, logprobs=True, top_logprobs=5,
                              prompt_logprobs=3, echo=True)
            score = await _run(eng, ids, max_tokens=0, prompt_logprobs=0)
            res = await _processed(eng, pids)
        return outs, score, res

    outs, score, res = anyio.run(main)
    _check_logprobs(ref, ids, outs, score)
    _check_processed(ref, pids, res)


def _check_logprobs(ref, ids, outs, score) -> None:
    """Sampled-token and top-k logprobs of generated tokens, and prompt logprobs computed over
    chunked prefill with the prompt already in the prefix cache."""
    gen = [t for o in outs for t in o.token_ids]
    assert len(gen) == 5 and outs[-1].finish_reason == "length"
    lsm = ref.logprobs(ids + gen)
    assert outs[0].prompt_text == ref.tokenizer.decode(ids)
    plp = outs[0].prompt_logprobs
    assert [e.token_id for e in plp] == ids and plp[0].logprob is None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    for j in range(1, len(ids)):
        row = lsm[j - 1]
        e = plp[j]
        assert e.logprob == pytest.approx(row[ids[j]].item(), abs=1e-4)
        top = row.topk(3)
        assert e.top_ids == top.indices.tolist()
        assert e.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        assert e.rank == int((row > row[ids[j]]).sum()) + 1
    entries = [e for o in outs for e in o.token_logprobs]
    assert [e.token_id for e in entries] == gen
    assert [x for o in outs for x in o.logprobs] == [e.logprob for e in entries]
    for m, e in enumerate(entries):
        row = lsm[len(ids) - 1 + m]
        assert gen[m] == int(row.argmax())  # greedy
        assert e.logprob == pytest.approx(row[gen[m]].item(), abs=1e-4)
        assert e.top_ids == row.topk(5).indices.tolist()
    # scoring only: one output, no token, the prompt's logprobs
    assert len(score) == 1 and score[0].token_ids == [] and score[0].finish_reason == "length"
    assert score[0].num_output_tokens == 0
    assert [e.logprob for e in score[0].prompt_logprobs][1:] == pytest.approx(
        [lsm[j - 1, ids[j]].item() for j in range(1, len(ids))], abs=1e-4)


def _process(row: torch.Tensor, seq: list[int], n_prompt: int, p: SamplingParams) -> torch.Tensor:
    """The reference of engine.sample.logits, one row at a time, written out plainly."""
    row = row.clone()
    if p.allowed_token_ids:
        keep = torch.full_like(row, float("-inf"))
        keep[p.allowed_token_ids] = 0
        row += keep
    for t, b in p.logit_bias.items():
        row[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(seq):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    out = seq[n_prompt:]
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


PEN_PROMPT = "one two three one two three one two"


def _cases(ids):
    return [
        SamplingParams(max_tokens=6, repetition_penalty=1.8),
        SamplingParams(max_tokens=6, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(max_tokens=4, logit_bias={ids[1]: 30.0, ids[2]: -100.0}),
        SamplingParams(max_tokens=4, allowed_token_ids=[ids[0], ids[3], 13]),
        SamplingParams(max_tokens=3, min_p=0.3, temperature=1.0, seed=3),
        SamplingParams(max_tokens=6, bad_words=["of", "the way"]),
    ]


async def _processed(eng, ids) -> dict:
    """Every case at once (processed and plain rows side by side in one batch)."""
    res = {}

    async def one(k, p):
        outs = [o async for o in eng.generate(ids, p)]
        res[k] = [t for o in outs for t in o.token_ids]

    async with anyio.create_task_group() as tg:
        for k, p in enumerate(_cases(ids)):
            tg.start_soon(one, k, p)
        tg.start_soon(one, "plain", SamplingParams(max_tokens=6))
    return res


def _check_processed(ref, ids, res) -> None:
    cases = _cases(ids)
    for k, p in enumerate(cases[:4]):
        seq = list(ids)
        for _ in range(p.max_tokens):
            row = _process(ref.logits(seq)[-1], seq, len(ids), p)
            seq.append(int(row.argmax()))
        assert res[k] == seq[len(ids):], (k, p)
    assert set(res[3]) <= {ids[0], ids[3], 13}
    # min_p: every sampled token is at least min_p x as likely as the most likely one
    seq = list(ids)
    for t in res[4]:
        probs = ref.logits(seq)[-1].softmax(-1)
        assert probs[t] >= 0.3 * probs.max() - 1e-6
        seq.append(t)
    seq = list(ids)
    for _ in range(6):
        seq.append(int(ref.logits(seq)[-1].argmax()))
    assert res["plain"] == seq[len(ids):]
    _check_bad_words(ref, ids, res[5], res["plain"], cases[5].bad_words)


def _check_bad_words(ref, ids, got, plain, words) -> None:
    """Each word as written and after a space; a one-token form is never sampled, a longer
    one's last token never follows the rest of it."""
    tok = ref.tokenizer
    forms = [tok.encode(t, add_special_tokens=False) for w in words for t in (w, " " + w)]
    assert any(len(f) == 1 and f[0] in plain for f in forms)  # the ban changes this output
    assert any(len(f) > 1 for f in forms)
    seq = list(ids)
    for _ in range(6):
        row = ref.logits(seq)[-1].clone()
        out = seq[len(ids):]
        for f in forms:
            if len(f) == 1 or out[len(out) - len(f) + 1:] == f[:-1]:
                row[f[-1]] = float("-inf")
        seq.append(int(row.argmax()))
    assert got == seq[len(ids):]
    for f in forms:  # no form appears in the output
        assert all(got[i:i + len(f)] != f for i in range(len(got))), (f, got)


def test_bounds_are_checked_before_anything_is_queued():
    async def main():
        async with AsyncEngine.open(EngineConfig(model="random:tiny-llama", max_logprobs=5)) as eng:
            bad = [dict(logprobs=True, top_logprobs=6), dict(prompt_logprobs=10**9),
                   dict(logit_bias={10**6: 1.0}), dict(logit_bias={1: 101.0}),
                   dict(logit_bias={i: 1.0 for i in range(2000)}), dict(allowed_token_ids=[10**7]),
                   dict(max_tokens=0), dict(min_p=1.5), dict(repetition_penalty=0.0),
                   dict(presence_penalty=3.0), dict(bad_words=["x"] * 129), dict(bad_words=["  "]),
                   dict(bad_words=["y" * 513]), dict(bad_words=[5])]
            for kw in bad:
                with pytest.raises(BadRequestError):
                    eng.generate([1, 2, 3], SamplingParams(**kw))
            assert len(await _run(eng, [1, 2, 3], max_tokens=2)) >= 1
    anyio.run(main)


def test_logprobs_are_the_same_with_speculative_decoding():
    """Accepted draft tokens get the logprobs (and top-k, prompt logprobs) a plain step gives."""
    prompt = [5, 6, 7, 8] * 6

    async def run(**kw):
        cfg = EngineConfig(model="random:tiny-llama", device="cpu", **kw)
        async with AsyncEngine.open(cfg) as eng:
            outs = await _run(eng, prompt, max_tokens=24, ignore_eos=True, logprobs=True,
                              top_logprobs=3, prompt_logprobs=2)
            return outs, eng.statistics()

    plain, _ = anyio.run(run)
    spec, st = anyio.run(lambda: run(speculator="ngram", num_speculative_tokens=4))
    assert st.spec_accepted > 0  # drafts were accepted, several tokens a step
    for field in ("token_logprobs", "prompt_logprobs"):
        a = [e for o in plain for e in (getattr(o, field) or [])]
        b = [e for o in spec for e in (getattr(o, field) or [])]
        assert [(e.token_id, e.top_ids, e.rank) for e in a] == [(e.token_id, e.top_ids, e.rank) for e in b]
        assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-4)
